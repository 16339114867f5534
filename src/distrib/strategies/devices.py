"""Turning device names (``"cpu:0"``, ``"cuda:1"``, ``"GPU:0"``) into torch devices."""

from __future__ import annotations

import torch

__all__ = ["parse_device", "local_devices"]


def parse_device(name: "str | torch.device") -> torch.device:
    """The torch device for ``name``; TF spellings (``"/gpu:0"``, ``"GPU:1"``) are accepted.

    ``"cpu:1"`` is a *logical* CPU replica: it computes on the one CPU device.
    Raises ValueError naming the device when it is unknown or absent on this machine.
    """
    if isinstance(name, torch.device):
        text = str(name)
    else:
        text = str(name).strip()
    spelled = text.lower().rsplit("/device:", 1)[-1].lstrip("/")
    if spelled.startswith("gpu"):
        spelled = "cuda" + spelled[3:]
    try:
        device = torch.device(spelled)
    except RuntimeError:
        raise ValueError(
            f"unknown device {name!r}: use 'cpu', 'cpu:N' (a logical CPU replica) or 'cuda:N'"
            f"{_available()}"
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else 0
        if index >= count:
            raise ValueError(f"device {name!r} is not available: this machine has {count} CUDA device(s){_available()}")
        return torch.device("cuda", index)
    raise ValueError(f"unsupported device {name!r}: distrib replicates over 'cpu:N' and 'cuda:N' devices{_available()}")


def local_devices() -> list[str]:
    """Every local GPU (``cuda:N``), or ``["cpu:0"]`` when there is none."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu:0"]


def _available() -> str:
    return "; available: " + ", ".join(local_devices())
