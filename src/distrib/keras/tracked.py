"""What ``fit``, ``evaluate`` and the custom loop track: the loss and the metrics, merged from each step's deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distrib import metrics as metrics_lib
from distrib.keras.callback_base import Logs
from distrib.losses import LossLike
from distrib.strategies.base import Strategy

__all__ = ["TrackedValues", "takes_logits"]


class TrackedValues:
    """The loss and the metrics of one loop: steps return deltas, merged here in step order.

    Metric objects the user built outside the scope are tied to the loop's strategy, so
    that their result covers every worker too.
    """

    def __init__(self, strategy: Strategy, metrics: Sequence[Any], loss: LossLike | None = None) -> None:
        self.strategy = strategy
        threshold = 0.0 if takes_logits(loss) else 0.5  # binary accuracy of logits: positive means class 1
        with strategy.scope():
            self.loss = metrics_lib.Mean(name="loss")
            self.metrics = [metrics_lib.get(m, binary_threshold=threshold) for m in metrics]
        for m in self.metrics:
            m.set_strategy(strategy)

    @property
    def all(self) -> list[metrics_lib.Metric]:
        return [self.loss, *self.metrics]

    def deltas(self, per_example: torch.Tensor, y: Any, pred: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """What one replica's step adds to every tracked value (computed on the replica, or on a worker)."""
        return [self.loss.deltas(per_example)] + [m.deltas(y, pred) for m in self.metrics]

    def merge(self, result: Any) -> None:
        """Add a step's deltas (its ``strategy.run`` result) from every local replica."""
        for replica_deltas in self.strategy.experimental_local_results(result):
            for metric, d in zip(self.all, replica_deltas):
                metric.merge_deltas(d)

    def reset(self) -> None:
        for m in self.all:
            m.reset_state()

    def logs(self, prefix: str = "", synced: bool = True) -> Logs:
        """Every value by name; ``synced=False`` is this worker's view, without a collective (per-step display)."""
        return {prefix + m.name: float(m.result() if synced else m.local_result()) for m in self.all}


def takes_logits(loss: Any) -> bool:
    """Whether ``loss`` scores binary logits (distrib's ``"binary_crossentropy"``, ``BCEWithLogitsLoss``)."""
    if isinstance(loss, str):
        return loss.lower() == "binary_crossentropy"
    return isinstance(loss, torch.nn.BCEWithLogitsLoss)
