"""Input onto the device: ``experimental_distribute_dataset`` places each replica's part on its device.

distrib has no prefetcher of its own: it copies a batch to the device when ``strategy.run`` gets it,
``non_blocking`` when the batch is in pinned memory (``DataLoader(pin_memory=True)``). The values must
arrive unchanged, on the right device, for pinned and ordinary batches, and split over a GPU and a CPU replica.
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
