"""Conformance: TF's ``tensorflow/python/distribute/strategy_gather_test.py`` (``GatherTest``), ported to distrib.

Strategies: TF's ``default_strategy``, ``one_device_strategy``, ``mirrored_strategy_with_one_cpu`` and
``mirrored_strategy_with_two_cpus`` are ``ds.get_strategy()``, ``ds.OneDeviceStrategy("cpu")``,
``ds.MirroredStrategy(["cpu:0"])`` and ``ds.MirroredStrategy(["cpu:0", "cpu:1"])``; its
``central_storage_strategy_with_two_gpus`` / ``..._with_gpu_and_cpu`` are ``ds.CentralStorageStrategy(["cpu:0", "cpu:1"])``. TF's
``multi_worker_mirrored_2x1_cpu`` / ``2x2_gpu`` are a chief and a worker process started once for the module by
``distrib launch --chief --workers 1 scripts/strategy_gather_workers.py``, with one and with two logical CPU
replicas each. TF's ``pure_eager`` True/False (eager vs ``tf.function``) collapse into eager PyTorch, and
``tf.gradients`` inside a ``tf.function`` becomes ``torch.autograd.grad``. TF's ``IndexedSlices`` are torch sparse
COO tensors. TF's shape errors (``InvalidArgumentError`` / ``ValueError``) are a ``RuntimeError`` (PyTorch's error
for mismatched shapes in an op) within a process, and a ``ds.CollectiveError`` (a ``RuntimeError``) naming every
worker's shape across processes.

Not ported, and why:
- ``testAllGatherDiffValueTPU``: TPU only.
- The GPU-only combinations (``one_device_strategy_gpu``, ``mirrored_strategy_with_one_gpu``, ...): no distinct
  distrib code path from their CPU counterparts here; the TPU ones: TPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance.workers import on_workers, run_worker_checks

import distrib as ds

SCRIPT = Path(__file__).parent / "scripts" / "strategy_gather_workers.py"
DEFAULT_STRATEGY = ds.get_strategy()
STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": lambda: DEFAULT_STRATEGY,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_one_cpu": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_two_cpus": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_two_cpus": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
TASKS = ("chief", "worker")
TOPOLOGIES = {"2x1": 2, "2x2": 4}  # replicas in sync
SHAPE_ERROR = r"(?i)shape|size|dimension|differs"
SPARSE_ERROR = r"(?i)gather does not support (IndexedSlices|sparse)"

# TF's test name suffix -> (single value, axis)
SAME_SHAPE = {
    "Dense1D0Axis": ([1, 2, 3], 0),
    "Dense2D0Axis": ([[1, 2, 3]], 0),
    "Dense2D1Axis": ([[1, 2, 3]], 1),
    "Dense3D0Axis": ([[[1, 2], [1, 2]]], 0),
    "Dense3D1Axis": ([[[1, 2], [1, 2]]], 1),
    "Dense3D2Axis": ([[[1, 2], [1, 2]]], 2),
}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def strategy(request) -> ds.Strategy:
    return STRATEGIES[request.param]()


@pytest.fixture(scope="module")
def workers() -> dict[tuple[str, str], Any]:
    """Run the multi-worker checks once: ``{(check name, task type): value}``."""
    return run_worker_checks(SCRIPT)


def errors_on_workers(workers: dict[tuple[str, str], Any], name: str) -> dict[str, str]:
    values = {task: workers[(name, task)] for task in TASKS}
    for task, value in values.items():
        assert isinstance(value, dict) and "error" in value, f"{name} did not raise on the {task}: {value}"
    return {task: value["error"] for task, value in values.items()}


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def ones_fn(kind: str) -> Callable[[Any], torch.Tensor]:
    """TF's value_fn of the different-shape cases."""
    return {
        "axis0": lambda ctx: torch.ones(ctx.replica_id_in_sync_group + 1, 1, dtype=torch.int32),
        "axis1": lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1, dtype=torch.int32),
        "rank": lambda ctx: torch.ones(*range(1, ctx.replica_id_in_sync_group + 2)),
    }[kind]


def sparse_value() -> torch.Tensor:
    """TF's ``_make_indexed_slices(values=[[1., 2.]], indices=[2], dense_shape=[5, 2])``."""
    return torch.sparse_coo_tensor([[2]], [[1.0, 2.0]], (5, 2), check_invariants=True)


def num_local(strategy: ds.Strategy) -> int:
    """TF's ``_get_num_replicas_per_client``."""
    return len(strategy.experimental_local_results(strategy.run(lambda: 0)))


