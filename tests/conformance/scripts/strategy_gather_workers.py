"""The multi-worker half of TF's strategy_gather_test.py (GatherTest), run on a chief and one worker.

    distrib launch --chief --workers 1 tests/conformance/scripts/strategy_gather_workers.py

TF's ``multi_worker_mirrored_2x1_cpu`` is ``MultiWorkerMirroredStrategy()`` (one replica per process), its
``multi_worker_mirrored_2x2_gpu`` is ``MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])`` in the same
processes. Every check runs on both tasks in the same order and prints
``RESULT {"name": ..., "task": ..., "value": ...}`` (an error: ``{"error": "Type: message"}``);
tests/conformance/test_strategy_gather.py asserts on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

import distrib as ds

# TF's single values of the same-shape cases: (value, axis)
SAME_SHAPE = {
    "Dense1D0Axis": ([1, 2, 3], 0),
    "Dense2D0Axis": ([[1, 2, 3]], 0),
    "Dense2D1Axis": ([[1, 2, 3]], 1),
    "Dense3D0Axis": ([[[1, 2], [1, 2]]], 0),
    "Dense3D1Axis": ([[[1, 2], [1, 2]]], 1),
    "Dense3D2Axis": ([[[1, 2], [1, 2]]], 2),
}


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"sparse": value.to_dense().tolist()} if value.is_sparse else value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def reporter(task: str) -> Callable[[str, Callable[[], Any]], None]:
    def report(name: str, fn: Callable[[], Any]) -> None:
        try:
            value = plain(fn())
        except Exception as e:  # noqa: BLE001 - reported to the test
            value = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps({"name": name, "task": task, "value": value}), flush=True)

    return report


def shape_fn(kind: str) -> Callable[[Any], torch.Tensor]:
    """TF's value_fn of the different-shape cases."""
    return {
        "axis0": lambda ctx: torch.ones(ctx.replica_id_in_sync_group + 1, 1, dtype=torch.int32),
        "axis1": lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1, dtype=torch.int32),
        "rank": lambda ctx: torch.ones(*range(1, ctx.replica_id_in_sync_group + 2)),
    }[kind]


def all_gather_fn(axis: int) -> Callable[[Any], Any]:
    return lambda value: ds.get_replica_context().all_gather(value, axis=axis)


def sparse_value() -> torch.Tensor:
    """TF's ``IndexedSlices(values=[[1., 2.]], indices=[2], dense_shape=[5, 2])``."""
    return torch.sparse_coo_tensor([[2]], [[1.0, 2.0]], (5, 2), check_invariants=True)


def main() -> None:
    options = ds.CommunicationOptions(timeout_seconds=20)
    strategies = {
        "2x1": ds.MultiWorkerMirroredStrategy(communication_options=options),
        "2x2": ds.MultiWorkerMirroredStrategy(communication_options=options, devices=["cpu:0", "cpu:1"]),
    }
    report = reporter(strategies["2x1"].cluster_resolver.task_type)
    for topology, s in strategies.items():

        def local(value: Any, s: ds.Strategy = s) -> tuple[Any, ...]:
            return s.experimental_local_results(value)

        for case, (single, axis) in SAME_SHAPE.items():
            values = s.experimental_distribute_values_from_function(lambda _, single=single: torch.tensor(single))
            report(f"gather_{case}_{topology}", lambda: s.gather(values, axis=axis))
            report(f"all_gather_{case}_{topology}", lambda: local(s.run(all_gather_fn(axis), args=(values,))))

        for kind, axis in (("axis0", 0), ("axis1", 1)):
            values = s.experimental_distribute_values_from_function(shape_fn(kind))
            report(f"gather_diff_shape_{kind}_{topology}", lambda: s.gather(values, axis=axis))
            report(
                f"all_gather_diff_shape_{kind}_{topology}", lambda: local(s.run(all_gather_fn(axis), args=(values,)))
            )

        # errors: different shape at a non-axis dimension, different rank, sparse values
        for kind in ("axis1", "rank"):
            values = s.experimental_distribute_values_from_function(shape_fn(kind))
            report(f"gather_raise_{kind}_{topology}", lambda: s.gather(values, axis=0))
            report(f"all_gather_raise_{kind}_{topology}", lambda: s.run(all_gather_fn(0), args=(values,)))
        report(f"gather_raise_sparse_{topology}", lambda: s.gather(sparse_value(), axis=0))
        report(f"all_gather_raise_sparse_{topology}", lambda: s.run(all_gather_fn(0), args=(sparse_value(),)))

        # nests
        nest_values = s.experimental_distribute_values_from_function(shape_fn("axis1"))
        value_2 = torch.tensor([[[1, 2], [1, 2]]])

        def nest_fn(value: Any) -> Any:
            return ds.get_replica_context().all_gather([value, value_2], axis=1)

        report(f"all_gather_nest_{topology}", lambda: [local(r) for r in s.run(nest_fn, args=(nest_values,))])

        def nest_1d_fn() -> Any:
            single = torch.tensor([1, 2, 3])
            return ds.get_replica_context().all_gather([single, single], axis=0)

        report(f"all_gather_nest_1d_{topology}", lambda: [local(r) for r in s.run(nest_1d_fn)])

        # gradients
        c = s.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][ctx.replica_id_in_sync_group]])
        )

        def gradient_step(c: torch.Tensor, nest: bool = False) -> torch.Tensor:
            x = torch.tensor([[3.0], [5.0]], requires_grad=True)
            y = torch.tensor([[2.0], [4.0]])
            mid = ds.get_replica_context().all_gather([x, y] if nest else x, 1)
            out = mid[0] * c if nest else mid * c
            (grad,) = torch.autograd.grad(out.sum(), [x])
            return grad

        report(f"all_gather_gradient_{topology}", lambda: local(s.run(gradient_step, args=(c,))))
        report(
            f"all_gather_gradient_nest_{topology}",
            lambda: local(s.run(lambda c: gradient_step(c, nest=True), args=(c,))),
        )
    print("DONE", flush=True)


if __name__ == "__main__":  # a script for `distrib launch`; importing it (pytest's doctest collection) runs nothing
    main()
