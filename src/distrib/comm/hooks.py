"""The hook point of gradient reduction, as DDP's ``register_comm_hook``.

Gradients are reduced bucket by bucket: a :class:`GradBucket` holds the flat
gradients of a few parameters, already summed over this worker's replicas. A
*comm hook* is called once per bucket with the communicator and the bucket, starts
reducing it over the workers, and returns a future whose value is the flat tensor
of summed gradients (the bucket's own buffer, or a new tensor of its shape and
dtype). The default, :func:`allreduce_hook`, sums the buffer in place. A hook that
compresses (casts to bf16, low-rank approximates) does its work around the
communicator's collectives; no strategy changes for it.

Example::

    >>> import torch
    >>> from distrib.comm import LocalCommunicator
    >>> bucket = GradBucket(0, torch.ones(3), [torch.zeros(3)])
    >>> allreduce_hook(LocalCommunicator(), bucket).wait()
    tensor([1., 1., 1.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.futures import Future

from distrib.comm.communicator import Communicator

__all__ = ["GradBucket", "CommHook", "allreduce_hook"]


@dataclass(frozen=True)
class GradBucket:
    """One bucket of gradients to reduce over workers.

    ``index``: the bucket's position (buckets are reduced in index order on every
    worker). ``buffer``: the flat gradients of ``parameters``, in order, summed over
    this worker's replicas. A hook may keep state per ``index`` (e.g. error feedback).
    """

    index: int
    buffer: torch.Tensor
    parameters: Sequence[torch.Tensor]


CommHook = Callable[[Communicator, GradBucket], "Future[torch.Tensor]"]


def allreduce_hook(communicator: Communicator, bucket: GradBucket) -> Future[torch.Tensor]:
    """Sum the bucket over all workers, in place (the default hook)."""
    return communicator.all_reduce_async(bucket.buffer)
