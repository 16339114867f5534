"""Conformance: TF's ``tensorflow/python/distribute/strategy_common_test.py``, ported to distrib.

Strategies: TF's ``all_strategies`` / ``strategies_minus_tpu`` are the default strategy (``ds.get_strategy()``),
``ds.OneDeviceStrategy("cpu")``, ``ds.MirroredStrategy(["cpu:0", "cpu:1"])`` (TF's
``mirrored_strategy_with_cpu_1_and_2``; its GPU variants need no other code path) and
``ds.CentralStorageStrategy(["cpu:0", "cpu:1"])`` (TF's ``central_storage_strategy_with_gpu_and_cpu``). TF's
``multi_worker_mirrored_2x1_cpu`` is a chief and a worker process started by ``distrib launch --chief --workers 1``
running ``scripts/strategy_common_workers.py`` (once for the whole module); ``multi_worker_mirrored_2x2_gpu`` is
the same two processes with ``MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])``. ``tf.function`` and
graph variants collapse into eager PyTorch. TF's ``IndexedSlices`` are torch sparse COO tensors.

Not ported, and why:
- ``ReplicaCtxUpdateTest.testDenseUpdate``: ``ReplicaContext._update`` of a distributed variable (private, and
  PyTorch has no distributed variables; ``optimizer.step()`` is distrib's update).
- ``ReplicaCtxAllReduceTest.testDense`` / ``testSparse`` / ``testNestedInput``: TF's private
  ``extended._replica_ctx_all_reduce``; the public ``ReplicaContext.all_reduce`` is ported from ``AllReduceTest``.
- ``ReplicaCtxAllReduceTest.testSyncOnReadVariableInput``: sync-on-read variables do not exist in PyTorch.
- The ``*_no_merge_call`` and ``*_gpu`` combinations: TF-internal code paths (no merge call, NCCL) with no
  distinct distrib code path on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance.workers import on_workers, run_worker_checks

import distrib as ds

SCRIPT = Path(__file__).parent / "scripts" / "strategy_common_workers.py"
DEFAULT_STRATEGY = ds.get_strategy()
STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": lambda: DEFAULT_STRATEGY,
    "one_device_cpu": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_cpu_1_and_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_cpu_1_and_2": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
TASKS = ("chief", "worker")


@pytest.fixture(scope="module", params=list(STRATEGIES))
def strategy(request) -> ds.Strategy:
    return STRATEGIES[request.param]()


@pytest.fixture(scope="module")
def mirrored() -> ds.Strategy:
    return ds.MirroredStrategy(["cpu:0", "cpu:1"])


@pytest.fixture(scope="module")
def workers() -> dict[tuple[str, str], Any]:
    """Run the multi-worker checks once: ``{(check name, task type): value}``."""
    return run_worker_checks(SCRIPT)


def plain(value: Any) -> Any:
    """The same JSON-like form as the worker script's (tensors as lists, sparse tensors marked)."""
    if isinstance(value, ds.PerReplica):
        return {"PerReplica": [plain(v) for v in value.values]}
    if isinstance(value, torch.Tensor):
        return {"sparse": value.to_dense().tolist()} if value.is_sparse else value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def sparse(value: float, index: int) -> torch.Tensor:
    """TF's ``IndexedSlices(values=[[value]], indices=[index], dense_shape=[5, 1])``."""
    return torch.sparse_coo_tensor([[index]], [[value]], (5, 1), check_invariants=True)


def sparse_dense(value: float, index: int) -> dict[str, list[list[float]]]:
    rows = [[0.0] for _ in range(5)]
    rows[index] = [value]
    return {"sparse": rows}


def rid() -> int:
    return ds.get_replica_context().replica_id_in_sync_group


# --------------------------------------------------------------------------- StrategyTest


def test_capture_replica_id(strategy):
    """TF: strategy_common_test.py, StrategyTest.testCaptureReplicaId (single process)."""
    got = strategy.experimental_local_results(strategy.run(rid))
    assert got == tuple(range(strategy.num_replicas_in_sync))


