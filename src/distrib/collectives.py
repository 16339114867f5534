"""Cross-worker collectives, behind one small interface.

Strategies never call ``torch.distributed`` themselves: each holds a
:class:`Communicator`. A single-process strategy holds :class:`LocalCommunicator`,
for which every collective is the identity; multi-worker strategies hold one
backed by a ``torch.distributed`` process group.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from distrib.values import ReduceOp

__all__ = ["Communicator", "LocalCommunicator"]


class Communicator(Protocol):
    """The collectives a strategy needs across worker processes."""

    @property
    def rank(self) -> int:
        """This worker's index among the workers (0 on the chief's side of the collective)."""
        ...

    @property
    def world_size(self) -> int:
        """How many worker processes take part."""
        ...

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
        """Reduce every tensor in place over all workers (SUM, or MEAN over workers)."""
        ...

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate ``tensor`` from every worker along ``axis``; sizes along ``axis`` may differ."""
        ...

    def barrier(self) -> None:
        """Return once every worker has called it."""
        ...


class LocalCommunicator:
    """The communicator of a single process: one worker, every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None
