"""The one seam between a strategy and the other worker processes.

Strategies, metrics, input pipelines and checkpoints never call
``torch.distributed``: they hold a :class:`Communicator`. A single-process
strategy holds :class:`LocalCommunicator`, for which every collective is the
identity (one worker); multi-worker strategies hold a
:class:`~distrib.comm.process_group.ProcessGroupCommunicator`. A new transport
(another backend, a simulator for tests) is a new class with these members.

Every reduction is a SUM: distrib's users scale losses by the global batch, so
nothing divides by the number of workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch.futures import Future

__all__ = ["CollectiveError", "Communicator", "LocalCommunicator", "completed_future", "describe_tensors"]

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective across workers failed: a peer died, hung past the timeout, left it after its step raised, or
    the rendezvous failed. An error of the user's code inside ``strategy.run`` is never one: it is raised as
    itself."""


@runtime_checkable
class Communicator(Protocol):
    """The collectives a strategy needs across worker processes (in place where a tensor is given).

    Every worker must call the same collectives in the same order. Errors are
    :class:`CollectiveError` naming the worker and the operation.
    """

    @property
    def rank(self) -> int:
        """This worker's index among the workers (0 is the chief's side of the collective)."""
        ...

    @property
    def world_size(self) -> int:
        """How many worker processes take part."""
        ...

    @property
    def backend(self) -> str | None:
        """torch.distributed's backend of the collectives (``"gloo"``, ``"nccl"``), or None without a process group."""
        ...

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum every tensor in place over all workers."""
        ...

    def all_reduce_async(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        """Start summing ``tensor`` in place; the future's value is ``tensor`` once summed."""
        ...

    def wait(self, future: Future[Any]) -> Any:
        """The value of a future returned by this communicator (or chained from one)."""
        ...

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate ``tensor`` from every worker along ``axis``; sizes along ``axis`` may differ."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every worker's ``obj`` (picklable), in rank order."""
        ...

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every worker with worker ``src``'s values."""
        ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Worker ``src``'s ``obj`` (picklable), on every worker."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over workers and return this worker's equal slice of dim 0.

        ``tensor.shape[0]`` must be divisible by ``world_size``.
        """
        ...

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every worker has called it (``timeout`` seconds at most; None: the default)."""
        ...

    def verify_same(self, signature: str, what: str) -> None:
        """Check that every worker passes the same ``signature`` (e.g. shapes and dtypes) before a collective.

        Raises :class:`CollectiveError` on every worker, naming what each worker has, when
        they differ: a collective over mismatched tensors would otherwise abort a process
        or return garbage.
        """
        ...

    def guarded(self, what: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """``fn()``, whose collectives torch issues itself (FSDP's, inside forward and backward; DCP's while a
        sharded checkpoint is written): a peer that died or hung becomes a :class:`CollectiveError` naming
        ``what``, as this communicator's own calls do. ``timeout``: seconds each of those collectives may wait,
        for this call only (a checkpoint's own, longer bound); None: the communicator's timeout. An error of the
        other code in ``fn`` (the user's, in a step) is raised as itself, not as a CollectiveError."""
        ...

    def report_step_error(self, error: BaseException | None) -> None:
        """Tell the other workers that this worker's step raised ``error`` (the user's own error, raised as
        itself here), so that their collectives, which then fail waiting for this worker, name it; None: this
        worker's step ran, and an earlier report no longer explains a failure."""
        ...


def completed_future(value: Any) -> Future[Any]:
    """A future that already holds ``value``."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class LocalCommunicator:
    """The communicator of a single process: one worker, every collective is the identity.

    Example::

        >>> comm = LocalCommunicator()
        >>> t = torch.ones(2)
        >>> comm.all_reduce([t]); t
        tensor([1., 1.])
        >>> comm.all_gather_object("only me")
        ['only me']
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def backend(self) -> str | None:
        return None

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        return None

    def all_reduce_async(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return completed_future(tensor)

    def wait(self, future: Future[Any]) -> Any:
        return future.wait()

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        return None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self, timeout: float | None = None) -> None:
        return None

    def verify_same(self, signature: str, what: str) -> None:
        return None

    def guarded(self, what: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        return fn()

    def report_step_error(self, error: BaseException | None) -> None:
        return None

    def __repr__(self) -> str:
        return "LocalCommunicator()"


def describe_tensors(tensors: Sequence[torch.Tensor], skip_dim: int | None = None) -> str:
    """A signature of tensors for :meth:`Communicator.verify_same`: dtypes and shapes (``skip_dim`` left out).

    Example::

        >>> describe_tensors([torch.zeros(2, 3), torch.ones(4, dtype=torch.int64)], skip_dim=0)
        'float32[*, 3], int64[*]'
    """
    parts = []
    for t in tensors:
        dims = ["*" if i == skip_dim else str(d) for i, d in enumerate(t.shape)]
        parts.append(f"{str(t.dtype).removeprefix('torch.')}[{', '.join(dims)}]")
    return ", ".join(parts)
