"""TF's nested exception cases of ``_test_call_and_merge_exceptions`` (strategy_test_lib.py), one per process.

    python tests/conformance/scripts/merge_call_nested.py merge_call_raises|merge_call_merge_raises

On ``MirroredStrategy(["cpu:0", "cpu:1"])``, a replica function calls ``merge_call`` whose ``merge_fn`` calls
``strategy.run`` again (TF's ``call_for_each_replica``), and the innermost function raises ``_TestException``.
Prints ``RAISED _TestException`` when the exception reaches the caller, as TF asserts. Run in its own process
because a deadlock here would leave the strategy's scope open in the calling process.
"""

from __future__ import annotations

import sys

import distrib as ds


class _TestException(Exception):
    pass


def _raise_exception_fn(_: object = None) -> None:
    raise _TestException()


def _merge_raises_fn() -> None:
    ds.get_replica_context().merge_call(_raise_exception_fn)


def _call_raises_fn(dist: ds.Strategy) -> None:
    dist.run(_raise_exception_fn)


def _merge_call_raises_fn() -> None:
    ds.get_replica_context().merge_call(_call_raises_fn)


def _call_merge_raises_fn(dist: ds.Strategy) -> None:
    dist.run(_merge_raises_fn)


def _merge_call_merge_raises_fn() -> None:
    ds.get_replica_context().merge_call(_call_merge_raises_fn)


def main(case: str) -> None:
    fn = {"merge_call_raises": _merge_call_raises_fn, "merge_call_merge_raises": _merge_call_merge_raises_fn}[case]
    dist = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with dist.scope():
        try:
            dist.run(fn)
        except _TestException:
            print("RAISED _TestException", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(f"RAISED {type(e).__name__}: {e}", flush=True)
        else:
            print("RETURNED", flush=True)


if __name__ == "__main__":  # importing it (pytest's doctest collection) runs nothing
    main(sys.argv[1])
