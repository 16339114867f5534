"""The hook point of gradient reduction, as DDP's ``register_comm_hook``.

Gradients are reduced bucket by bucket: a :class:`GradBucket` holds the flat
gradients of a few parameters, already summed over this worker's replicas. A
*comm hook* is called once per bucket with the communicator and the bucket, starts
reducing it over the workers, and returns a future whose value is the flat tensor
of summed gradients (the bucket's own buffer, or a new tensor of its shape and
dtype). The default, :func:`allreduce_hook`, sums the buffer in place. A hook that
compresses (casts to bf16, low-rank approximates) does its work around the
communicator's collectives; no strategy changes for it. The compressing hooks
(:mod:`distrib.comm.compression`, :mod:`distrib.comm.powersgd`) are chosen with
``CommunicationOptions(compression=...)``.

Whatever a hook sends, its result must be (an approximation of) the SUM of the
bucket over the workers: distrib's losses are scaled by the global batch, so
nothing divides by the number of workers.

A hook whose work continues after its first collective returns a
:class:`DeferredFuture`: the rest runs, on the waiting thread, when the reducer
waits for the bucket (after every bucket has been launched), so the training
thread does all compression work itself and later buckets are launched first.

Example::

    >>> import torch
    >>> from distrib.comm import LocalCommunicator
    >>> bucket = GradBucket(0, torch.ones(3), [torch.zeros(3)])
    >>> allreduce_hook(LocalCommunicator(), bucket).wait()
    tensor([1., 1., 1.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.futures import Future

from distrib.comm.communicator import Communicator

__all__ = ["GradBucket", "CommHook", "DeferredFuture", "allreduce_hook"]

T = TypeVar("T")


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


class DeferredFuture(Future[T]):
    """A future whose value is computed by ``finish()`` on the first thread that waits for it.

    A comm hook returns one when part of its work (waiting for an all-reduce,
    decompressing, a second collective) must happen after the hook returns, but
    should run on the training thread rather than on a communication thread (as a
    ``then`` callback would). ``wait()`` runs ``finish`` once and keeps its value or
    its error; ``done()`` is False until then. Only ``wait()`` runs it: a
    communicator's ``wait`` and the gradient reducer call nothing else.

    Example::

        >>> future = DeferredFuture(lambda: torch.ones(2) * 3)
        >>> future.done(), future.wait(), future.done()
        (False, tensor([3., 3.]), True)
    """

    def __init__(self, finish: Callable[[], T]) -> None:
        super().__init__()
        self._finish: Callable[[], T] | None = finish

    def wait(self) -> T:
        finish, self._finish = self._finish, None
        if finish is not None:
            try:
                value = finish()
            except BaseException as error:
                self.set_exception(error)  # type: ignore[arg-type]  # torch types it as T
                raise
            self.set_result(value)
        return super().wait()