# --------------------------------------------------------------------------- gather


@pytest.mark.parametrize("case", list(SAME_SHAPE))
def test_gather_per_replica_same_shape(strategy, case):
    """TF: strategy_gather_test.py, GatherTest.testGatherPerReplica<case> (e.g. testGatherPerReplicaDense1D0Axis)."""
    single, axis = SAME_SHAPE[case]
    value_on_replica = torch.tensor(single)
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: value_on_replica.clone())
    expected = torch.cat([value_on_replica] * strategy.num_replicas_in_sync, dim=axis)
    assert torch.equal(strategy.gather(distributed_values, axis=axis), expected)


@pytest.mark.parametrize("case", list(SAME_SHAPE))
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_gather_per_replica_same_shape_multi_worker(workers, topology, case):
    """TF: strategy_gather_test.py, GatherTest.testGatherPerReplica<case> (multi_worker_mirrored 2x1 and 2x2)."""
    single, axis = SAME_SHAPE[case]
    expected = torch.cat([torch.tensor(single)] * TOPOLOGIES[topology], dim=axis).tolist()
    assert on_workers(workers, f"gather_{case}_{topology}") == {t: expected for t in TASKS}


@pytest.mark.parametrize(
    "kind, axis, tf_name", [("axis0", 0, "testGatherDiffShapeAtAxis0"), ("axis1", 1, "testGatherDiffShapeAtAxis1")]
)
def test_gather_diff_shape_at_axis(strategy, kind, axis, tf_name):
    """TF: strategy_gather_test.py, GatherTest.testGatherDiffShapeAtAxis0 / testGatherDiffShapeAtAxis1."""
    distributed_values = strategy.experimental_distribute_values_from_function(ones_fn(kind))
    total = sum(range(strategy.num_replicas_in_sync + 1))
    expected = torch.ones((total, 1) if axis == 0 else (1, total), dtype=torch.int32)
    assert torch.equal(strategy.gather(distributed_values, axis=axis), expected)


@pytest.mark.parametrize("kind, axis", [("axis0", 0), ("axis1", 1)])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_gather_diff_shape_at_axis_multi_worker(workers, topology, kind, axis):
    """TF: strategy_gather_test.py, GatherTest.testGatherDiffShapeAtAxis0 / testGatherDiffShapeAtAxis1 (multi-worker)."""
    total = sum(range(TOPOLOGIES[topology] + 1))
    expected = torch.ones((total, 1) if axis == 0 else (1, total), dtype=torch.int32).tolist()
    assert on_workers(workers, f"gather_diff_shape_{kind}_{topology}") == {t: expected for t in TASKS}


@pytest.mark.parametrize(
    "kind, tf_name", [("axis1", "testGatherRaiseDiffShapeAtNonAxis"), ("rank", "testGatherRaiseDifferentRank")]
)
def test_gather_raise_diff_shape(strategy, kind, tf_name):
    """TF: strategy_gather_test.py, GatherTest.testGatherRaiseDiffShapeAtNonAxis / testGatherRaiseDifferentRank."""
    if strategy.num_replicas_in_sync <= 1:
        pytest.skip("Test for more than 1 replica only (as TF).")
    distributed_values = strategy.experimental_distribute_values_from_function(ones_fn(kind))
    with pytest.raises((ValueError, RuntimeError), match=SHAPE_ERROR):
        strategy.gather(distributed_values, axis=0)


