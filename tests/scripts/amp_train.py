"""Mixed-precision training with torch.amp.GradScaler used as in plain PyTorch, under any strategy.

    distrib launch --workers 2 tests/scripts/amp_train.py --out OUT [--strategy multi-worker2] [--clip]
        [--devices cuda:0] [--implementation ring|nccl|auto]

Trains a small MLP for STEPS global batches of 12 under float16 autocast with a GradScaler
(init scale 2**10, growing every 2 clean steps). The global batch of step POISONED has a NaN in
its last example, which belongs to the last replica of the last worker: the step must be
skipped on every replica of every worker, and the scale halved everywhere. Every worker prints
its scale after each step (``scales: [...]``); the chief saves parameters and scales to --out.
``train`` is imported by tests/strategies/test_amp.py for the in-process strategies and the
single-device reference, so every run executes the same code.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

STEPS = 6
POISONED = 3
GLOBAL_BATCH = 12


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]
    data[POISONED][0][-1, 0] = float("nan")
    return data


def train(strategy: Any, clip: bool = False, device_type: str = "cpu") -> dict[str, Any]:
    """Train under ``strategy``; the parameters, the scale after each step, and the parameters before/after POISONED.

    ``device_type`` is autocast's and the GradScaler's ("cuda" for replicas on a GPU: tests/cuda)."""
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # a wrong gradient scale shows
    scaler = torch.amp.GradScaler(device_type, init_scale=2.0**10, growth_interval=2)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device_type, dtype=torch.float16):
            loss = ds.compute_average_loss(
                F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH
            )
        scaler.scale(loss).backward()
        if clip:  # clip the unscaled gradient: under a strategy, the one summed over every replica
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    scales, snapshots = [], {}
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches())):
        if i == POISONED:
            snapshots["before_poisoned"] = [p.detach().clone() for p in model.parameters()]
        strategy.run(step, args=(x, y))
        if i == POISONED:
            snapshots["after_poisoned"] = [p.detach().clone() for p in model.parameters()]
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales, **snapshots}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="multi-worker")
    p.add_argument("--clip", action="store_true")
    p.add_argument("--devices", default=None, help="comma-separated local devices (default: the strategy's choice)")
    p.add_argument("--implementation", default="auto", help="CommunicationOptions(implementation=...)")
    args = p.parse_args()
    options = ds.CommunicationOptions(timeout_seconds=60, implementation=args.implementation)
    devices = ["cpu:0", "cpu:1"] if args.strategy == "multi-worker2" else None
    if args.devices:
        devices = args.devices.split(",")
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=options, devices=devices)
    device_type = strategy.local_devices[0].type
    result = train(strategy, args.clip, device_type)
    print(
        f"worker {strategy.worker_index} devices {[str(d) for d in strategy.local_devices]} backend "
        f"{getattr(strategy.communicator, 'backend', 'local')}",
        flush=True,
    )
    print(
        f"worker {strategy.worker_index} of {strategy.num_workers}, {strategy.num_replicas_in_sync} replicas: "
        f"scales: {json.dumps(result['scales'])}",
        flush=True,
    )
    if strategy.is_chief:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
