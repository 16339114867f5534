"""``MirroredStrategy``: synchronous training on several replicas of one process."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distrib.strategies.devices import local_devices, parse_device
from distrib.strategies.synchronous import SynchronousStrategy

__all__ = ["MirroredStrategy", "CrossDeviceOps", "NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice"]


class CrossDeviceOps:
    """TF's ``tf.distribute.CrossDeviceOps``: how local replicas are reduced. Accepted, and ignored, by
    ``MirroredStrategy(cross_device_ops=...)``: distrib sums local replicas on the first device and
    reduces across workers through its communicator (see ``CommunicationOptions`` and comm hooks)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ignored by distrib)"


class NcclAllReduce(CrossDeviceOps):
    """``tf.distribute.NcclAllReduce(num_packs=1)``; accepted and ignored (see :class:`CrossDeviceOps`)."""


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """``tf.distribute.HierarchicalCopyAllReduce(num_packs=1)``; accepted and ignored (see :class:`CrossDeviceOps`)."""


class ReductionToOneDevice(CrossDeviceOps):
    """``tf.distribute.ReductionToOneDevice(...)``; accepted and ignored (see :class:`CrossDeviceOps`)."""


class MirroredStrategy(SynchronousStrategy):
    """One replica per local device; gradients are summed over replicas at every step.

    ``MirroredStrategy()`` uses every local GPU, or the CPU when there is none.
    ``MirroredStrategy(["cpu:0", "cpu:1"])`` makes two *logical* replicas on the CPU,
    which is how multi-replica code is tested without GPUs. ``cross_device_ops`` is
    accepted for TF compatibility and ignored (see docs/migration.md).

    Args:
        devices: one replica per device, in order (``["cuda:0", "cuda:1"]``; ``"cpu:N"`` is a logical replica
            on the CPU); None: every local GPU, else one CPU replica.
        cross_device_ops: TF's ``CrossDeviceOps`` (``NcclAllReduce()``, ...): accepted and ignored, local
            replicas are summed on the first device.

    Raises:
        ValueError: ``devices`` is empty, names a device twice, or names one that is unknown or absent.

    Example::

        >>> import distrib as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(4, 1)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def step(x, y):
        ...     loss = ds.compute_average_loss((model(x) - y).pow(2).sum(1))
        ...     loss.backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     return loss
        >>> batches = strategy.experimental_distribute_dataset([(torch.ones(8, 4), torch.zeros(8, 1))])
        >>> for x, y in batches:
        ...     per_replica = strategy.run(step, args=(x, y))
        >>> strategy.num_replicas_in_sync
        2
    """

    def __init__(self, devices: Sequence[str | torch.device] | None = None, cross_device_ops: object = None) -> None:
        # cross_device_ops (TF's NcclAllReduce, HierarchicalCopyAllReduce, ...) is accepted and ignored:
        # local replicas are summed in place on the first device, and workers talk through the communicator.
        names = list(devices) if devices is not None else local_devices()
        if not names:
            raise ValueError("MirroredStrategy(devices=[]) needs at least one device, e.g. ['cpu:0', 'cpu:1']")
        if len(set(map(str, names))) != len(names):
            raise ValueError(
                f"MirroredStrategy got duplicate devices {names}; name each replica once, e.g. ['cpu:0', 'cpu:1']"
            )
        super().__init__([parse_device(n) for n in names], device_names=[str(n) for n in names])
