"""TF's "Distributed input" tutorial and "Distributed training" guide, translated under examples/, run for real.

Each script runs as its own process (the input tutorial also as 2 workers under ``distrib launch``);
the tests assert the printed lines whose values depend on distribution working: how each global
batch is split, what each worker reads, how many steps each pipeline gives, which replica gets
which value, and that training on 2 replicas gives the same losses as on 1. The output is printed
(``pytest -s`` shows it).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from helpers import launch, run_bounded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
INPUT = EXAMPLES / "input_tutorial.py"
GUIDE = EXAMPLES / "distributed_training_guide.py"


def run(script: Path, *args: str, timeout: float = 180) -> str:
    code, out, _ = run_bounded([sys.executable, str(script), *args], timeout=timeout)
    print(f"$ python {script.name} {' '.join(args)}\n{out}")
    assert code == 0, out
    return out


def worker_lines(out: str, worker: int) -> list[str]:
    prefix = f"[worker {worker}] "
    return [line[len(prefix) :] for line in out.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def input_single() -> str:
    return run(INPUT)


@pytest.fixture(scope="module")
def input_two_workers() -> list[list[str]]:
    code, out, _ = launch("--workers", "2", str(INPUT), timeout=240)
    print(f"$ distrib launch --workers 2 {INPUT.name}\n{out}")
    assert code == 0, out
    return [worker_lines(out, 0), worker_lines(out, 1)]


def generator_values(text: str) -> list[list[str]]:
    """The 2-element float tensors the from_generator cell printed, in order."""
    return re.findall(r"tensor\(\[(0\.\d+), (0\.\d+)\]\)", text)


def test_input_tutorial_one_process_two_replicas(input_single):
    out = input_single
    lines = out.splitlines()
    assert lines[1:4] == ["Available devices:", "0) cpu:0", "1) cpu:1"]
    # Batching: the tutorial's three examples, split as evenly as possible
    assert "range(6).batch(4) over 2 replicas: Batch 2: Replica 1: [4], Replica 2: [5]" in lines
    assert (
        "range(4).batch(4) over 5 replicas: Batch 1: Replica 1: [0], Replica 2: [1], Replica 3: [2], "
        "Replica 4: [3], Replica 5: []"
    ) in lines
    assert "range(8).batch(4) over 3 replicas: Batch 2: Replica 1: [4, 5], Replica 2: [6], Replica 3: [7]" in lines
    # one worker: every policy reads everything
    for policy in ("DATA", "FILE", "OFF"):
        assert [line for line in lines if line.startswith(f"{policy}:")] == [
            f"{policy}: Worker 0: Batch 1 = Replica 1: [0, 1], Replica 2: [2, 3]",
            f"{policy}: Worker 0: Batch 2 = Replica 1: [4, 5], Replica 2: [6, 7]",
            f"{policy}: Worker 0: Batch 3 = Replica 1: [8, 9], Replica 2: [10, 11]",
        ]
    # distribute_datasets_from_function: 64 examples, per-replica batch 16 / 2 = 8, 2 local replicas a step
    assert "Worker 0 of 1: per-replica batch size 8 (2 replicas in sync)" in lines
    assert "Worker 0: 4 steps, per-replica batch sizes [[8, 8], [8, 8], [8, 8], [8, 8]]" in lines
    # for-loop: 7 global batches of 100 examples; iter/next: 10 epochs x 5 steps
    assert out.count("Loss is  PerReplica:{") == 7 + 50
    assert "OutOfRangeError: End of sequence" in lines
    # get_next_as_optional over range(9).batch(4): 3 steps, the last one partial
    assert [line for line in lines if line.startswith("(tensor(")] == [
        "(tensor([0, 1]), tensor([2, 3]))",
        "(tensor([4, 5]), tensor([6, 7]))",
        "(tensor([8]), tensor([], dtype=torch.int64))",
    ]
    spec = "[TensorSpec(shape=(None, 1), dtype=torch.float32), TensorSpec(shape=(None, 1), dtype=torch.float32)]"
    assert f"element_spec: {spec}" in lines and f"iterator element_spec: {spec}" in lines
    # StringLookup over a, c, e, a, ... (e is out of vocabulary: 0), per-replica batches of 2
    assert "0: tensor([1, 3]),\n  1: tensor([0, 1])" in out and "0: tensor([3, 0]),\n  1: tensor([1, 3])" in out
    assert "Partial batches: Worker 0: per-replica batch sizes [[2, 2], [2, 2], [1, 0]]" in lines
    assert "Partial batches (global batch 4): Worker 0: per-replica batch sizes [[2, 2], [2, 2], [1, 0]]" in lines
    # ordering outputs: every index once, with its value doubled
    result = ast.literal_eval(next(line for line in lines if line.startswith("{0: ")))
    assert result == {i: 2 * i for i in range(24)}
    # experimental_distribute_values_from_function: each replica its id
    assert out.count("PerReplica:{\n  0: tensor(0),\n  1: tensor(1)\n}") == 4
    assert len(generator_values(out)) == 8  # 4 steps x 2 replicas, 2 of the generator's 4 values each


def test_input_tutorial_two_workers(input_two_workers, input_single):
    w0, w1 = input_two_workers
    for k, lines in enumerate((w0, w1)):
        assert lines[1:3] == ["Available devices:", "0) cpu:0"]
        assert f"Worker {k} of 2: per-replica batch size 8 (2 replicas in sync)" in lines
        # each worker reads 32 of the 64 examples: 4 per-replica batches of 8
        assert f"Worker {k}: 4 steps, per-replica batch sizes [[8], [8], [8], [8]]" in lines
        assert sum(line.startswith("Loss is ") for line in lines) == 7 + 50
        assert [line for line in lines if line.startswith("OFF:")] == [
            f"OFF: Worker {k}: Batch {b + 1} = Replica {k + 1}: [{2 * b}, {2 * b + 1}]" for b in range(6)
        ]
    # DATA: each worker keeps its replica's half of every global batch of 4
    assert [line for line in w0 if line.startswith("DATA:")] == [
        "DATA: Worker 0: Batch 1 = Replica 1: [0, 1]",
        "DATA: Worker 0: Batch 2 = Replica 1: [4, 5]",
        "DATA: Worker 0: Batch 3 = Replica 1: [8, 9]",
    ]
    assert [line for line in w1 if line.startswith("DATA:")] == [
        "DATA: Worker 1: Batch 1 = Replica 2: [2, 3]",
        "DATA: Worker 1: Batch 2 = Replica 2: [6, 7]",
        "DATA: Worker 1: Batch 3 = Replica 2: [10, 11]",
    ]
    # FILE: each worker reads its own file
    assert [line for line in w0 if line.startswith("FILE:")] == [
        "FILE: Worker 0: Batch 1 = Replica 1: [0, 1]",
        "FILE: Worker 0: Batch 2 = Replica 1: [2, 3]",
        "FILE: Worker 0: Batch 3 = Replica 1: [4, 5]",
    ]
    assert [line for line in w1 if line.startswith("FILE:")] == [
        "FILE: Worker 1: Batch 1 = Replica 2: [6, 7]",
        "FILE: Worker 1: Batch 2 = Replica 2: [8, 9]",
        "FILE: Worker 1: Batch 3 = Replica 2: [10, 11]",
    ]
    # get_next_as_optional: the last global batch [8] leaves worker 1 an empty batch, and both stop together
    assert [line for line in w0 if line.startswith("(tensor(")] == [
        "(tensor([0, 1]),)",
        "(tensor([4, 5]),)",
        "(tensor([8]),)",
    ]
    assert [line for line in w1 if line.startswith("(tensor(")] == [
        "(tensor([2, 3]),)",
        "(tensor([6, 7]),)",
        "(tensor([], dtype=torch.int64),)",
    ]
    # StringLookup batches sharded over the 2 pipelines: worker 0 the even batches, worker 1 the odd ones
    assert [line for line in w0 if re.fullmatch(r"tensor\(\[\d, \d\]\)", line)] == [
        "tensor([1, 3])",
        "tensor([3, 0])",
        "tensor([0, 1])",
    ]
    assert [line for line in w1 if re.fullmatch(r"tensor\(\[\d, \d\]\)", line)] == [
        "tensor([0, 1])",
        "tensor([1, 3])",
        "tensor([3, 0])",
    ]
    # partial batches: worker 1's pipeline (4 examples) ends a step early; it feeds an empty batch
    assert "Partial batches: Worker 0: per-replica batch sizes [[2], [2], [1]]" in w0
    assert "Partial batches: Worker 1: per-replica batch sizes [[2], [2], [0]]" in w1
    assert "Partial batches (global batch 4): Worker 1: per-replica batch sizes [[2], [2], [0]]" in w1
    # ordering outputs: the workers' results are disjoint halves of the whole
    results = [ast.literal_eval(next(line for line in lines if line.startswith("{"))) for lines in (w0, w1)]
    assert len(results[0]) == len(results[1]) == 12 and not set(results[0]) & set(results[1])
    assert {**results[0], **results[1]} == {i: 2 * i for i in range(24)}
    # values_from_function: replica_id_in_sync_group counts over the workers
    assert w0.count("tensor(0)") == 4 and w1.count("tensor(1)") == 4
    # from_generator: the same global batches as in one process, worker k holding replica k's half
    single = generator_values(input_single)
    assert generator_values("\n".join(w0)) == single[0::2]
    assert generator_values("\n".join(w1)) == single[1::2]


@pytest.fixture(scope="module")
def guide_runs() -> dict[int, str]:
    return {replicas: run(GUIDE, "--replicas", str(replicas)) for replicas in (2, 1)}


def fit_losses(out: str) -> list[str]:
    return re.findall(r"10/10 - \S+ - loss: ([\d.]+)", out)


def ctl_losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^tensor\(([\d.]+)\)$", out, re.M)]


def test_distributed_training_guide(guide_runs):
    out = guide_runs[2]
    lines = out.splitlines()
    assert "MirroredStrategy(devices=['cpu:0', 'cpu:1'], num_replicas_in_sync=2)" in lines
    assert "ParameterServerStrategy with 2 workers and 1 ps; ClusterCoordinator" in lines
    assert any("CentralStorageStrategy" in line for line in lines)
    assert "DefaultStrategy(devices=['default'], num_replicas_in_sync=1)" in lines
    assert "OneDeviceStrategy(devices=['/cpu:0'], num_replicas_in_sync=1)" in lines
    assert "global_batch_size: 10 learning_rate: 0.15" in lines
    assert "global_batch_size: 5 learning_rate: 0.1" in guide_runs[1].splitlines()
    assert (
        "{'worker': ['host1:2222', 'host2:2222', 'host3:2222'], 'ps': ['host4:2222', 'host5:2222']} worker 1" in lines
    )
    # fit: 2 + 2 epochs (and evaluate) of 10 steps; the loss falls
    losses = [float(x) for x in fit_losses(out)]
    assert len(losses) == 5 and losses[0] > losses[1] > losses[2] and losses[3] > losses[4]
    # custom loop: 1000 examples in global batches of 10, then 10 more steps from a new iterator
    ctl = ctl_losses(out)
    assert len(ctl) == 1 + 100 + 10 and ctl[0] == 1.0  # the first is strategy.reduce("SUM", 1.)
    assert all(b < a for a, b in zip(ctl[1:101], ctl[2:101]))


def test_distributed_training_guide_two_replicas_train_as_one(guide_runs):
    """Every example is the same, so the loss after n steps does not depend on the batch size: on 2 replicas
    (global batch 10) and on 1 (global batch 5) the losses must agree step for step, in fit and in the custom
    loop, if gradients are summed over replicas and the loss scaled by the global batch."""
    two, one = guide_runs[2], guide_runs[1]
    assert fit_losses(two) == fit_losses(one)
    ctl_two, ctl_one = ctl_losses(two), ctl_losses(one)
    assert len(ctl_one) == 1 + 200 + 10
    assert ctl_two[:101] == pytest.approx(ctl_one[:101], abs=2e-4)
