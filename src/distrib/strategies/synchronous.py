"""``SynchronousStrategy``: the strategies whose replicas step in lockstep, by composing the replica engine.

The default, one-device, mirrored, central-storage and multi-worker strategies differ only in
their constructor: which devices, which communicator, where parameters live, how large a gradient
bucket is. Everything they do with a step is the :class:`~distrib.strategies.replica_engine.ReplicaEngine`
they hold; this class answers :class:`~distrib.strategies.base.Strategy`'s abstract members with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distrib.comm import Communicator
from distrib.comm.hooks import CommHook
from distrib.comm.options import DEFAULT_BYTES_PER_PACK
from distrib.strategies.base import Strategy
from distrib.strategies.extended import GradientMerge
from distrib.strategies.replica import ReplicaContext
from distrib.strategies.replica_engine import ReplicaEngine
from distrib.strategies.run_options import RunOptions

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver
    from distrib.input import DistributedDataset, DistributedDatasetsFromFunction
    from distrib.strategies.execution import StepExecutor

__all__ = ["SynchronousStrategy"]


class SynchronousStrategy(Strategy):
    """A strategy whose local replicas run every step together and merge their optimizer steps.

    ``parameter_device``: where parameters live when no replica computes on them (central
    storage); ``bucket_bytes``: the size of the gradient buckets reduced across workers.
    """

    def __init__(
        self,
        devices: Sequence[torch.device | None],
        communicator: Communicator | None = None,
        cluster_resolver: ClusterResolver | None = None,
        device_names: Sequence[str] | None = None,
        *,
        parameter_device: torch.device | None = None,
        bucket_bytes: int = DEFAULT_BYTES_PER_PACK,
    ) -> None:
        super().__init__(devices, communicator, cluster_resolver, device_names)
        self._engine = ReplicaEngine(self, parameter_device=parameter_device, bucket_bytes=bucket_bytes)

    def replica_context(self, local_replica_id: int) -> ReplicaContext:
        """The replica context of local replica ``local_replica_id`` (what ``run`` makes current there)."""
        return self._engine.replica_context(local_replica_id)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        central = self._engine.parameter_device
        return (str(central),) if central is not None else super().parameter_devices

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        return self._engine.run(fn, args, kwargs, options)

    def distribute_module(self, module: torch.nn.Module) -> None:
        self._engine.distribute_module(module)

    def distribute_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._engine.merge_steps_of(optimizer)

    @property
    def gradient_merge(self) -> GradientMerge:
        return self._engine

    def register_comm_hook(self, hook: CommHook) -> None:
        """Reduce gradients across workers through ``hook`` (see :mod:`distrib.comm.hooks`), as DDP's."""
        self._engine.set_comm_hook(hook)

    def step_executor(self) -> StepExecutor:
        """How ``fit`` runs its steps under this strategy: ``strategy.run`` on each global batch."""
        from distrib.strategies.execution import SynchronousExecutor

        return SynchronousExecutor(self)

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> DistributedDataset:
        """Split every global batch of ``dataset`` over all replicas in sync.

        ``dataset`` is any iterable of global batches (a ``DataLoader`` with the global
        batch size, a list of tensors, ...). See :class:`~distrib.input.DistributedDataset`.
        ``options``: TF's ``tf.distribute.InputOptions``, handed to it.
        """
        from distrib.input import DistributedDataset

        return DistributedDataset(dataset, self, options=options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None
    ) -> DistributedDatasetsFromFunction:
        """Call ``dataset_fn(input_context)`` once on this worker; its batches are per-replica batches.

        ``options``: TF's ``tf.distribute.InputOptions``, handed to the distributed dataset.
        """
        from distrib.input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self, options=options)
