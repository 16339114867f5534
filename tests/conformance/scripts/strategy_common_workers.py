"""The multi-worker half of TF's strategy_common_test.py, run on a chief and one worker.

    distrib launch --chief --workers 1 tests/conformance/scripts/strategy_common_workers.py

TF's ``multi_worker_mirrored_2x1_cpu`` is ``MultiWorkerMirroredStrategy()`` here (one replica per process);
its ``multi_worker_mirrored_2x2_gpu`` is ``MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])`` (two
logical CPU replicas per process), made in the same processes. Every check runs on both tasks in the same
order and prints one line ``RESULT {"name": ..., "task": "chief" | "worker", "value": ...}`` (an error becomes
``{"error": "Type: message"}``); tests/conformance/test_strategy_common.py asserts on them.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import torch

import distrib as ds


def plain(value: Any) -> Any:
    """A JSON-able copy of ``value`` (tensors as lists, sparse tensors marked)."""
    if isinstance(value, ds.PerReplica):
        return {"PerReplica": [plain(v) for v in value.values]}
    if isinstance(value, torch.Tensor):
        if value.is_sparse:
            return {"sparse": value.to_dense().tolist()}
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def reporter(task: str) -> Callable[[str, Callable[[], Any]], None]:
    def report(name: str, fn: Callable[[], Any]) -> None:
        try:
            value = plain(fn())
        except Exception as e:  # noqa: BLE001 - reported to the test
            value = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps({"name": name, "task": task, "value": value}), flush=True)

    return report


def rid() -> int:
    return ds.get_replica_context().replica_id_in_sync_group


def local_id() -> int:
    """TF's ``extended._get_local_replica_id(replica_id_in_sync_group)``."""
    s = ds.get_strategy()
    return rid() - s.worker_index * s.num_local_replicas


def sparse(value: float, index: int) -> torch.Tensor:
    """TF's ``IndexedSlices(values=[[value]], indices=[index], dense_shape=[5, 1])``."""
    return torch.sparse_coo_tensor([[index]], [[value]], (5, 1), check_invariants=True)


