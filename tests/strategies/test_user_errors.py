"""A user's error inside ``strategy.run`` reaches the user as itself, under every strategy; ``CollectiveError`` is
for the collectives, and names the worker whose step raised when that is why a collective failed.

In one process (OneDevice, Mirrored with two replicas, CentralStorage) the error object the user's code raised is
the one ``run`` raises. Over gloo on loopback (tests/scripts/user_error_step.py, 2 workers: MultiWorkerMirrored,
Sharded, Mesh 1 x 2 with the heads split, Mesh over 2 data workers), one worker's model makes a shape mistake:
that worker's user sees the shape ``RuntimeError`` with their ``forward`` as the traceback's last frame, and the
other worker's ``CollectiveError`` says that worker 1 raised it, within the timeout. Each launched case prints
"the first line the user sees" per strategy.
"""

from __future__ import annotations

import dis
import json
import os
import re
import sys
import threading
import traceback
from pathlib import Path

import pytest
import torch
from helpers import LOADED_SLACK, SCRIPTS, run_bounded
from torch import nn

import distrib as ds
from distrib.cluster.launch import free_ports
from distrib.comm import CollectiveError, failures
from distrib.comm.step_errors import StepErrorBoard, describe

TIMEOUT = 20  # the collectives' bound in the launched cases: a worker that waits for the one that raised stops sooner


