"""``OneDeviceStrategy``: one replica on one chosen device."""

from __future__ import annotations

import torch

from distrib.strategies.devices import parse_device
from distrib.strategies.synchronous import SynchronousStrategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(SynchronousStrategy):
    """Everything on one device: modules built in the scope and input batches are placed on it.

    One replica, no reduction and no worker processes: the strategy to develop and debug a training step
    with, or to pin a program to one chosen GPU, that runs unchanged under a multi-replica strategy later
    (TF's ``tf.distribute.OneDeviceStrategy``).

    Args:
        device: the device (``"cpu"``, ``"cuda:1"``, a ``torch.device``; TF's ``"/gpu:0"`` is accepted too).

    Raises:
        ValueError: ``device`` is not a device name, or names a GPU this machine does not have.

    Example::

        >>> import distrib as ds, torch
        >>> strategy = ds.OneDeviceStrategy("cpu")
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(3, 1)
        >>> strategy.run(lambda x: model(x).shape, args=(torch.ones(4, 3),))
        torch.Size([4, 1])
    """

    def __init__(self, device: str | torch.device) -> None:
        super().__init__([parse_device(device)], device_names=[str(device)])
