"""``ds.ShardedStrategy`` on a GPU: one process per GPU trains there; processes sharing a GPU are refused clearly.

With one GPU this machine can run one sharded worker (nothing to shard: the model trains on the GPU);
two processes on one GPU cannot use NCCL, and gloo cannot reduce-scatter CUDA tensors (FSDP2 with
gloo on CUDA crashes the process: exit 139), so the strategy refuses that with what to do instead.
"""

from __future__ import annotations

import sys
import textwrap

import torch
from helpers import run_bounded

import distrib as ds


def test_one_sharded_worker_trains_on_the_device(device: torch.device) -> None:
    strategy = ds.ShardedStrategy(devices=[str(device)])
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    assert next(model.parameters()).device.type == device.type

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss((model(x) - y).pow(2).sum(1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = strategy.experimental_distribute_dataset([(torch.ones(8, 8), torch.zeros(8, 1))] * 20)
    losses = [float(strategy.run(step, args=batch)) for batch in data]
    assert losses[-1] < losses[0]


def test_two_workers_on_one_gpu_are_refused_with_what_to_do(device: torch.device, tmp_path) -> None:
    if device.type != "cuda" or torch.cuda.device_count() > 1:
        import pytest

        pytest.skip("needs exactly one GPU (two workers must share it)")
    script = tmp_path / "share.py"
    script.write_text(
        textwrap.dedent("""
        import distrib as ds
        ds.ShardedStrategy()
    """)
    )
    code, out, _ = run_bounded(
        [sys.executable, "-m", "distrib.app.cli", "launch", "--workers", "2", str(script)], timeout=120
    )
    assert code == 1, out
    assert "needs NCCL" in out and "devices=['cpu']" in out, out