class _Forgetful(nn.Module):
    """An attention-like layer whose ``forward`` splits its output into heads of the whole width: a shape mistake."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).view(x.shape[0], 4, 16)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ds.OneDeviceStrategy("cpu"),
        lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    ],
    ids=["one-device", "mirrored", "central-storage"],
)
@pytest.mark.parametrize("kind", ["shape", "ValueError", "KeyError"])
def test_the_users_error_in_one_process_is_the_object_it_raised(make, kind):
    strategy = make()
    with strategy.scope():
        model = _Forgetful()
    raised: list[BaseException] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        try:
            if kind == "ValueError":
                raise ValueError("the labels must be integers")
            if kind == "KeyError":
                return {"logits": model.proj(x)}["logit"]
            return model(x)
        except Exception as e:
            raised.append(e)
            raise

    data = strategy.experimental_distribute_dataset([torch.randn(8, 16)])
    with pytest.raises(Exception) as caught:
        strategy.run(step, args=(next(iter(data)),))
    error = caught.value
    assert error is raised[0] and type(error) is {"shape": RuntimeError, "ValueError": ValueError}.get(kind, KeyError)
    last = traceback.extract_tb(error.__traceback__)[-1]
    assert last.filename == __file__ and last.name in ("step", "forward"), last
    if strategy.num_local_replicas > 1:  # the replica threads say whose error it is
        assert getattr(error, "__notes__", ["(raised in replica 0 of 2)"]) == ["(raised in replica 0 of 2)"], error
    print(f"USER ERROR {strategy.__class__.__name__}, {kind}: {traceback.format_exception_only(type(error), error)[0]}")


def _two_workers(*args: str, limit: float = 120) -> tuple[dict[int, str], dict[int, dict[str, str]]]:
    """tests/scripts/user_error_step.py ARGS as workers 0 and 1 of a TF_CONFIG cluster on loopback, each left to
    end by itself (``distrib launch`` would stop the other worker as soon as one fails, before it could say why
    its collective failed). Returns each worker's output and its RAISED, AFTER, LAST FRAME and NOTES lines."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    outs: dict[int, str] = {}

    def run(index: int) -> None:
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(config))
        try:
            outs[index] = run_bounded([sys.executable, str(SCRIPTS / "user_error_step.py"), *args], limit, env=env)[1]
        except BaseException as e:  # noqa: BLE001 - an overrun (pytest.fail) is reported from the test's thread
            outs[index] = f"worker {index} did not finish: {e}"

    threads = [threading.Thread(target=run, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines: dict[int, dict[str, str]] = {}
    for index, out in outs.items():
        found = lines.setdefault(index, {})
        for line in out.splitlines():
            m = re.match(r"(RAISED|AFTER|LAST FRAME|NOTES) (.*)", line)
            if m:
                found[m.group(1)] = m.group(2)
    return outs, lines


@pytest.mark.parametrize("strategy", ["multi-worker", "sharded", "mesh", "mesh-fsdp"])
def test_a_shape_error_on_one_worker_is_its_users_error_and_the_others_name_it(strategy):
    outs, lines = _two_workers(strategy, "1", str(TIMEOUT))
    raised, waiting = lines[1], lines[0]
    print(f"FIRST LINE {strategy}, worker 1 (raised): {raised.get('RAISED')}")
    print(f"FIRST LINE {strategy}, worker 0 (waiting): {waiting.get('RAISED', '')[:260]}")
    assert re.fullmatch(r"RuntimeError: shape '\[\d+, 4, 4, 16\]' is invalid for input of size \d+", raised["RAISED"])
    assert raised["LAST FRAME"] == "user_error_step.py:forward", raised
    assert "worker 1 of 2" in raised["NOTES"], raised
    assert waiting["RAISED"].startswith("distrib.comm.communicator.CollectiveError: "), outs[0]
    assert "because worker 1 raised RuntimeError: shape '[" in waiting["RAISED"], waiting
    assert "A peer died" not in waiting["RAISED"], waiting
    assert float(waiting["AFTER"].split()[0]) < TIMEOUT, waiting  # ended by the exit, not the timeout


def test_a_worker_that_raised_and_stayed_is_named_at_the_others_timeout():
    """The worker whose step raised catches its error and goes on: the other's collective ends at its timeout (5 s),
    and says which worker raised what."""
    outs, lines = _two_workers("sharded", "1", "5", "stay")
    assert "because worker 1 raised RuntimeError: shape '[" in lines[0].get("RAISED", ""), outs[0]
    assert 5 <= float(lines[0]["AFTER"].split()[0]) < 5 + LOADED_SLACK, lines[0]


def test_when_worker_0_raised_the_others_say_it_is_gone_not_that_they_timed_out():
    """Worker 0 hosts the store: when its step raises and its process ends, the others' collectives fail with the
    store gone, and say that worker 0 is gone rather than blaming the network or the timeout."""
    outs, lines = _two_workers("sharded", "0", str(TIMEOUT))
    assert lines[0]["RAISED"].startswith("RuntimeError: shape '["), outs[0]
    assert "Worker 0 is gone" in lines[1].get("RAISED", ""), outs[1]
    assert "frame #0" not in outs[1], outs[1]  # no C++ stack of a store client's failed retries


# ---------------------------------------------------------------- where an exception came from


def _raised_in(path: str, source: str, name: str) -> BaseException:
    """The exception that ``name()`` raises, ``name`` compiled as if it were in the file ``path``."""
    scope: dict = {"torch": torch}
    exec(compile(source, path, "exec"), scope)
    try:
        scope[name]()
    except BaseException as e:  # noqa: BLE001 - returned for classification
        return e
    raise AssertionError("did not raise")


TORCH = str(Path(torch.__file__).parent)


def test_a_collectives_frame_that_got_an_error_from_cpp_is_a_collective_failure():
    call = "def work():\n    return torch.empty(2).view(3)\n"  # a RuntimeError from C++, as gloo's are
    assert failures.is_collective_failure(_raised_in(f"{TORCH}/distributed/distributed_c10d.py", call, "work"))
    # the same error in the user's code, or in torch's code that ran the user's op, is the user's
    assert not failures.is_collective_failure(_raised_in("/home/user/train.py", call, "work"))
    assert not failures.is_collective_failure(_raised_in(f"{TORCH}/nn/modules/linear.py", call, "work"))
    assert not failures.is_collective_failure(_raised_in(f"{TORCH}/distributed/tensor/_dispatch.py", call, "work"))


def test_pass_through_frames_are_skipped_and_a_raise_statement_is_torchs_own_check():
    inner = "def op():\n    return torch.empty(2).view(3)\n"
    scope: dict = {"torch": torch}
    exec(compile(inner, f"{TORCH}/_ops.py", "exec"), scope)  # an operator's __call__ between
    outer = "def wait():\n    return op()\n"
    scope2: dict = {"op": scope["op"]}
    exec(compile(outer, f"{TORCH}/distributed/_functional_collectives.py", "exec"), scope2)
    try:
        scope2["wait"]()
    except RuntimeError as e:
        assert failures.is_collective_failure(e)
    check = "def refuse():\n    raise RuntimeError('Invalid process group specified')\n"
    assert not failures.is_collective_failure(_raised_in(f"{TORCH}/distributed/distributed_c10d.py", check, "refuse"))
    assert failures._RAISE_OPCODE == dis.opmap["RAISE_VARARGS"]


def test_torchs_distributed_errors_and_distribs_own_are_collective_failures_other_types_are_not():
    assert failures.is_collective_failure(CollectiveError("a peer died"))
    assert failures.is_collective_failure(torch.distributed.DistNetworkError("the store is gone"))
    for error in (ValueError("x"), KeyError("x"), TypeError("x")):
        assert not failures.is_collective_failure(error)


def test_every_torch_file_the_rule_names_is_in_this_torch():
    """A torch that moved one would turn its collectives' failures into plain errors: fail here instead."""
    torch_files = [p for p in (*failures.COLLECTIVE_SITES, *failures.PASS_THROUGH) if p.startswith("torch/")]
    missing = [p for p in torch_files if not (Path(TORCH).parent / p).is_file()]
    assert not missing, missing


def test_the_board_reports_reads_and_withdraws_a_steps_error():
    store = torch.distributed.HashStore()
    one, other = StepErrorBoard(store, 1, 2, 30), StepErrorBoard(store, 0, 2, 30)
    assert other.others() == [] and other.explain("all-reduce", RuntimeError("closed")) is None
    two_lines = ValueError("bad labels\nsecond line")
    one.report(f"worker 1 raised {describe(two_lines)}")
    assert one.reported and other.others() == ["worker 1 raised ValueError: bad labels"]
    told = other.explain("all-reduce", RuntimeError("Connection closed by peer"))
    assert told is not None and "because worker 1 raised ValueError: bad labels in its step" in told
    one.withdraw()
    assert not one.reported and other.others() == []
