"""``CentralStorageStrategy``: parameters on one device, computation mirrored over the local devices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distrib.strategies.devices import local_devices, parse_device
from distrib.strategies.synchronous import SynchronousStrategy

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(SynchronousStrategy):
    """Synchronous training with the parameters in one place (``tf.distribute.experimental.CentralStorageStrategy``).

    Parameters (and optimizer state) live on ``parameter_device``; every local replica
    computes on a copy of its own on its compute device, refreshed from the central
    parameters after every update. ``optimizer.step()`` sums every replica's gradients
    into the central parameters and updates them once. As TF: the compute devices
    default to every local GPU (or the CPU), and the parameter device to the CPU when
    there are several compute devices, else to the one compute device.

    Args:
        compute_devices: one replica per device (``["cuda:0", "cuda:1"]``, ``["cpu:0", "cpu:1"]``); None: every
            local GPU, else one CPU replica.
        parameter_device: where the parameters and optimizer state live; None: the CPU with several compute
            devices, else the one compute device.

    Raises:
        ValueError: ``compute_devices`` is empty, or a device is unknown or absent on this machine.

    Example::

        >>> import distrib as ds, torch
        >>> strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu")
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(2, 1)
        >>> strategy.parameter_devices, strategy.num_replicas_in_sync
        (('cpu',), 2)
    """

    def __init__(
        self,
        compute_devices: Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
    ) -> None:
        names = [str(n) for n in compute_devices] if compute_devices is not None else local_devices()
        if not names:
            raise ValueError("CentralStorageStrategy(compute_devices=[]) needs at least one device, e.g. ['cpu:0']")
        parsed = [parse_device(n) for n in names]
        if parameter_device is not None:
            central = parse_device(parameter_device)
        else:
            central = parsed[0] if len(parsed) == 1 else torch.device("cpu")
        super().__init__(parsed, device_names=names, parameter_device=central)