def test_capture_replica_id_multi_worker(workers):
    """TF: strategy_common_test.py, StrategyTest.testCaptureReplicaId (multi_worker_mirrored_2x1_cpu)."""
    assert on_workers(workers, "capture_replica_id") == {"chief": [0], "worker": [1]}


def test_merge_call_init_scope(strategy):
    """TF: strategy_common_test.py, StrategyTest.testMergeCallInitScope (single process)."""
    with strategy.scope():

        def replica_fn():
            y = ds.get_replica_context().merge_call(lambda _: torch.tensor(11))
            return y + 1

        result = strategy.experimental_local_results(strategy.run(replica_fn))
        assert [int(r) for r in result] == [12] * strategy.num_replicas_in_sync


def test_merge_call_init_scope_multi_worker(workers):
    """TF: strategy_common_test.py, StrategyTest.testMergeCallInitScope (multi_worker_mirrored_2x1_cpu)."""
    assert on_workers(workers, "merge_call_init_scope") == {"chief": [12], "worker": [12]}


# --------------------------------------------------------------------------- StrategyLocalResultTest


def _local_id() -> int:
    """TF's ``extended._get_local_replica_id(replica_id_in_sync_group)``."""
    s = ds.get_strategy()
    return rid() - s.worker_index * s.num_local_replicas


