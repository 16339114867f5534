"""distrib: tf.distribute's strategies for PyTorch custom training loops.

Write one training step; run it on one device, on several local devices, or on
many worker processes, by changing the strategy::

    import distrib as ds
    strategy = ds.MirroredStrategy()              # or OneDeviceStrategy("cuda:0"), ...
    with strategy.scope():
        model = make_model()                      # mirrored on every replica
        optimizer = torch.optim.Adam(model.parameters())
    for batch in strategy.experimental_distribute_dataset(loader):
        strategy.run(train_step, args=(batch,))   # optimizer.step() sums over replicas

Glossary
--------
replica
    One copy of the model that computes on its share of every global batch.
    ``num_replicas_in_sync`` counts them over all workers.
worker
    One process taking part in synchronous training; it drives one or more
    local replicas (``strategy.worker_index`` of ``strategy.num_workers``).
chief
    The worker that does the extra bookkeeping: it alone writes checkpoints and
    summaries (``strategy.is_chief``). The ``chief`` task if the cluster has one,
    else worker 0.
ps
    A parameter-server task: it holds (shards of) the parameters under
    ``ParameterServerStrategy``.
coordinator
    The process that schedules functions on workers under
    ``ParameterServerStrategy`` (the chief).
cross-replica context
    Code inside ``strategy.scope()`` but outside ``strategy.run``: it sees all
    replicas' values at once (``reduce``, ``gather``).
replica context
    Code inside the function given to ``strategy.run``: it sees its own
    replica's values (``get_replica_context()``).

Layout: the strategy core here and in :mod:`distrib.strategies`; communication
between processes in :mod:`distrib.comm`; clusters and the launcher in
:mod:`distrib.cluster`; ``fit`` and callbacks in :mod:`distrib.keras`; parameter
servers in :mod:`distrib.parameter_server`; the ``distrib train`` app in :mod:`distrib.app`.
Every name is loaded on first use: ``import distrib`` alone imports neither torch nor grpc
nor cloudpickle (``distrib launch`` needs none of them; the tasks it starts import what they use).
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys
import warnings as _warnings
from typing import TYPE_CHECKING, Any, Optional


def _numpy_missing() -> bool:
    try:
        return _importlib_util.find_spec("numpy") is None
    except (ImportError, ValueError):
        return True


if "torch" not in _sys.modules and _numpy_missing():
    # torch warns "Failed to initialize NumPy" on import when numpy is absent; distrib needs no numpy
    # (it is not a requirement), so that warning would only alarm users of `distrib train`
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

if TYPE_CHECKING:
    from distrib import cluster as cluster_resolver
    from distrib import experimental, metrics, parameter_server, testing
    from distrib.checkpoint import (
        Checkpoint,
        CheckpointError,
        CheckpointManager,
        checkpoints_iterator,
        latest_checkpoint,
    )
    from distrib.cluster import ClusterSpec
    from distrib.comm import CollectiveError, CommunicationImplementation, CommunicationOptions, PowerSGD
    from distrib.context import (
        get_cross_replica_context,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from distrib.graphs import function
    from distrib.input import (
        AutoShardPolicy,
        InputContext,
        InputOptions,
        InputReplicationMode,
        OptionalValue,
        OutOfRangeError,
        TensorSpec,
    )
    from distrib.keras import callbacks
    from distrib.keras.loop import evaluate, fit, predict
    from distrib.losses import compute_average_loss, scale_regularization_loss
    from distrib.parameter_server import ParameterServerStrategy, Server, partitioners
    from distrib.parameter_server.client import coordinator
    from distrib.strategies import (
        CentralStorageStrategy,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        ShardedStrategy,
        ShardingPolicy,
        Strategy,
    )
    from distrib.strategies.base import RunOptions, UnscaledLossWarning, ValueContext
    from distrib.strategies.mirrored import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReductionToOneDevice,
    )
    from distrib.strategies.replica import ReplicaContext
    from distrib.values import PerReplica, ReduceOp

__version__ = "0.1.0"

# Every public name is loaded on first use (PEP 562), from the module that defines it: `import distrib` alone
# imports no torch, so a process that only launches others (`distrib launch`, whose tasks import torch
# themselves) starts in a tenth of the time. Names from distrib.parameter_server load it (and grpc) then.
_LAZY: dict[str, tuple[str, str | None]] = {
    "cluster_resolver": ("distrib.cluster", None),
    "ClusterSpec": ("distrib.cluster", "ClusterSpec"),
    **{
        name: ("distrib.checkpoint", name)
        for name in ("Checkpoint", "CheckpointError", "CheckpointManager", "checkpoints_iterator", "latest_checkpoint")
    },
    **{
        name: ("distrib.comm", name)
        for name in ("CollectiveError", "CommunicationImplementation", "CommunicationOptions", "PowerSGD")
    },
    **{
        name: ("distrib.context", name)
        for name in (
            "get_cross_replica_context",
            "get_replica_context",
            "get_strategy",
            "has_strategy",
            "in_cross_replica_context",
        )
    },
    **{
        name: ("distrib.input", name)
        for name in (
            "AutoShardPolicy",
            "InputContext",
            "InputOptions",
            "InputReplicationMode",
            "OptionalValue",
            "OutOfRangeError",
            "TensorSpec",
        )
    },
    "callbacks": ("distrib.keras", "callbacks"),
    "function": ("distrib.graphs", "function"),
    **{name: ("distrib.keras.loop", name) for name in ("evaluate", "fit", "predict")},
    **{name: ("distrib.losses", name) for name in ("compute_average_loss", "scale_regularization_loss")},
    **{
        name: ("distrib.parameter_server", name)
        for name in ("ParameterServerStrategy", "Server", "coordinator", "partitioners")
    },
    **{
        name: ("distrib.strategies", name)
        for name in (
            "CentralStorageStrategy",
            "MirroredStrategy",
            "MultiWorkerMirroredStrategy",
            "OneDeviceStrategy",
            "ShardedStrategy",
            "ShardingPolicy",
            "Strategy",
        )
    },
    **{name: ("distrib.strategies.base", name) for name in ("RunOptions", "UnscaledLossWarning", "ValueContext")},
    **{
        name: ("distrib.strategies.mirrored", name)
        for name in ("CrossDeviceOps", "HierarchicalCopyAllReduce", "NcclAllReduce", "ReductionToOneDevice")
    },
    "ReplicaContext": ("distrib.strategies.replica", "ReplicaContext"),
    **{name: ("distrib.values", name) for name in ("PerReplica", "ReduceOp")},
}

__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "ClusterSpec",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "CollectiveError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ShardedStrategy",
    "ShardingPolicy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "OptionalValue",
    "OutOfRangeError",
    "ParameterServerStrategy",
    "PerReplica",
    "PowerSGD",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Server",
    "Strategy",
    "TensorSpec",
    "UnscaledLossWarning",
    "ValueContext",
    "callbacks",
    "checkpoints_iterator",
    "cluster_resolver",
    "compute_average_loss",
    "coordinator",
    "evaluate",
    "experimental",
    "fit",
    "function",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "latest_checkpoint",
    "metrics",
    "partitioners",
    "predict",
    "scale_regularization_loss",
    "testing",
]


def __getattr__(name: str) -> Any:
    """A public name (or a subpackage, e.g. ``distrib.experimental``), imported on first use and kept."""
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        module = _importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
    elif not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        value = _importlib.import_module(f"{__name__}.{name}")  # a submodule: as `import distrib.<name>` gives it
    else:
        raise AttributeError(f"module 'distrib' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