LOCAL_RESULT_FNS: dict[str, Callable[[], Any]] = {
    "dictionary": lambda: {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
    "list": lambda: [torch.tensor(1.0), torch.tensor(2.0)],
    "tuple": lambda: (torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)),
    "nested_struct": lambda: (
        {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
        {"a": torch.tensor(4.0), "b": torch.tensor(6.0)},
    ),
    "nested_struct_without_tensor": lambda: {"a": 1.0, "b": 2.0},
    "scalar_value": local_id,
    "dictionary_different_replicas": lambda: {"a": float(local_id() + 1), "b": float(local_id() + 2)},
    "tensor": lambda: torch.tensor([2.0, 3.0]),
}


def main() -> None:
    options = ds.CommunicationOptions(timeout_seconds=20)
    s21 = ds.MultiWorkerMirroredStrategy(communication_options=options)
    s22 = ds.MultiWorkerMirroredStrategy(communication_options=options, devices=["cpu:0", "cpu:1"])
    report = reporter(s21.cluster_resolver.task_type)

    # ------------------------------------------------------------- StrategyTest (2x1)
    report("capture_replica_id", lambda: s21.experimental_local_results(s21.run(rid)))

    def merge_call_init_scope() -> Any:
        with s21.scope():

            def replica_fn() -> torch.Tensor:
                y = ds.get_replica_context().merge_call(lambda _: torch.tensor(11))
                return y + 1

            return s21.experimental_local_results(s21.run(replica_fn))

    report("merge_call_init_scope", merge_call_init_scope)

    # ------------------------------------------------------------- StrategyLocalResultTest (2x2)
    for key, model_fn in LOCAL_RESULT_FNS.items():

        def local_result(model_fn: Callable[[], Any] = model_fn) -> Any:
            with s22.scope():
                got = s22.experimental_local_results(s22.run(model_fn))
                return {"is_tuple": isinstance(got, tuple), "got": got}

        report(f"local_result_{key}", local_result)

    # ------------------------------------------------------------- ReduceTest (2x1)
    def reduce_basic() -> Any:
        per_replica_value = s21.experimental_distribute_values_from_function(lambda _: torch.ones(()))
        with s21.scope():
            in_scope = s21.reduce(ds.ReduceOp.SUM, value=per_replica_value, axis=None)
        out_of_scope = s21.reduce(ds.ReduceOp.SUM, value=per_replica_value, axis=None)
        return [in_scope, out_of_scope]

    report("reduce_basic", reduce_basic)

    def reduce_axis() -> Any:
        x = s21.run(lambda: torch.tensor([1.0, 2.0]))
        return [s21.reduce(ds.ReduceOp.MEAN, x, axis=0), s21.reduce(ds.ReduceOp.SUM, x, axis=0)]

    report("reduce_axis", reduce_axis)

    # ------------------------------------------------------------- AllReduceTest (2x1 and 2x2)
    for topology, s in (("2x1", s21), ("2x2", s22)):

        def all_reduce(value_fn: Callable[[], Any], op: str, s: ds.Strategy = s) -> Any:
            return s.experimental_local_results(s.run(lambda: ds.get_replica_context().all_reduce(op, value_fn())))

        report(f"all_reduce_dense_{topology}", lambda: all_reduce(lambda: torch.tensor(1.0), "SUM"))
        report(f"all_reduce_sparse_{topology}", lambda: all_reduce(lambda: sparse(1.0, 0), "MEAN"))
        report(
            f"all_reduce_sparse_tuple_{topology}", lambda: all_reduce(lambda: [sparse(1.0, 0), sparse(2.0, 0)], "SUM")
        )
        report(
            f"all_reduce_nested_input_{topology}",
            lambda: all_reduce(lambda: (torch.tensor(1.0), sparse(1.0, 0), torch.tensor(2.0), sparse(2.0, 1)), "SUM"),
        )

    # ------------------------------------------------------------- DistributedCollectiveAllReduceStrategyTest (2x1)
    def dataset_from_function() -> Any:
        def dataset_fn(input_context: ds.InputContext) -> Any:
            batch_size = input_context.get_per_replica_batch_size(10)
            numbers = itertools.cycle(range(100))  # range(100).repeat()
            batches = (torch.tensor(list(itertools.islice(numbers, batch_size))) for _ in itertools.count())
            return itertools.islice(batches, input_context.input_pipeline_id, None, input_context.num_input_pipelines)

        input_iterator = iter(s21.distribute_datasets_from_function(dataset_fn))
        result = s21.experimental_local_results(input_iterator.get_next())
        return torch.stack(list(result)).sum()

    report("dataset_from_function", dataset_from_function)

    def input_from_dataset_last_partial_batch() -> Any:
        dataset = [torch.arange(0, 8), torch.arange(8, 14)]  # range(14).batch(8, drop_remainder=False)
        input_iterator = iter(s21.experimental_distribute_dataset(dataset))
        s21.run(lambda x: x, args=(next(input_iterator),))  # let the complete batch go
        return s21.run(lambda x: x, args=(next(input_iterator),))

    report("input_from_dataset_last_partial_batch", input_from_dataset_last_partial_batch)

    def input_from_fn_last_partial_batch() -> Any:
        def dataset_fn(input_context: ds.InputContext) -> Any:
            batch_size = input_context.get_per_replica_batch_size(8)
            dataset = [torch.arange(i, min(i + batch_size, 14)) for i in range(0, 14, batch_size)]
            return dataset[input_context.input_pipeline_id :: input_context.num_input_pipelines]

        input_iterator = iter(s21.distribute_datasets_from_function(dataset_fn))
        s21.run(lambda x: x, args=(next(input_iterator),))  # let the complete batch go
        return s21.run(lambda x: x, args=(next(input_iterator),))

    report("input_from_fn_last_partial_batch", input_from_fn_last_partial_batch)

    def host() -> torch.Tensor:
        return torch.tensor(1.0)

    def device() -> Any:
        return s21.run(lambda: torch.tensor(1.0))

    report("reduce_host_tensor", lambda: s21.reduce(ds.ReduceOp.SUM, host(), axis=None))
    report("reduce_to_host_tensor", lambda: s21.extended.reduce_to(ds.ReduceOp.SUM, host(), host()))
    report(
        "batch_reduce_to_host_tensor",
        lambda: s21.extended.batch_reduce_to(ds.ReduceOp.SUM, [(host(), host()), (host(), host())]),
    )
    report("reduce_device_tensors", lambda: s21.reduce(ds.ReduceOp.SUM, device(), axis=None))
    report("reduce_to_device_tensors", lambda: (lambda v: s21.extended.reduce_to(ds.ReduceOp.SUM, v, v))(device()))
    report(
        "batch_reduce_to_device_tensors",
        lambda: (lambda v: s21.extended.batch_reduce_to(ds.ReduceOp.SUM, [(v, v), (v, v)]))(device()),
    )

    # ------------------------------------------------------------- StrategyClusterResolverTest (2x1)
    def cluster_resolver_property() -> Any:
        resolver = s21.cluster_resolver
        with s21.scope():
            same = s21.cluster_resolver is resolver
        attributes = {
            a: hasattr(resolver, a) for a in ("cluster_spec", "master", "num_accelerators", "task_id", "task_type")
        }
        return {
            "same_in_scope": same,
            "attributes": attributes,
            "task_id": resolver.task_id,
            "task_type": resolver.task_type,
        }

    report("cluster_resolver_property", cluster_resolver_property)
    print("DONE", flush=True)


if __name__ == "__main__":  # a script for `distrib launch`; importing it (pytest's doctest collection) runs nothing
    main()
