"""``strategy.extended``: the parts of TF's ``StrategyExtended`` that ported code uses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from distrib.strategies.reduction import reduce_structure
from distrib.values import ReduceOp, map_leaves, parse_reduce_op

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """TF's ``strategy.extended``, over a distrib strategy.

    ``reduce_to(op, value, destinations)`` reduces ``value`` over every replica of every
    worker and puts the result on ``destinations`` (a device, a tensor whose device to
    use, or None: the first local device). ``should_checkpoint`` / ``should_save_summary``
    are True on the chief only, as TF's multi-worker strategies say.

    Example::

        >>> import distrib as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> v = s.run(lambda: torch.tensor(1.0 + ds.get_replica_context().replica_id_in_sync_group))
        >>> s.extended.reduce_to("sum", v, "cpu")
        tensor(3.)
    """

    def __init__(self, strategy: "Strategy") -> None:
        self._strategy = strategy

    def reduce_to(self, reduce_op: "ReduceOp | str", value: Any, destinations: Any = None, options: Any = None) -> Any:
        """Reduce ``value`` (PerReplica, or any structure of them) to ``destinations``. ``options`` is ignored."""
        self._strategy._refuse_mixing("extended.reduce_to")
        reduced = reduce_structure(self._strategy, parse_reduce_op(reduce_op), value, None)
        device = _device_of(destinations)
        if device is None:
            return reduced
        return map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, reduced)

    def batch_reduce_to(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple[Any, Any]],
                        options: Any = None) -> list[Any]:
        """``reduce_to`` for each ``(value, destinations)`` pair, in order."""
        return [self.reduce_to(reduce_op, value, destinations) for value, destinations in value_destination_pairs]

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices of this process's replicas."""
        return tuple(str(d) if d is not None else "default" for d in self._strategy.local_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where parameters live (every replica's device, or the central one)."""
        return self._strategy.parameter_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (distrib's ``Checkpoint`` writes on the chief anyway)."""
        return self._strategy.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (TensorBoard): the chief."""
        return self._strategy.is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker initialises variables: every worker does (the chief's values are broadcast)."""
        return True


def _device_of(destinations: Any) -> Optional[torch.device]:
    if destinations is None:
        return None
    if isinstance(destinations, torch.Tensor):
        return destinations.device
    if isinstance(destinations, torch.device):
        return destinations
    if isinstance(destinations, str):
        from distrib.strategies.devices import parse_device

        return parse_device(destinations)
    return None  # a PerReplica or a variable: the value stays on the first local device
