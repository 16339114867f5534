"""The default strategy and ``OneDeviceStrategy``: one replica, no communication."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from distrib.strategies.base import Strategy
from distrib.strategies.devices import parse_device

__all__ = ["DefaultStrategy", "OneDeviceStrategy"]


class DefaultStrategy(Strategy):
    """What ``ds.get_strategy()`` returns outside every scope: ``run`` calls ``fn`` once, in place.

    Nothing is moved to a device and datasets are returned as they are, so a loop
    written against the strategy API costs nothing when no strategy is chosen.
    """

    def __init__(self) -> None:
        super().__init__([None], device_names=["default"])

    def _distribute_module(self, module: torch.nn.Module) -> None:
        return None

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Iterable[Any]:
        return dataset


class OneDeviceStrategy(Strategy):
    """Everything on one device: modules built in the scope and input batches are placed on it.

    Example::

        >>> import distrib as ds, torch
        >>> strategy = ds.OneDeviceStrategy("cpu")
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(3, 1)
        >>> strategy.run(lambda x: model(x).shape, args=(torch.ones(4, 3),))
        torch.Size([4, 1])
    """

    def __init__(self, device: "str | torch.device") -> None:
        super().__init__([parse_device(device)], device_names=[str(device)])
