"""Turning device names (``"cpu:0"``, ``"cuda:1"``, ``"GPU:0"``) into torch devices, and each worker's default devices."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

__all__ = ["parse_device", "local_devices", "local_process", "worker_devices", "gpu_count"]

log = logging.getLogger("distrib.strategies")


def parse_device(name: str | torch.device) -> torch.device:
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
            f"unknown device {name!r}: use 'cpu', 'cpu:N' (a logical CPU replica) or 'cuda:N'{_available()}"
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


def gpu_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_devices() -> list[str]:
    """Every local GPU (``cuda:N``), or ``["cpu:0"]`` when there is none."""
    return [f"cuda:{i}" for i in range(gpu_count())] or ["cpu:0"]


def _int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def _slurm_local_tasks(environ: Mapping[str, str]) -> int | None:
    """Tasks of this Slurm step on this node, from ``SLURM_STEP_TASKS_PER_NODE`` and ``SLURM_NODEID`` (None: unknown)."""
    from distrib.cluster.slurm import expand_tasks_per_node

    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = _int(environ, "SLURM_NODEID") or 0
    if not per_node:
        return None
    try:
        counts = expand_tasks_per_node(per_node)
    except ValueError:
        return None
    return counts[node] if node < len(counts) else None


def local_process(
    environ: Mapping[str, str], group: tuple[int, int] | None = None
) -> tuple[int, int | None, str] | None:
    """``(local_rank, processes_on_this_host or None, source)`` when a launcher started several processes on this host.

    torchrun (and ``distrib launch``) set ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; Slurm sets
    ``SLURM_LOCALID`` (and the tasks per node); a process group initialised by the user with
    none of these (``mp.spawn``) is taken as one host's processes, ``group = (rank, world_size)``.
    None when this host runs one process, or nothing says.
    """
    local_rank, local_size = _int(environ, "LOCAL_RANK"), _int(environ, "LOCAL_WORLD_SIZE")
    if local_rank is not None:
        return (local_rank, local_size, "LOCAL_RANK") if local_size is None or local_size > 1 else None
    slurm_rank = _int(environ, "SLURM_LOCALID")  # set by srun for each task
    if slurm_rank is not None:
        tasks = _slurm_local_tasks(environ)
        return (slurm_rank, tasks, "SLURM_LOCALID") if tasks is None or tasks > 1 else None
    if group is not None and group[1] > 1:
        return group[0], group[1], "the initialised process group's rank"
    return None


def worker_devices(
    environ: Mapping[str, str] | None = None, gpus: int | None = None, group: tuple[int, int] | None = None
) -> list[str]:
    """The default local devices of one worker process: ``MultiWorkerMirroredStrategy(devices=None)``.

    When a launcher starts several processes on this host (torchrun's ``LOCAL_RANK``,
    Slurm's ``SLURM_LOCALID``, a process group initialised by ``mp.spawn``), each takes one
    GPU: local rank *k* takes ``cuda:k`` (``k`` modulo the GPUs it sees, so that a task
    Slurm narrowed to one GPU takes ``cuda:0``). Otherwise, as TF, every local GPU. Without
    a GPU, the CPU. ``gpus`` (default: counted) and ``environ`` are parameters so that the
    choice is tested without a GPU.

    Example (``torchrun --nproc-per-node 4`` on a 4-GPU host, local rank 2)::

        >>> worker_devices({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, gpus=4)
        ['cuda:2']
        >>> worker_devices({}, gpus=2), worker_devices({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, gpus=0)
        (['cuda:0', 'cuda:1'], ['cpu:0'])
    """
    env = os.environ if environ is None else environ
    count = gpu_count() if gpus is None else gpus
    if count == 0:
        return ["cpu:0"]
    local = local_process(env, group)
    if local is None:
        return [f"cuda:{i}" for i in range(count)]
    local_rank, processes, source = local
    if processes is not None and processes > count:
        log.warning(
            "%d processes on this host share %d GPU(s) (local rank %d, from %s, takes cuda:%d); "
            "pass devices=[...] to choose",
            processes,
            count,
            local_rank,
            source,
            local_rank % count,
        )
    return [f"cuda:{local_rank % count}"]


def _available() -> str:
    return "; available: " + ", ".join(local_devices())