@pytest.mark.parametrize("kind", ["axis1", "rank"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_gather_raise_diff_shape_multi_worker(workers, topology, kind):
    """TF: strategy_gather_test.py, GatherTest.testGatherRaiseDiffShapeAtNonAxis / testGatherRaiseDifferentRank
    (multi-worker: every worker raises, none hangs)."""
    for error in errors_on_workers(workers, f"gather_raise_{kind}_{topology}").values():
        assert any(name in error for name in ("CollectiveError", "RuntimeError", "ValueError")), error
        assert re.search(SHAPE_ERROR, error), error


def test_gather_raise_sparse(strategy):
    """TF: strategy_gather_test.py, GatherTest.testGatherRaiseSparse."""
    with pytest.raises(NotImplementedError, match=SPARSE_ERROR):
        strategy.gather(sparse_value(), axis=0)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_gather_raise_sparse_multi_worker(workers, topology):
    """TF: strategy_gather_test.py, GatherTest.testGatherRaiseSparse (multi-worker)."""
    for error in errors_on_workers(workers, f"gather_raise_sparse_{topology}").values():
        assert error.startswith("NotImplementedError") and re.search(SPARSE_ERROR, error), error


# --------------------------------------------------------------------------- all_gather


def _all_gather(axis: int) -> Callable[[Any], Any]:
    return lambda value: ds.get_replica_context().all_gather(value, axis=axis)


@pytest.mark.parametrize("case", list(SAME_SHAPE))
def test_all_gather_per_replica_same_shape(strategy, case):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherPerReplica<case> (e.g. testAllGatherPerReplicaDense1D0Axis)."""
    single, axis = SAME_SHAPE[case]
    value_on_replica = torch.tensor(single)
    per_replica_value = strategy.experimental_distribute_values_from_function(lambda _: value_on_replica.clone())
    result = strategy.experimental_local_results(strategy.run(_all_gather(axis), args=(per_replica_value,)))
    expect = torch.cat([value_on_replica] * strategy.num_replicas_in_sync, dim=axis)
    assert plain(result) == [expect.tolist()] * num_local(strategy)


@pytest.mark.parametrize("case", list(SAME_SHAPE))
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_all_gather_per_replica_same_shape_multi_worker(workers, topology, case):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherPerReplica<case> (multi_worker_mirrored 2x1 and 2x2)."""
    single, axis = SAME_SHAPE[case]
    n = TOPOLOGIES[topology]
    expect = torch.cat([torch.tensor(single)] * n, dim=axis).tolist()
    assert on_workers(workers, f"all_gather_{case}_{topology}") == {t: [expect] * (n // 2) for t in TASKS}


@pytest.mark.parametrize(
    "kind, axis, tf_name",
    [("axis0", 0, "testAllGatherDiffShapeAtAxis0"), ("axis1", 1, "testAllGatherDiffShapeAtAxis1")],
)
def test_all_gather_diff_shape_at_axis(strategy, kind, axis, tf_name):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherDiffShapeAtAxis0 / testAllGatherDiffShapeAtAxis1."""
    per_replica_value = strategy.experimental_distribute_values_from_function(ones_fn(kind))
    total = sum(range(strategy.num_replicas_in_sync + 1))
    expect = torch.ones((total, 1) if axis == 0 else (1, total), dtype=torch.int32)
    result = strategy.experimental_local_results(strategy.run(_all_gather(axis), args=(per_replica_value,)))
    assert plain(result) == [expect.tolist()] * num_local(strategy)


@pytest.mark.parametrize("kind, axis", [("axis0", 0), ("axis1", 1)])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_all_gather_diff_shape_at_axis_multi_worker(workers, topology, kind, axis):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherDiffShapeAtAxis0 / ...AtAxis1 (multi-worker)."""
    n = TOPOLOGIES[topology]
    total = sum(range(n + 1))
    expect = torch.ones((total, 1) if axis == 0 else (1, total), dtype=torch.int32).tolist()
    assert on_workers(workers, f"all_gather_diff_shape_{kind}_{topology}") == {t: [expect] * (n // 2) for t in TASKS}


def test_all_gather_nest(strategy):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherNest."""
    axis = 1
    per_replica_value = strategy.experimental_distribute_values_from_function(ones_fn("axis1"))
    n = strategy.num_replicas_in_sync
    expect_1 = torch.ones(1, sum(range(n + 1)), dtype=torch.int32)
    value_2 = torch.tensor([[[1, 2], [1, 2]]])
    expect_2 = torch.cat([value_2] * n, dim=axis)

    def run(value):
        return ds.get_replica_context().all_gather([value, value_2.clone()], axis=axis)

    result = strategy.run(run, args=(per_replica_value,))
    assert plain(strategy.experimental_local_results(result[0])) == [expect_1.tolist()] * num_local(strategy)
    assert plain(strategy.experimental_local_results(result[1])) == [expect_2.tolist()] * num_local(strategy)


def test_all_gather_nest_1d_0_axis(strategy):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherNest1D0Axis."""
    single_value = torch.tensor([1, 2, 3])

    def run():
        return ds.get_replica_context().all_gather([single_value.clone(), single_value.clone()], axis=0)

    expect = torch.cat([single_value] * strategy.num_replicas_in_sync, dim=0)
    result = strategy.run(run)
    for gathered_result in result:
        assert plain(strategy.experimental_local_results(gathered_result)) == [expect.tolist()] * num_local(strategy)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_all_gather_nest_multi_worker(workers, topology):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherNest and testAllGatherNest1D0Axis (multi-worker)."""
    n = TOPOLOGIES[topology]
    expect_1 = torch.ones(1, sum(range(n + 1)), dtype=torch.int32).tolist()
    expect_2 = torch.cat([torch.tensor([[[1, 2], [1, 2]]])] * n, dim=1).tolist()
    nest = [[expect_1] * (n // 2), [expect_2] * (n // 2)]
    assert on_workers(workers, f"all_gather_nest_{topology}") == {t: nest for t in TASKS}
    expect = torch.cat([torch.tensor([1, 2, 3])] * n).tolist()
    assert on_workers(workers, f"all_gather_nest_1d_{topology}") == {t: [[expect] * (n // 2)] * 2 for t in TASKS}


@pytest.mark.parametrize(
    "kind, tf_name", [("axis1", "testAllGatherRaiseDiffShapeAtNonAxis"), ("rank", "testAllGatherRaiseDifferentRank")]
)
def test_all_gather_raise_diff_shape(strategy, kind, tf_name):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherRaiseDiffShapeAtNonAxis / testAllGatherRaiseDifferentRank."""
    if strategy.num_replicas_in_sync <= 1:
        pytest.skip("Test for more than 1 replica only (as TF).")
    per_replica_value = strategy.experimental_distribute_values_from_function(ones_fn(kind))
    with pytest.raises((ValueError, RuntimeError), match=SHAPE_ERROR):
        strategy.run(_all_gather(0), args=(per_replica_value,))


@pytest.mark.parametrize("kind", ["axis1", "rank"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_all_gather_raise_diff_shape_multi_worker(workers, topology, kind):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherRaiseDiffShapeAtNonAxis / testAllGatherRaiseDifferentRank
    (multi-worker: every worker raises, none hangs)."""
    for error in errors_on_workers(workers, f"all_gather_raise_{kind}_{topology}").values():
        assert re.search(SHAPE_ERROR, error), error


def test_all_gather_raise_sparse(strategy):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherRaiseSparse."""
    with pytest.raises(NotImplementedError, match=r"(?i)all_gather does not support (IndexedSlices|sparse)"):
        strategy.run(_all_gather(0), args=(sparse_value(),))


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_all_gather_raise_sparse_multi_worker(workers, topology):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherRaiseSparse (multi-worker)."""
    for error in errors_on_workers(workers, f"all_gather_raise_sparse_{topology}").values():
        assert error.startswith("NotImplementedError") and re.search(SPARSE_ERROR, error), error


def _gradient_step(c: torch.Tensor, nest: bool) -> torch.Tensor:
    """TF's ``step``: ``y = all_gather(x, axis=1) * c``; the gradient of ``y`` with respect to ``x``."""
    x = torch.tensor([[3.0], [5.0]], requires_grad=True)
    y = torch.tensor([[2.0], [4.0]])
    mid = ds.get_replica_context().all_gather([x, y] if nest else x, 1)
    out = (mid[0] if nest else mid) * c
    (grad,) = torch.autograd.grad(out.sum(), [x])
    return grad


@pytest.mark.parametrize("nest, tf_name", [(False, "testAllGatherGradient"), (True, "testAllGatherGradientNest")])
def test_all_gather_gradient(strategy, nest, tf_name):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherGradient / testAllGatherGradientNest.

    Every replica's output depends on every replica's ``x``: the gradient of replica k's ``x`` is the sum over
    replicas of their ``c`` (TF: ``gradient_comp = sum(range(1, num_replicas_in_sync + 1))``).
    """
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][ctx.replica_id_in_sync_group]])
    )
    gradient_comp = float(sum(range(1, strategy.num_replicas_in_sync + 1)))
    result = strategy.experimental_local_results(
        strategy.run(lambda c: _gradient_step(c, nest), args=(per_replica_value,))
    )
    assert plain(result) == [[[gradient_comp], [gradient_comp]]] * num_local(strategy)


@pytest.mark.parametrize("nest", [False, True])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_all_gather_gradient_multi_worker(workers, topology, nest):
    """TF: strategy_gather_test.py, GatherTest.testAllGatherGradient / testAllGatherGradientNest (multi-worker)."""
    n = TOPOLOGIES[topology]
    gradient_comp = float(sum(range(1, n + 1)))
    name = f"all_gather_gradient{'_nest' if nest else ''}_{topology}"
    assert on_workers(workers, name) == {t: [[[gradient_comp], [gradient_comp]]] * (n // 2) for t in TASKS}
