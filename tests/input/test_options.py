"""``ds.InputOptions`` and ``ds.AutoShardPolicy`` (TF's names and defaults), the device fetch and its prefetch on the
CPU (where there is nothing to overlap, so nothing is read ahead), and ``distribute_datasets_from_function``'s
``PER_REPLICA`` mode. The GPU side of the fetch and the prefetch is in tests/cuda/test_cuda_input.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import distrib as ds
from distrib.input.iterators import DevicePrefetcher, prefetching


def test_tf_s_names_values_and_defaults():
    assert {p.name: p.value for p in ds.AutoShardPolicy} == {"OFF": -1, "AUTO": 0, "FILE": 1, "DATA": 2, "HINT": 3}
    options = ds.InputOptions()
    assert options.experimental_fetch_to_device is True  # TF: None means True
    assert options.experimental_replication_mode is ds.InputReplicationMode.PER_WORKER
    assert options.experimental_place_dataset_on_device is False
    assert options.experimental_per_replica_buffer_size == 1
    assert options.experimental_auto_shard_policy is ds.AutoShardPolicy.AUTO
    assert ds.InputOptions(experimental_auto_shard_policy=2).experimental_auto_shard_policy is ds.AutoShardPolicy.DATA


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"experimental_place_dataset_on_device": True, "experimental_fetch_to_device": True}, "cannot both be set"),
        ({"experimental_place_dataset_on_device": True}, "needs experimental_replication_mode"),
        ({"experimental_per_replica_buffer_size": -1}, "use 0"),
    ],
)
def test_contradictory_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ds.InputOptions(**kwargs)


def test_options_of_another_type_and_policies_without_a_dataloader_meaning_are_refused():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(TypeError, match="takes a ds.InputOptions"):
        strategy.experimental_distribute_dataset([torch.ones(2)], {"experimental_fetch_to_device": False})
    for policy in (ds.AutoShardPolicy.FILE, ds.AutoShardPolicy.HINT):
        with pytest.raises(ValueError, match="no DataLoader counterpart"):
            strategy.experimental_distribute_dataset(
                [torch.ones(2)], ds.InputOptions(experimental_auto_shard_policy=policy)
            )
    with pytest.raises(ValueError, match="for distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset(
            [torch.ones(2)], ds.InputOptions(experimental_replication_mode=ds.InputReplicationMode.PER_REPLICA)
        )


def test_one_worker_never_shards_and_never_warns(recwarn):
    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.arange(4.0).split(2))

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    dist = strategy.experimental_distribute_dataset(DataLoader(Stream(), batch_size=None))
    assert not dist.auto_sharded and not recwarn.list
    assert [strategy.experimental_local_results(x)[1].tolist() for x in dist] == [[1.0], [3.0]]


class Counting:
    """Two-example global batches; counts how many were read."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.n):
            self.read += 1
            yield torch.tensor([2.0 * i, 2.0 * i + 1])


@pytest.mark.parametrize("fetch", [True, False])
def test_on_the_cpu_nothing_is_read_ahead_whatever_the_buffer(fetch):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    data = Counting(3)
    it = iter(
        strategy.experimental_distribute_dataset(
            data, ds.InputOptions(experimental_fetch_to_device=fetch, experimental_per_replica_buffer_size=4)
        )
    )
    first = next(it)
    assert data.read == 1  # no prefetch: no copy to overlap on the CPU
    assert [v.tolist() for v in first.values] == [[0.0], [1.0]]
    assert [strategy.experimental_local_results(x)[1].tolist() for x in it] == [[3.0], [5.0]]


def test_the_prefetcher_keeps_order_reads_depth_ahead_and_ends_cleanly():
    """The prefetcher's buffering, driven with CPU devices (its CUDA streams are exercised on a GPU)."""
    reads: list[int] = []

    def parts() -> Iterator[list[torch.Tensor]]:
        for i in range(5):
            reads.append(i)
            yield [torch.tensor([float(i)]), torch.tensor([float(-i)])]

    cpu = torch.device("cpu")
    prefetcher = DevicePrefetcher(parts(), [cpu, cpu], depth=2)
    first = next(prefetcher)
    assert reads == [0, 1, 2]  # the element handed out, and 2 more in flight
    assert [v.tolist() for v in first.values] == [[0.0], [-0.0]]
    rest = [element.values[0].item() for element in prefetcher]
    assert rest == [1.0, 2.0, 3.0, 4.0] and reads == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(prefetcher)
    # without a GPU, prefetching() does not buffer at all
    assert not isinstance(prefetching(iter([]), [cpu], True, 3), DevicePrefetcher)


def test_per_replica_pipelines_one_per_replica_with_replica_contexts():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    contexts: list[ds.InputContext] = []

    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        contexts.append(ctx)
        return [torch.full((2,), float(ctx.input_pipeline_id))] * (ctx.input_pipeline_id + 2)

    dist = strategy.distribute_datasets_from_function(
        dataset_fn, ds.InputOptions(experimental_replication_mode=ds.InputReplicationMode.PER_REPLICA)
    )
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [
        (2, 0, 2),
        (2, 1, 2),
    ]
    assert len(dist) == 3
    steps = [[v.tolist() for v in strategy.experimental_local_results(x)] for x in dist]
    # replica 0's pipeline has 2 batches, replica 1's 3: replica 0 gets an empty batch at the last step
    assert steps == [[[0.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 1.0]], [[], [1.0, 1.0]]]


def test_a_pipeline_placed_on_its_device_is_built_and_read_there():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    seen: list[Any] = []

    def dataset_fn(ctx: ds.InputContext) -> Iterator[torch.Tensor]:
        seen.append(("built", ctx.input_pipeline_id, torch.get_default_device()))

        def batches() -> Iterator[torch.Tensor]:
            seen.append(("read", ctx.input_pipeline_id, torch.get_default_device()))
            yield torch.ones(1)

        return batches()

    options = ds.InputOptions(
        experimental_replication_mode=ds.InputReplicationMode.PER_REPLICA, experimental_place_dataset_on_device=True
    )
    list(strategy.distribute_datasets_from_function(dataset_fn, options))
    assert seen == [
        ("built", 0, torch.device("cpu", 0)),
        ("built", 1, torch.device("cpu", 1)),
        ("read", 0, torch.device("cpu", 0)),
        ("read", 1, torch.device("cpu", 1)),
    ]
    assert torch.get_default_device() == torch.device("cpu")
