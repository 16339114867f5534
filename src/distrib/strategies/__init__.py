"""Strategies: how one replica function is run over devices and workers.

:class:`~distrib.strategies.base.Strategy` is the small abstract base; the synchronous
strategies (``default``, ``one_device``, ``mirrored``, ``central_storage``, ``multi_worker``, a
file each) are :class:`~distrib.strategies.synchronous.SynchronousStrategy`, which composes the
replica engine (``replica_engine``); ``ParameterServerStrategy`` and its worker-side strategy live
in :mod:`distrib.parameter_server`.
:mod:`~distrib.strategies.registry` names them for the command line.
"""

from distrib.strategies.base import Strategy
from distrib.strategies.central_storage import CentralStorageStrategy
from distrib.strategies.default import DefaultStrategy
from distrib.strategies.mirrored import MirroredStrategy
from distrib.strategies.multi_worker import MultiWorkerMirroredStrategy
from distrib.strategies.one_device import OneDeviceStrategy
from distrib.strategies.sharded import ShardedStrategy
from distrib.strategies.sharding_policy import ShardingPolicy
from distrib.strategies.synchronous import SynchronousStrategy

__all__ = [
    "Strategy",
    "SynchronousStrategy",
    "CentralStorageStrategy",
    "DefaultStrategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ShardedStrategy",
    "ShardingPolicy",
]
