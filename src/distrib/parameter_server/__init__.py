"""Parameter-server training: ``ParameterServerStrategy``, ``ClusterCoordinator``, ``Server``, partitioners.

Roles, as in TF 2 (single client):

* the **coordinator** (the ``chief`` task) runs the user's script: it builds the
  model under ``ParameterServerStrategy.scope()`` and schedules functions with
  :class:`~distrib.coordinator.ClusterCoordinator`;
* **ps** tasks hold the parameters (whole, or in shards) and the optimizer state beside
  them, and apply updates as they arrive;
* **worker** tasks run the scheduled functions: read the parameters they need from the
  ps tasks, compute gradients, send them back.

Layout: :mod:`.strategy`, :mod:`.partitioners`, :mod:`.variables` (placement,
pull/push), :mod:`.optimizer_state`, :mod:`.datasets` (per-worker data), :mod:`.scaler`
(GradScalers in scheduled functions) and :mod:`.errors` here; the coordinator's side
in :mod:`.client` (``coordinator``, ``dispatch``, ``remote_value``, ``failure_policy``,
``step_executor``); the tasks' side in :mod:`.server` (``server``, ``ps_service``,
``worker_service``); the bytes between them in :mod:`.transport` (``rpc``: gRPC,
token, TLS; ``wire``: tensors as raw bytes; ``pickling``: functions sent once).

Nothing here is imported by ``import distrib``: grpc and cloudpickle load when a
name of this package is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distrib.parameter_server.client import coordinator
    from distrib.parameter_server.client.coordinator import ClusterCoordinator, PerWorkerDataset, PerWorkerIterator
    from distrib.parameter_server.client.failure_policy import FailurePolicy
    from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
    from distrib.parameter_server.errors import (
        AuthenticationError,
        ClosureCancelledError,
        ParameterServerUnavailableError,
        ScheduledFunctionError,
        WorkerUnavailableError,
    )
    from distrib.parameter_server.server.server import Server
    from distrib.parameter_server.strategy import ParameterServerStrategy
    from distrib.parameter_server.transport.rpc import TLSConfig

from distrib.parameter_server import partitioners

# name -> module that defines it; loaded on first use
_LAZY = {
    "coordinator": "distrib.parameter_server.client.coordinator",
    "ClusterCoordinator": "distrib.parameter_server.client.coordinator",
    "PerWorkerDataset": "distrib.parameter_server.client.coordinator",
    "PerWorkerIterator": "distrib.parameter_server.client.coordinator",
    "FailurePolicy": "distrib.parameter_server.client.failure_policy",
    "RemoteValue": "distrib.parameter_server.client.remote_value",
    "RemoteValueStatus": "distrib.parameter_server.client.remote_value",
    "AuthenticationError": "distrib.parameter_server.errors",
    "ClosureCancelledError": "distrib.parameter_server.errors",
    "ParameterServerUnavailableError": "distrib.parameter_server.errors",
    "ScheduledFunctionError": "distrib.parameter_server.errors",
    "WorkerUnavailableError": "distrib.parameter_server.errors",
    "Server": "distrib.parameter_server.server.server",
    "ParameterServerStrategy": "distrib.parameter_server.strategy",
    "TLSConfig": "distrib.parameter_server.transport.rpc",
}

__all__ = sorted([*_LAZY, "partitioners"])


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'distrib.parameter_server' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in ("grpc", "cloudpickle"):
            raise
        raise ImportError(
            f"distrib's parameter servers need {e.name!r}, which is not installed: pip install 'distrib[ps]'"
        ) from e
    value = module if name == "coordinator" else getattr(module, name)
    globals()[name] = value
    return value
