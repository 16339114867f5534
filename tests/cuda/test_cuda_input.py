"""Input onto the device: ``experimental_distribute_dataset`` places each replica's part on its device.

``InputOptions(experimental_fetch_to_device=True)`` (the default) copies each replica's part to its device from
pinned memory (pinning it first when the pipeline did not), ``non_blocking``; with
``experimental_per_replica_buffer_size`` > 0 the copies of the next steps are issued on a side CUDA stream while
the current step runs. The values must arrive unchanged, on the right device, for pinned and ordinary batches, split
over a GPU and a CPU replica, prefetched or not; ``experimental_fetch_to_device=False`` leaves them on the host.
"""

from __future__ import annotations

import pytest
import torch

import distrib as ds


def batches(pinned: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(3)]
    return [(x.pin_memory(), y.pin_memory()) for x, y in out] if pinned else out


def test_pinned_batches_arrive_on_the_gpu_unchanged(device, cuda_only):
    data = batches(pinned=True)
    assert all(x.is_pinned() for x, _ in data)
    strategy = ds.OneDeviceStrategy(str(device))
    for (x, y), (got_x, got_y) in zip(data, strategy.experimental_distribute_dataset(data)):
        seen = strategy.run(lambda a, b: (a.device, a.sum(), b.clone()), args=(got_x, got_y))
        assert seen[0].type == "cuda"
        torch.testing.assert_close(seen[1].cpu(), x.sum(), rtol=1e-5, atol=1e-4)
        assert torch.equal(seen[2].cpu(), y)


@pytest.mark.parametrize("two", [False, True], ids=["one_replica", "gpu_and_cpu"])
def test_batches_are_split_onto_each_replica_device(device, other_device, two):
    devices = [str(device), other_device] if two else [str(device)]
    strategy = ds.MirroredStrategy(devices)
    data = batches(pinned=False)
    for (x, _), dist_batch in zip(data, strategy.experimental_distribute_dataset(data)):
        parts = strategy.run(lambda a, b: a.clone(), args=dist_batch)
        local = strategy.experimental_local_results(parts)
        assert [p.device.type for p in local] == [d.type for d in strategy.local_devices]
        torch.testing.assert_close(torch.cat([p.cpu() for p in local]), x, rtol=0, atol=0)


@pytest.mark.parametrize("buffer", [0, 1, 3])
def test_prefetched_parts_arrive_unchanged_in_order(device, other_device, buffer):
    strategy = ds.MirroredStrategy([str(device), other_device])
    data = batches(pinned=False)
    options = ds.InputOptions(experimental_per_replica_buffer_size=buffer)
    sums = []
    for dist_batch in strategy.experimental_distribute_dataset(data, options):
        parts = strategy.experimental_local_results(
            strategy.run(lambda a, b: (a.device, a.double().sum()), args=dist_batch)
        )
        assert [p[0].type for p in parts] == [d.type for d in strategy.local_devices]
        sums.append(sum(p[1].item() for p in parts))
    assert sums == pytest.approx([x.double().sum().item() for x, _ in data], rel=1e-9)


def test_the_prefetch_reads_ahead_only_on_a_gpu(device, cuda_only):
    read = []

    def source():
        for i, b in enumerate(batches(pinned=False)):
            read.append(i)
            yield b

    strategy = ds.OneDeviceStrategy(str(device))
    it = iter(
        strategy.experimental_distribute_dataset(source(), ds.InputOptions(experimental_per_replica_buffer_size=2))
    )
    x, _ = next(it)
    assert x.device.type == "cuda" and read == [0, 1, 2]  # the copies of 2 more steps are on their way
    assert len(list(it)) == 2


def test_fetch_to_device_false_leaves_parts_on_the_host(device):
    strategy = ds.OneDeviceStrategy(str(device))
    data = batches(pinned=False)
    options = ds.InputOptions(experimental_fetch_to_device=False)
    for (x, _), (got, _) in zip(data, strategy.experimental_distribute_dataset(data, options)):
        assert got.device.type == "cpu" and got is x
