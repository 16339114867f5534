"""Where a ``worker`` task computes: its GPU when it has one, as TF's workers do, else its CPU.

TF places a worker's ops on the worker's first GPU when it has one; the ps tasks keep the
variables in host memory. distrib's workers do the same: a worker's copies of the variables
(refreshed from the ps tasks before each scheduled function), the tensors a scheduled function
captured by value, its tensor arguments and the batches of its per-worker iterators live on
the worker's device; gradients and results are copied back to the host when they are sent.

The device is ``Server(..., device=...)``, else ``DISTRIB_WORKER_DEVICE`` (what ``distrib
launch`` and ``python -m distrib.parameter_server`` pass on: the environment travels to every
task), else ``cuda`` when this process sees a GPU, else ``cpu``.

    >>> resolve_worker_device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["WORKER_DEVICE_ENV", "resolve_worker_device", "to_worker_device"]

#: the device of the worker tasks started without ``Server(device=...)``: ``cpu``, ``cuda`` or ``cuda:N``
WORKER_DEVICE_ENV = "DISTRIB_WORKER_DEVICE"


def resolve_worker_device(device: str | torch.device | None = None) -> torch.device:
    """The device a worker computes on: ``device``, else ``DISTRIB_WORKER_DEVICE``, else its GPU or CPU.

    Args:
        device: ``"cpu"``, ``"cuda"`` (this process's current GPU) or ``"cuda:N"``; None picks.

    Returns:
        The ``torch.device``, with its index for a GPU.

    Raises:
        ValueError: the device is not a CPU or a GPU this process sees, saying which it sees.
    """
    if device is None and os.environ.get(WORKER_DEVICE_ENV, "").strip():
        device = os.environ[WORKER_DEVICE_ENV].strip()
        said = f"{WORKER_DEVICE_ENV}={device!r}"
    else:
        said = f"Server(device={device!r})"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{said} is not a device: use 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if chosen.type == "cpu":
        return torch.device("cpu")
    if chosen.type != "cuda":
        raise ValueError(f"{said}: a worker computes on 'cpu' or a GPU ('cuda', 'cuda:N')")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(
            f"{said}, but this process sees no GPU (torch.cuda.is_available() is False): "
            f"use 'cpu', or check CUDA_VISIBLE_DEVICES and that torch is a CUDA build"
        )
    index = torch.cuda.current_device() if chosen.index is None else chosen.index
    if index >= count:
        raise ValueError(f"{said}, but this process sees {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def to_worker_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor leaf moved to ``device`` (a no-op for tensors already there)."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)
