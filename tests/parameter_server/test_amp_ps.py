"""Mixed precision under ParameterServerStrategy, with ps and worker tasks in real processes.

bfloat16 autocast works inside scheduled functions as in plain PyTorch (it needs no loss scaling), and
so does float16 with ``torch.amp.GradScaler``: the coordinator's scaler is the one scale, each call runs
torch's scaler on a copy on its worker and the coordinator replays the outcomes (tested step by step in
``test_grad_scaler_ps.py``); here, ``fit(precision=...)`` and a disabled scaler.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module


@pytest.fixture(scope="module")
def cluster():
    with ds.testing.LocalCluster(num_workers=2, num_ps=1) as c:
        c.wait_ready(timeout=120)
        yield c


def separable(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def build(cluster) -> tuple[ds.ParameterServerStrategy, nn.Module, torch.optim.Optimizer]:
    strategy = ds.ParameterServerStrategy(cluster.resolver(), token=cluster.token)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    return strategy, model, optimizer


def test_bf16_autocast_in_scheduled_functions_trains_on_worker_processes(cluster):
    strategy, model, optimizer = build(cluster)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    x, y = separable()

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, str]:
        def replica_step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, str]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return float(loss), str(logits.dtype)

        return strategy.run(replica_step, args=(x, y))

    with torch.no_grad():
        before = F.cross_entropy(model(x), y).item()
    results = [coordinator.schedule(step, args=(x, y)) for _ in range(40)]
    coordinator.join(timeout=120)
    values = [r.fetch() for r in results]
    with torch.no_grad():
        after = F.cross_entropy(model(x), y).item()  # parameters read back from the ps task
    assert {dtype for _, dtype in values} == {"torch.bfloat16"}  # the workers ran the forward pass in bf16
    assert after < 0.7 * before, (before, after)
    coordinator.close()


def test_a_disabled_grad_scaler_travels_and_does_nothing(cluster):
    strategy, model, optimizer = build(cluster)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    x, y = separable()
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # a disabled scaler does nothing: pickled as it is

    def plain(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x), y)
        disabled.scale(loss).backward()
        disabled.step(optimizer)
        disabled.update()
        optimizer.zero_grad()
        return float(loss)

    before = [p.detach().clone() for p in model.state_dict().values()]
    assert coordinator.schedule(plain, args=(x, y)).fetch() > 0
    assert not all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), before))  # the step was applied
    assert disabled.get_scale() == 1.0 and not disabled.is_enabled()
    coordinator.close()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.filterwarnings("ignore:fit\\(precision='16-mixed'\\). float16 on this CPU")  # correct, only slow
def test_fit_mixed_precision_learns(cluster, precision):
    strategy, model, optimizer = build(cluster)
    x, y = separable(256)
    data = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]
    history = ds.fit(
        model,
        data,
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        epochs=3,
        steps_per_epoch=8,
        metrics=["accuracy"],
        verbose=0,
        precision=precision,
    )
    losses = history.history["loss"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
