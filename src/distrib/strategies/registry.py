"""Strategies by name: what ``distrib train --strategy NAME`` (and anything else that picks a
strategy from a string) builds, each with a one-line description.

An entry says how to build the strategy from a :class:`StrategyRequest` and what
the command line may launch for it (several worker processes, parameter-server
tasks). Registering a new strategy is one :func:`register` call; nothing else
branches on strategy names or classes.

Example::

    >>> from distrib.strategies import registry
    >>> registry.get("mirrored").description
    'synchronous, one replica per local device (every GPU, or the CPU)'
    >>> registry.build("mirrored", registry.StrategyRequest(replicas=2)).num_replicas_in_sync
    2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["StrategyRequest", "StrategyEntry", "register", "get", "names", "build", "default_name"]


@dataclass(frozen=True)
class StrategyRequest:
    """What a caller may ask of a strategy by name: local replicas, a device, the in-process cluster size."""

    replicas: int | None = None
    device: str | None = None
    workers: int = 2
    ps: int = 1


@dataclass(frozen=True)
class StrategyEntry:
    """A registered strategy: its name, a one-line description and how to build it.

    ``multi_worker``: it runs on several worker processes (``--workers N``).
    ``parameter_servers``: it needs ps tasks (``--ps M``).
    ``default_for``: the job shape it is the default strategy of, if any: ``"one-process"``,
    ``"workers"`` (``--workers N``) or ``"ps"`` (``--ps M``); see :func:`default_name`.
    ``worker_env``: what its worker processes' environment needs, given ``--device`` (read by the C library
    at start-up, so the launcher sets it: the sharded strategy's allocator settings); None: nothing.
    """

    name: str
    description: str
    build: Callable[[StrategyRequest], Strategy]
    multi_worker: bool = False
    parameter_servers: bool = False
    default_for: str = ""
    worker_env: Callable[[str | None], dict[str, str]] | None = None


_ENTRIES: dict[str, StrategyEntry] = {}


def register(entry: StrategyEntry) -> None:
    """Add (or replace) a strategy by name."""
    _ENTRIES[entry.name] = entry


def names() -> list[str]:
    """Every registered name, in registration order."""
    return list(_ENTRIES)


def get(name: str) -> StrategyEntry:
    """The entry registered as ``name``; ValueError naming the choices otherwise."""
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(_ENTRIES)}") from None


def default_name(workers: int = 1, ps: int = 0) -> str:
    """The registered strategy a job of this shape runs when none is named: ps tasks first, then workers.

    Example::

        >>> default_name(), default_name(workers=2), default_name(workers=2, ps=1)
        ('mirrored', 'multi-worker', 'parameter-server')
    """
    shape = "ps" if ps else "workers" if workers > 1 else "one-process"
    for entry in _ENTRIES.values():
        if entry.default_for == shape:
            return entry.name
    raise ValueError(f"no registered strategy is the default for a job of shape {shape!r}")


def build(name: str, request: StrategyRequest | None = None) -> Strategy:
    """Build the strategy registered as ``name``."""
    return get(name).build(request or StrategyRequest())


def _local_device_names(count: int) -> list[str]:
    prefix = "cuda" if torch.cuda.is_available() else "cpu"
    return [f"{prefix}:{i}" for i in range(count)]


def _default(request: StrategyRequest) -> Strategy:
    from distrib.context import default_strategy

    return default_strategy()


def _one_device(request: StrategyRequest) -> Strategy:
    from distrib.strategies.one_device import OneDeviceStrategy

    return OneDeviceStrategy(request.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))


def _mirrored(request: StrategyRequest) -> Strategy:
    from distrib.strategies.mirrored import MirroredStrategy

    return MirroredStrategy(None if request.replicas is None else _local_device_names(request.replicas))


def _central_storage(request: StrategyRequest) -> Strategy:
    from distrib.strategies.central_storage import CentralStorageStrategy

    return CentralStorageStrategy(None if request.replicas is None else _local_device_names(request.replicas))


def _multi_worker(request: StrategyRequest) -> Strategy:
    from distrib.strategies.multi_worker import MultiWorkerMirroredStrategy

    devices = None if request.replicas is None else _local_device_names(request.replicas)
    return MultiWorkerMirroredStrategy(devices=devices)


def _sharded(request: StrategyRequest) -> Strategy:
    from distrib.strategies.sharded import ShardedStrategy

    return ShardedStrategy()


def _sharded_worker_env(device: str | None) -> dict[str, str]:
    """glibc's allocator settings for sharded CPU workers (strategies/allocator.py), unless the user chose one."""
    if (device or "cpu").split(":")[0] != "cpu":
        return {}
    from distrib.strategies.allocator import recommended_env

    return recommended_env()


def _parameter_server(request: StrategyRequest) -> Strategy:
    from distrib import parameter_server, testing
    from distrib.cluster import TFConfigClusterResolver

    ParameterServerStrategy = parameter_server.ParameterServerStrategy  # names `pip install 'distrib[ps]'` if absent

    if TFConfigClusterResolver.detect():
        return ParameterServerStrategy(TFConfigClusterResolver())
    # no cluster given: one in this process, as TF's multi-worker migration guide builds it
    return ParameterServerStrategy(testing.create_in_process_cluster(num_workers=request.workers, num_ps=request.ps))


register(StrategyEntry("default", "no distribution: the step runs once, in place", _default))
register(StrategyEntry("one-device", "one replica on one device (--device, default cuda:0 or cpu)", _one_device))
register(
    StrategyEntry(
        "mirrored",
        "synchronous, one replica per local device (every GPU, or the CPU)",
        _mirrored,
        default_for="one-process",
    )
)
register(
    StrategyEntry(
        "central-storage", "synchronous, parameters on one device, compute on every local device", _central_storage
    )
)
register(
    StrategyEntry(
        "multi-worker",
        "synchronous over worker processes (TF_CONFIG, torchrun or Slurm)",
        _multi_worker,
        multi_worker=True,
        default_for="workers",
    )
)
register(
    StrategyEntry(
        "sharded",
        "synchronous over worker processes, parameters, gradients and optimizer state sharded (FSDP2)",
        _sharded,
        multi_worker=True,
        worker_env=_sharded_worker_env,
    )
)
register(
    StrategyEntry(
        "parameter-server",
        "asynchronous: parameters on ps tasks, steps scheduled on workers",
        _parameter_server,
        multi_worker=True,
        parameter_servers=True,
        default_for="ps",
    )
)
