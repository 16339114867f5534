"""Per-worker datasets: what every worker builds and reads itself under parameter servers.

* :class:`DatasetSource`: what ``strategy.experimental_distribute_dataset`` and
  ``distribute_datasets_from_function`` return under ``ParameterServerStrategy``;
  give it to ``coordinator.create_per_worker_dataset``;
* :func:`call_dataset_fn`: how a worker calls a dataset function (with or without the
  input context);
* :class:`WorkerBatches`: ``fit``'s per-worker dataset, ``(x, y, batch_size)`` for ever.
"""

from __future__ import annotations

import inspect
import multiprocessing
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from distrib.input import InputContext
from distrib.strategies.execution import numbered_batches, split_xy

__all__ = ["DatasetSource", "WorkerBatches", "call_dataset_fn", "warn_if_forked_loader"]


class DatasetSource:
    """A dataset to build on every worker: from ``experimental_distribute_dataset`` or
    ``distribute_datasets_from_function``; pass it to ``coordinator.create_per_worker_dataset``.

    Iterating it directly (on the coordinator) gives the batches as they are.
    """

    def __init__(self, dataset: Any = None, dataset_fn: Callable[[InputContext], Any] | None = None) -> None:
        self._dataset = dataset
        self._dataset_fn = dataset_fn

    def build(self, context: InputContext) -> Iterable[Any]:
        """The dataset of the worker described by ``context``."""
        return call_dataset_fn(self._dataset_fn, context) if self._dataset_fn is not None else self._dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.build(InputContext()))


def call_dataset_fn(dataset_fn: Any, context: InputContext) -> Any:
    """``dataset_fn(context)``, or ``dataset_fn()`` when it takes no argument; a dataset is returned as it is.

    A :class:`DatasetSource` (given, or returned by the function, as TF's tutorial's
    ``per_worker_dataset_fn`` returns ``strategy.distribute_datasets_from_function(dataset_fn)``)
    is built with the same worker's context.
    """
    if isinstance(dataset_fn, DatasetSource):
        return dataset_fn.build(context)
    if not callable(dataset_fn) or hasattr(dataset_fn, "__iter__"):
        return dataset_fn
    try:
        params = [
            p
            for p in inspect.signature(dataset_fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    dataset = dataset_fn(context) if params else dataset_fn()
    if isinstance(dataset, DatasetSource):  # the function returned strategy.distribute_datasets_from_function(...)
        return dataset.build(context)
    warn_if_forked_loader(dataset)
    return dataset


def warn_if_forked_loader(dataset: Any) -> None:
    """Warn when ``dataset`` is a ``DataLoader`` that will fork its worker processes: under parameter servers
    every process runs gRPC threads, and a child forked while they hold gRPC's locks aborts ("DataLoader worker
    ... is killed by signal: Aborted", seen with num_workers=2 on an in-process cluster)."""
    from torch.utils.data import DataLoader

    if not isinstance(dataset, DataLoader) or dataset.num_workers == 0:
        return
    context = dataset.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method(allow_none=True)
    if method in (None, "fork"):
        warnings.warn(
            "a per-worker DataLoader with num_workers > 0 forks its worker processes from a process running gRPC "
            "(a parameter-server task), and a forked child can abort on gRPC's locks: pass "
            "multiprocessing_context='forkserver' (or 'spawn'), with a dataset importable on the workers, or "
            "num_workers=0",
            stacklevel=3,
        )


class WorkerBatches:
    """A per-worker dataset function: ``(x, y, batch_size)`` for ever, from ``data`` built on the worker.

    ``data`` is a dataset (cycled through) or a function of the input context that
    returns an iterator (used as it is: it decides when to repeat).
    """

    def __init__(self, data: Any) -> None:
        self.data = data

    def __call__(self, context: InputContext) -> Iterator[tuple[Any, Any, int]]:
        if callable(self.data) and not hasattr(self.data, "__iter__"):
            for batch in call_dataset_fn(self.data, context):
                x, y = split_xy(batch)
                yield x, y, len(x)
        else:
            warn_if_forked_loader(self.data)
            yield from numbered_batches(self.data, cycle=True)
