"""Checkpoints across devices: written from the GPU and restored on the CPU, and the other way round.

The model and its Adam state (``exp_avg`` etc.) written under OneDeviceStrategy on the GPU must come back
on the CPU equal and on the CPU (a step then runs there), and a CPU checkpoint must come back onto the
GPU's parameters under the strategy, with the optimizer state on the GPU too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_once(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 6, generator=g).to(device), torch.randint(0, 3, (10,), generator=g).to(device)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [s["exp_avg"].clone(), s["exp_avg_sq"].clone()]
    return out


def test_written_on_the_gpu_restored_on_the_cpu(tmp_path, device):
    strategy = ds.OneDeviceStrategy(str(device))
    with strategy.scope():
        model, opt = build()
    strategy.run(train_once, args=(model, opt, device))
    saved = state(model, opt)
    assert {t.device.type for t in saved} == {device.type}
    path = ds.Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt")

    cpu_model, cpu_opt = build()
    ds.Checkpoint(model=cpu_model, optimizer=cpu_opt).restore(path).assert_consumed()
    train_once(cpu_model, cpu_opt, torch.device("cpu"))  # the optimizer state must be on the CPU for this
    restored_model, restored_opt = build()
    ds.Checkpoint(model=restored_model, optimizer=restored_opt).restore(path)
    restored = state(restored_model, restored_opt)
    assert len(restored) == len(saved) == 3 * 4  # 4 parameters, each with two Adam moments
    for a, b in zip(restored, saved):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0)


def test_written_on_the_cpu_restored_onto_the_gpu(tmp_path, device):
    model, opt = build()
    train_once(model, opt, torch.device("cpu"))
    saved = state(model, opt)
    path = ds.Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt")

    strategy = ds.OneDeviceStrategy(str(device))
    with strategy.scope():
        gpu_model, gpu_opt = build()
    ds.Checkpoint(model=gpu_model, optimizer=gpu_opt).restore(path).assert_consumed()
    params = [p.detach() for p in gpu_model.parameters()]
    assert {p.device.type for p in params} == {device.type}
    for a, b in zip(params, saved):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    strategy.run(train_once, args=(gpu_model, gpu_opt, device))  # a step on the GPU with the restored state
    moments = [s["exp_avg"] for s in gpu_opt.state.values()]
    assert moments and {m.device.type for m in moments} == {device.type}
