"""One process on a GPU: OneDeviceStrategy on ``cuda:0``, MirroredStrategy over ``[cuda:0]`` and over
``[cuda:0, cpu]``, and the main job's step (``distrib train``'s model and loop) under OneDevice.

Each strategy's parameters after a few SGD-with-momentum steps must equal plain PyTorch's on the
same device (the reference adds no strategy), and the parameters must live where the strategy says.
A replica on the CPU beside one on the GPU gets half of each global batch; the gradients are summed on
the first replica's device, so the result still equals one device's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.app import models
from distrib.app.train import make_steps

STEPS, GLOBAL_BATCH = 4, 16


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def reference(device: torch.device) -> list[torch.Tensor]:
    """Plain PyTorch on ``device``: no strategy anywhere."""
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def train(strategy: ds.Strategy) -> tuple[list[torch.Tensor], set[str]]:
    """The same training in ``strategy.run``: parameters (on the CPU) and the devices they lived on."""
    with strategy.scope():
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for x, y in strategy.experimental_distribute_dataset(batches()):
        strategy.run(step, args=(x, y))
    return [p.detach().cpu() for p in model.parameters()], {str(p.device) for p in model.parameters()}


def assert_close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_one_device_strategy_on_the_device_trains_as_plain_pytorch(device):
    params, where = train(ds.OneDeviceStrategy(str(device)))
    assert where == {str(torch.empty(0, device=device).device)}
    expected = reference(device)
    assert any(not torch.equal(p, q) for p, q in zip(expected, [p.detach() for p in mlp().parameters()]))  # it trained
    assert_close(params, expected)


def test_mirrored_over_one_gpu_is_one_replica_and_trains_as_plain_pytorch(device):
    strategy = ds.MirroredStrategy([str(device)])
    assert strategy.num_replicas_in_sync == 1
    params, where = train(strategy)
    assert where == {str(torch.empty(0, device=device).device)}
    assert_close(params, reference(device))


def test_mirrored_over_the_gpu_and_the_cpu_sums_both_halves(device, other_device):
    strategy = ds.MirroredStrategy([str(device), other_device])
    assert strategy.num_replicas_in_sync == 2
    assert [d.type for d in strategy.local_devices] == [device.type, "cpu"]
    params, _ = train(strategy)
    assert_close(params, reference(device))


def test_main_job_step_under_one_device_equals_the_step_without_a_strategy(device):
    """``distrib train``'s model, fused Adam and make_steps: strategy.run on the GPU == the bare step."""
    g = torch.Generator().manual_seed(1)
    images = torch.rand(3, 32, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (3, 32), generator=g)
    out = []
    for strategy in (None, ds.OneDeviceStrategy(str(device))):
        scope = strategy.scope() if strategy is not None else ds.get_strategy().scope()
        with scope:
            torch.manual_seed(0)
            model = models.fashion_mnist_cnn()
            if strategy is None:
                model.to(device)
            opt = models.fashion_mnist_optimizer(model.parameters())
            metrics = (
                ds.metrics.SparseCategoricalAccuracy(),
                ds.metrics.Mean(),
                ds.metrics.SparseCategoricalAccuracy(),
            )
        train_step, _ = make_steps(model, opt, 32, *metrics)
        losses = []
        if strategy is None:
            for x, y in zip(images, labels):
                losses.append(float(train_step((x.to(device), y.to(device))).detach()))
        else:  # the batches reach the device as distrib train's do: through the strategy's input
            for batch in strategy.experimental_distribute_dataset(list(zip(images, labels))):
                losses.append(float(strategy.run(train_step, args=(batch,)).detach()))
        out.append(([p.detach().cpu() for p in model.parameters()], losses, float(metrics[0].result())))
    (plain, plain_losses, plain_acc), (strat, strat_losses, strat_acc) = out
    assert strat_losses == pytest.approx(plain_losses, rel=1e-4)  # cuDNN may pick kernels per call: not bitwise
    assert strat_acc == pytest.approx(plain_acc, abs=1 / 96)
    assert plain_losses[-1] < plain_losses[0]  # it trained
    for a, b in zip(strat, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
