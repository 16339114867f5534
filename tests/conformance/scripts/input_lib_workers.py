"""The multi-worker half of TF's input_lib_test.py (DistributedIteratorMultiWorkerTest), on a chief and a worker.

    distrib launch --chief --workers 1 tests/conformance/scripts/input_lib_workers.py

TF's in-graph two-worker strategies become ``MultiWorkerMirroredStrategy()`` (one CPU replica per worker, TF's
``_cpu_devices``) and ``MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])`` (two per worker, TF's
``_cpu_and_one_gpu_devices``), made in the same processes. For each case this worker iterates the distributed
dataset three times (``get_next`` until ``OutOfRangeError``, again after re-creating the iterator, and a ``for``
loop) and prints ``RESULT {"name": ..., "task": ..., "value": {...}}`` with its local replicas' values per step;
tests/conformance/test_input_lib.py puts the workers' values side by side and asserts on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

import distrib as ds


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def iterate(s: ds.Strategy, dist: Any) -> dict[str, Any]:
    def steps_get_next() -> tuple[list[Any], str]:
        iterator = iter(dist)
        steps = []
        while True:
            try:
                element = iterator.get_next()
            except ds.input.OutOfRangeError as e:
                return steps, type(e).__name__
            steps.append(plain(s.experimental_local_results(element)))

    first, end = steps_get_next()
    again, _ = steps_get_next()  # TF re-initializes the iterator and iterates again
    for_loop = [plain(s.experimental_local_results(x)) for x in dist]
    return {"get_next": first, "end": end, "get_next_again": again, "for_loop": for_loop}


def reporter(task: str) -> Callable[[str, ds.Strategy, Callable[[], Any]], None]:
    def report(name: str, s: ds.Strategy, make: Callable[[], Any]) -> None:
        try:
            value = iterate(s, make())
        except Exception as e:  # noqa: BLE001 - reported to the test
            value = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps({"name": name, "task": task, "value": value}), flush=True)

    return report


def scalars(n: int) -> list[torch.Tensor]:
    """``Dataset.range(n)``: one int64 scalar per element."""
    return [torch.tensor(i) for i in range(n)]


def range_batch(n: int, batch: int) -> list[torch.Tensor]:
    """``Dataset.range(n).batch(batch)``."""
    return [torch.arange(i, min(i + batch, n)) for i in range(0, n, batch)]


def main() -> None:
    options = ds.CommunicationOptions(timeout_seconds=20)
    s21 = ds.MultiWorkerMirroredStrategy(communication_options=options)
    s22 = ds.MultiWorkerMirroredStrategy(communication_options=options, devices=["cpu:0", "cpu:1"])
    report = reporter(s21.cluster_resolver.task_type)

    # testOneDevicePerWorker (and testAutoshardingOption): one replica per worker
    report("one_device_per_worker_input_fn", s21, lambda: s21.distribute_datasets_from_function(lambda _: scalars(4)))
    report("one_device_per_worker_dataset", s21, lambda: s21.experimental_distribute_dataset(range_batch(4, 2)))

    # testTwoDevicesPerWorker: two replicas per worker
    report("two_devices_per_worker_input_fn", s22, lambda: s22.distribute_datasets_from_function(lambda _: scalars(4)))
    report("two_devices_per_worker_dataset", s22, lambda: s22.experimental_distribute_dataset(range_batch(4, 4)))

    # testTupleDataset: one replica per worker
    report(
        "tuple_dataset_input_fn",
        s21,
        lambda: s21.distribute_datasets_from_function(
            lambda _: [(torch.tensor(i), torch.tensor(i**2)) for i in range(4)]
        ),
    )
    report(
        "tuple_dataset_dataset",
        s21,
        lambda: s21.experimental_distribute_dataset([(b, b**2) for b in range_batch(4, 2)]),
    )

    # testUnevenDatasetBatches: two replicas per worker
    report(
        "uneven_dataset_batches_input_fn",
        s22,
        lambda: s22.distribute_datasets_from_function(lambda _: range_batch(9, 2)),
    )
    report("uneven_dataset_batches_dataset", s22, lambda: s22.experimental_distribute_dataset(range_batch(9, 8)))

    # testDifferentDatasets: two replicas per worker, worker 1 has one more example
    report(
        "different_datasets_input_fn",
        s22,
        lambda: s22.distribute_datasets_from_function(
            lambda ctx: range_batch(8, 2) if ctx.input_pipeline_id == 0 else range_batch(9, 2)
        ),
    )
    print("DONE", flush=True)


if __name__ == "__main__":  # a script for `distrib launch`; importing it (pytest's doctest collection) runs nothing
    main()
