"""The correctness cases of ``ds.function`` (issue 28): one training run, eager or under ``ds.function``.

``run_case(device, strategy, feature, use_function)`` trains the seeds' CNN for ``STEPS`` Adam steps on
random data of Fashion-MNIST's shape (9 batches of 64 and a ragged one of 40, cycled; on the CPU, where the
dry run only proves the code, 16 and 10) and returns every
parameter, every optimizer state tensor and the metrics, on the CPU, plus the path ``ds.function`` took.
``tests/cuda/test_cuda_function.py`` compares the two runs; ``benchmarks/function_correctness.py`` prints the
table. Features:

* ``plain``: the seed's step (forward, ``compute_average_loss``, backward, step, ``zero_grad``, accuracy);
* ``accumulate``: two ``ds.function`` s, one adding half a batch's gradients, one applying them every 2 calls;
* ``clip``: ``clip_grad_norm_(..., 0.5)`` inside the step;
* ``schedule``: ``StepLR`` (a tensor rate filled in place) and a float written into ``group["lr"]`` by hand;
* ``bf16``: the forward under ``torch.autocast(bfloat16)``;
* ``fp16`` / ``fp16_fused``: a ``GradScaler``, with one poisoned (inf) batch whose step must be skipped;
  ``fp16`` uses plain Adam (its scaler reads the inf check on the host: eager), ``fp16_fused`` Adam(fused=True);
* ``checkpoint``: ``ds.Checkpoint`` written at step 20, restored at step 30 (of 50), training on to the end.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import distrib as ds
from distrib.app import models
from distrib.graphs.capturable import make_capturable

STEPS = 50
BATCH = 64
#: the CPU dry run's batch (and its ragged one, 10): float16 convolutions are slow on a CPU (the fp16 and bf16
#: cases took 15-19 s each at 64 there, 2026-11-29), and every path runs the same at 16
CPU_BATCH = 16
FEATURES = ("plain", "accumulate", "clip", "schedule", "bf16", "fp16", "fp16_fused", "checkpoint")
STRATEGIES = ("default", "one_device", "mirrored")


def batch_size(device: torch.device) -> int:
    """The global batch the cases train with on ``device``: :data:`BATCH` on a GPU, :data:`CPU_BATCH` on a CPU."""
    return CPU_BATCH if device.type == "cpu" else BATCH


def batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    full = batch_size(device)
    sizes = [full] * 9 + [full * 5 // 8]  # a ragged last batch (40 of 64): its own signature
    return [
        (torch.rand(n, 1, 28, 28, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device))
        for n in sizes
    ]


def make_strategy(kind: str, device: torch.device) -> ds.Strategy | None:
    if kind == "default":
        return None
    if kind == "one_device":
        return ds.OneDeviceStrategy(str(device))
    if kind == "mirrored":
        return ds.MirroredStrategy([str(device)])
    raise ValueError(kind)


def run_case(
    device: torch.device,
    strategy_kind: str,
    feature: str,
    use_function: bool,
    steps: int = STEPS,
    capturable: bool = False,
) -> dict[str, Any]:
    """Train (``capturable``: an eager run whose optimizer is set up as ``ds.function`` sets it, at the step where
    it does: its first capture, after 2 warm-up calls, the 3rd step, or the 3rd apply call with ``accumulate``); return ``{"params": [...], "state": [...], "accuracy": float, "losses": [...], "paths": {...}}``."""
    strategy = make_strategy(strategy_kind, device)
    scope = strategy.scope() if strategy is not None else _nullcontext()
    torch.manual_seed(0)
    with scope:
        model = models.fashion_mnist_cnn().to(device)
        fused = feature == "fp16_fused"
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True if fused else None)
        accuracy = ds.metrics.SparseCategoricalAccuracy()
    capturable_from = (5 if feature == "accumulate" else 2) if capturable else None
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8) if feature.startswith("fp16") else None
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5) if feature == "schedule" else None
    run = strategy.run if strategy is not None else (lambda fn, args=(): fn(*args))
    reduce = (lambda v: strategy.reduce("sum", v, axis=None)) if strategy is not None else (lambda v: v.detach())

    def forward_loss(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.bfloat16 if feature == "bf16" else torch.float16
        with torch.autocast(device.type, dtype=dtype, enabled=feature in ("bf16", "fp16", "fp16_fused")):
            logits = model(x)
            per_example = F.cross_entropy(logits, y, reduction="none")
        return ds.compute_average_loss(per_example, global_batch_size=batch_size(device)) * scale, logits

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss, logits = forward_loss(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if feature == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
        optimizer.zero_grad()
        accuracy.update_state(y, logits)
        return loss

    def replica_accumulate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss, logits = forward_loss(x, y, 0.5)
        loss.backward()
        accuracy.update_state(y, logits)
        return loss

    def replica_apply() -> None:
        optimizer.step()
        optimizer.zero_grad()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return reduce(run(replica_step, args=(x, y)))

    def accumulate_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return reduce(run(replica_accumulate, args=(x, y)))

    def apply_step() -> None:
        run(replica_apply)

    wrap: Callable[[Any], Any] = ds.function if use_function else (lambda f: f)
    step, accumulate, apply = wrap(train_step), wrap(accumulate_step), wrap(apply_step)
    data = batches(device)
    losses: list[torch.Tensor] = []
    tmp = tempfile.mkdtemp()
    checkpoint = ds.Checkpoint(model=model, optimizer=optimizer) if feature == "checkpoint" else None
    save_at, restore_at = int(steps * 0.4) - 1, int(steps * 0.6) - 1  # steps 20 and 30 of 50
    for i in range(steps):
        if i == capturable_from:
            make_capturable(optimizer)
        x, y = data[i % len(data)]
        if feature.startswith("fp16") and i == 7:
            x = torch.full_like(x, float("inf"))  # a poisoned batch: the scaler must skip this step
        if feature == "accumulate":
            losses.append(accumulate(x, y))
            if i % 2 == 1:
                apply()
        else:
            losses.append(step(x, y))
        if scheduler is not None:
            scheduler.step()
            if i % 15 == 14:  # a hand-written schedule: a float into the group
                for group in optimizer.param_groups:
                    group["lr"] = float(group["lr"]) * 0.9
        if checkpoint is not None and i == save_at:
            saved = checkpoint.save(os.path.join(tmp, "ckpt"))
        if checkpoint is not None and i == restore_at:
            checkpoint.restore(saved)
    state = [
        v.detach().float().cpu()
        for s in optimizer.state.values()
        for _, v in sorted(s.items())
        if isinstance(v, torch.Tensor)
    ]
    paths: dict[str, str] = {}
    for f in (step, accumulate, apply):
        paths.update(getattr(f, "paths", lambda: {})())
    return {
        "params": [p.detach().float().cpu() for p in model.parameters()],
        "state": state,
        "accuracy": float(accuracy.result()),
        "losses": [float(v) for v in losses],
        "paths": paths,
        "scale": float(scaler.get_scale()) if scaler is not None else None,
    }


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """The largest absolute difference of parameters, optimizer state, accuracy and losses between two runs."""

    def most(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
        assert len(xs) == len(ys), (len(xs), len(ys))
        return max(float((x - y).abs().max()) for x, y in zip(xs, ys))

    return {
        "params": most(a["params"], b["params"]),
        "state": most(a["state"], b["state"]),
        "accuracy": abs(a["accuracy"] - b["accuracy"]),
        "losses": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
    }


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