LOCAL_RESULT_CASES: dict[str, tuple[Callable[[], Any], Any]] = {
    "testLocalResultForDictionary": (
        lambda: {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
        [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}],
    ),
    "testLocalResultForList": (lambda: [torch.tensor(1.0), torch.tensor(2.0)], [[1.0, 2.0], [1.0, 2.0]]),
    "testLocalResultForTuple": (
        lambda: (torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)),
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]],
    ),
    "testLocalResultForNestedStruct": (
        lambda: ({"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, {"a": torch.tensor(4.0), "b": torch.tensor(6.0)}),
        [[{"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 6.0}], [{"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 6.0}]],
    ),
    "testLocalResultForNestedStructWithoutTensor": (
        lambda: {"a": 1.0, "b": 2.0},
        [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}],
    ),
    "testLocalResultForScalarValue": (_local_id, [0, 1]),
    "testLocalResultForDictionaryDifferentReplicas": (
        lambda: {"a": float(_local_id() + 1), "b": float(_local_id() + 2)},
        [{"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 3.0}],
    ),
    "testLocalResultForTensor": (lambda: torch.tensor([2.0, 3.0]), [[2.0, 3.0], [2.0, 3.0]]),
}
# the worker script's check names
LOCAL_RESULT_CHECKS = {
    "testLocalResultForDictionary": "dictionary",
    "testLocalResultForList": "list",
    "testLocalResultForTuple": "tuple",
    "testLocalResultForNestedStruct": "nested_struct",
    "testLocalResultForNestedStructWithoutTensor": "nested_struct_without_tensor",
    "testLocalResultForScalarValue": "scalar_value",
    "testLocalResultForDictionaryDifferentReplicas": "dictionary_different_replicas",
    "testLocalResultForTensor": "tensor",
}


@pytest.mark.parametrize("tf_name", list(LOCAL_RESULT_CASES))
def test_local_result(tf_name, mirrored):
    """TF: strategy_common_test.py, StrategyLocalResultTest.<tf_name> (mirrored_strategy_with_cpu_1_and_2).

    ``experimental_local_results`` of ``run``'s structure is a tuple of one structure per replica.
    """
    model_fn, expected = LOCAL_RESULT_CASES[tf_name]
    with mirrored.scope():
        got = mirrored.experimental_local_results(mirrored.run(model_fn))
    assert isinstance(got, tuple)
    assert plain(got) == expected


@pytest.mark.parametrize("tf_name", list(LOCAL_RESULT_CASES))
def test_local_result_multi_worker(tf_name, workers):
    """TF: strategy_common_test.py, StrategyLocalResultTest.<tf_name> (multi_worker_mirrored_2x2 on CPU)."""
    expected = {"is_tuple": True, "got": LOCAL_RESULT_CASES[tf_name][1]}
    assert on_workers(workers, f"local_result_{LOCAL_RESULT_CHECKS[tf_name]}") == {t: expected for t in TASKS}


# --------------------------------------------------------------------------- ReduceTest


def test_reduce_basic(strategy):
    """TF: strategy_common_test.py, ReduceTest.testBasic (single process)."""
    per_replica_value = strategy.experimental_distribute_values_from_function(lambda _: torch.ones(()))

    def fn_eager():
        return strategy.reduce(ds.ReduceOp.SUM, value=per_replica_value, axis=None)

    with strategy.scope():
        assert float(fn_eager()) == 1.0 * strategy.num_replicas_in_sync
    assert float(fn_eager()) == 1.0 * strategy.num_replicas_in_sync


def test_reduce_basic_multi_worker(workers):
    """TF: strategy_common_test.py, ReduceTest.testBasic (multi_worker_mirrored_2x1_cpu)."""
    assert on_workers(workers, "reduce_basic") == {t: [2.0, 2.0] for t in TASKS}


def test_reduce_axis(strategy):
    """TF: strategy_common_test.py, ReduceTest.testAxis (single process)."""
    x = strategy.run(lambda: torch.tensor([1.0, 2.0]))
    assert float(strategy.reduce(ds.ReduceOp.MEAN, x, axis=0)) == 1.5
    assert float(strategy.reduce(ds.ReduceOp.SUM, x, axis=0)) == 3 * strategy.num_replicas_in_sync


def test_reduce_axis_multi_worker(workers):
    """TF: strategy_common_test.py, ReduceTest.testAxis (multi_worker_mirrored_2x1_cpu)."""
    assert on_workers(workers, "reduce_axis") == {t: [1.5, 6.0] for t in TASKS}


# --------------------------------------------------------------------------- AllReduceTest


def _all_reduce(strategy: ds.Strategy, value_fn: Callable[[], Any], op: ds.ReduceOp) -> tuple[Any, ...]:
    return strategy.experimental_local_results(
        strategy.run(lambda: ds.get_replica_context().all_reduce(op, value_fn()))
    )


def test_all_reduce_dense(strategy):
    """TF: strategy_common_test.py, AllReduceTest.testDense (single process)."""
    got = _all_reduce(strategy, lambda: torch.tensor(1.0), ds.ReduceOp.SUM)[0]
    assert float(got) == 1.0 * strategy.num_replicas_in_sync


def test_all_reduce_sparse(strategy):
    """TF: strategy_common_test.py, AllReduceTest.testSparse (single process): MEAN keeps the value, stays sparse."""
    got = _all_reduce(strategy, lambda: sparse(1.0, 0), ds.ReduceOp.MEAN)[0]
    assert got.is_sparse
    assert plain(got) == sparse_dense(1.0, 0)


def test_all_reduce_sparse_tuple(strategy):
    """TF: strategy_common_test.py, AllReduceTest.testSparseTuple (single process)."""
    n = strategy.num_replicas_in_sync
    got = _all_reduce(strategy, lambda: [sparse(1.0, 0), sparse(2.0, 0)], ds.ReduceOp.SUM)[0]
    assert all(g.is_sparse for g in got)
    assert plain(got) == [sparse_dense(1.0 * n, 0), sparse_dense(2.0 * n, 0)]


def test_all_reduce_nested_input(strategy):
    """TF: strategy_common_test.py, AllReduceTest.testNestedInput (single process)."""
    n = strategy.num_replicas_in_sync
    got = _all_reduce(
        strategy, lambda: (torch.tensor(1.0), sparse(1.0, 0), torch.tensor(2.0), sparse(2.0, 1)), ds.ReduceOp.SUM
    )[0]
    assert plain(got) == [1.0 * n, sparse_dense(1.0 * n, 0), 2.0 * n, sparse_dense(2.0 * n, 1)]


@pytest.mark.parametrize("topology, n", [("2x1", 2), ("2x2", 4)])
def test_all_reduce_multi_worker(workers, topology, n):
    """TF: strategy_common_test.py, AllReduceTest.testDense, testSparse, testSparseTuple, testNestedInput
    (multi_worker_mirrored_2x1_cpu, multi_worker_mirrored_2x2 on CPU)."""
    local = n // 2
    expected = {
        "dense": [1.0 * n] * local,
        "sparse": [sparse_dense(1.0, 0)] * local,
        "sparse_tuple": [[sparse_dense(1.0 * n, 0), sparse_dense(2.0 * n, 0)]] * local,
        "nested_input": [[1.0 * n, sparse_dense(1.0 * n, 0), 2.0 * n, sparse_dense(2.0 * n, 1)]] * local,
    }
    for case, value in expected.items():
        assert on_workers(workers, f"all_reduce_{case}_{topology}") == {t: value for t in TASKS}, case


# --------------------------------------------------------------------------- DistributedCollectiveAllReduceStrategyTest


def test_dataset_from_function(workers):
    """TF: strategy_common_test.py, DistributedCollectiveAllReduceStrategyTest.testDatasetFromFunction."""
    assert on_workers(workers, "dataset_from_function") == {"chief": 10, "worker": 35}


def test_simple_input_from_dataset_last_partial_batch(workers):
    """TF: strategy_common_test.py, DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromDatasetLastPartialBatch."""
    assert on_workers(workers, "input_from_dataset_last_partial_batch") == {"chief": [8, 9, 10], "worker": [11, 12, 13]}


def test_simple_input_from_fn_last_partial_batch(workers):
    """TF: strategy_common_test.py, DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromFnLastPartialBatch."""
    assert on_workers(workers, "input_from_fn_last_partial_batch") == {"chief": [8, 9, 10, 11], "worker": [12, 13]}


@pytest.mark.parametrize(
    "tf_name, check, expected",
    [
        ("testReduceHostTensor", "reduce_host_tensor", 2.0),
        ("testReduceToHostTensor", "reduce_to_host_tensor", 2.0),
        ("testBatchReduceToHostTensor", "batch_reduce_to_host_tensor", [2.0, 2.0]),
        ("testReduceDeviceTensors", "reduce_device_tensors", 2.0),
        ("testReduceToDeviceTensors", "reduce_to_device_tensors", 2.0),
        ("testBatchReduceToDeviceTensors", "batch_reduce_to_device_tensors", [2.0, 2.0]),
    ],
)
def test_reduce_host_and_device_tensors(workers, tf_name, check, expected):
    """TF: strategy_common_test.py, DistributedCollectiveAllReduceStrategyTest.<tf_name>.

    A plain tensor given to ``reduce`` / ``reduce_to`` / ``batch_reduce_to`` counts once per worker.
    """
    assert on_workers(workers, check) == {t: expected for t in TASKS}


# --------------------------------------------------------------------------- StrategyClusterResolverTest


def test_cluster_resolver_property(strategy):
    """TF: strategy_common_test.py, StrategyClusterResolverTest.testClusterResolverProperty (single process: None)."""
    assert strategy.cluster_resolver is None


def test_cluster_resolver_property_multi_worker(workers):
    """TF: strategy_common_test.py, StrategyClusterResolverTest.testClusterResolverProperty (multi_worker_mirrored_2x1_cpu)."""
    values = on_workers(workers, "cluster_resolver_property")
    for task, value in values.items():
        assert value["same_in_scope"]
        assert all(value["attributes"].values()), value["attributes"]
        assert value["task_id"] == 0
        assert value["task_type"] == task and task in ("chief", "worker")
