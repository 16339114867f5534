"""Parameter-server training: ``ParameterServerStrategy``, ``ClusterCoordinator``, ``Server``, partitioners.

Roles, as in TF 2 (single client):

* the **coordinator** (the ``chief`` task) runs the user's script: it builds the
  model under ``ParameterServerStrategy.scope()`` and schedules functions with
  :class:`~distrib.coordinator.ClusterCoordinator`;
* **ps** tasks hold the parameters (whole, or in shards) and the optimizer state beside
  them, and apply updates as they arrive;
* **worker** tasks run the scheduled functions: read the parameters they need from the
  ps tasks, compute gradients, send them back.

Modules, one per concept: :mod:`.strategy`, :mod:`.coordinator` (with :mod:`.remote_value`
and :mod:`.failure_policy`), :mod:`.server` (with :mod:`.ps_service` and
:mod:`.worker_service`), :mod:`.variables` (placement, pull/push), :mod:`.partitioners`,
:mod:`.optimizer_state`, :mod:`.pickling` (sending functions once), :mod:`.rpc` (gRPC,
token, TLS) and :mod:`.wire` (tensors as raw bytes).
"""

from distrib.parameter_server import coordinator, partitioners
from distrib.parameter_server.coordinator import ClusterCoordinator, PerWorkerDataset, PerWorkerIterator
from distrib.parameter_server.errors import (AuthenticationError, ClosureCancelledError,
                                             ParameterServerUnavailableError, ScheduledFunctionError,
                                             WorkerUnavailableError)
from distrib.parameter_server.failure_policy import FailurePolicy
from distrib.parameter_server.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.rpc import TLSConfig
from distrib.parameter_server.server import Server
from distrib.parameter_server.strategy import ParameterServerStrategy

__all__ = [
    "AuthenticationError",
    "ClosureCancelledError",
    "ClusterCoordinator",
    "FailurePolicy",
    "ParameterServerStrategy",
    "ParameterServerUnavailableError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "RemoteValueStatus",
    "ScheduledFunctionError",
    "Server",
    "TLSConfig",
    "WorkerUnavailableError",
    "coordinator",
    "partitioners",
]
