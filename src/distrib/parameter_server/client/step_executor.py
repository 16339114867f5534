"""``fit``'s steps under parameter servers: scheduled on whichever worker is free.

Training and evaluation data is read by the workers themselves, as in TF: every
worker builds the data (a dataset, or ``dataset_fn(input_context)``) and cycles
through it, so an epoch is a number of steps, and a step input is the per-worker
iterator. ``predict``'s batches are read here and sent with each step, so that the
outputs come back in order. Results arrive asynchronously; :meth:`completed`
yields them in step order, as the coordinator learns of them, so the loop fires
batch hooks in order too.

A worker's data may end (a dataset function whose iterator is finite): its later
steps read an end marker instead of raising ``StopIteration`` on the worker, run no
function, and :meth:`completed` gives :data:`~distrib.strategies.execution.END_OF_DATA`
for them. The marker is a string on the wire (step results travel as plain values)
and never reaches the loop.
"""

from __future__ import annotations

import inspect
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from distrib.parameter_server.client.dispatch import PerWorkerIterator
from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.datasets import WorkerBatches
from distrib.strategies.execution import END_OF_DATA, StepFn, numbered_batches

if TYPE_CHECKING:
    from distrib.parameter_server.client.coordinator import ClusterCoordinator
    from distrib.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ScheduledExecutor"]

_FINAL = (RemoteValueStatus.READY, RemoteValueStatus.FAILED, RemoteValueStatus.CANCELLED)

#: the label of the empty batches a worker reads once its data has ended, and what such a step returns
_END = "<distrib: end of data>"


class _UntilEnd:
    """A per-worker dataset function: ``data``'s batches, then end markers for ever.

    ``data`` is a dataset (read again from the start when it ends, as ``dataset.repeat()``)
    or a function of the input context returning an iterator (used as it is). Once the
    data has ended, a scheduled step reads an empty batch labelled :data:`_END`.
    """

    def __init__(self, data: Any) -> None:
        self.data = data

    def __call__(self, input_context: Any) -> Iterator[tuple[Any, Any]]:
        data = self.data
        if callable(data) and not hasattr(data, "__iter__"):
            yield from (data(input_context) if _takes_argument(data) else data())
        else:
            for x, y, _ in numbered_batches(data, cycle=True):
                yield x, y
        while True:
            yield torch.zeros(0), _END


def _takes_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` needs a positional argument (``dataset_fn(input_context)`` rather than ``dataset_fn()``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # not inspectable: call it as TF documents, with the context
        return True
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


class ScheduledExecutor:
    """Steps scheduled through a :class:`ClusterCoordinator`; results collected in step order."""

    scheduled = True

    def __init__(self, strategy: ParameterServerStrategy, coordinator: ClusterCoordinator) -> None:
        self._strategy = strategy
        self._coordinator = coordinator
        self._pending: deque[tuple[RemoteValue, bool]] = deque()  # (value, from a per-worker iterator)
        self._iterators: dict[int, PerWorkerIterator] = {}
        self._wrapped: dict[tuple[int, bool], Callable[..., Any]] = {}

    def use_graphs(self, on: bool) -> None:
        """Scheduled steps run on the workers, eagerly: nothing to capture here (``strategy.graph_capture_blocker``)."""

    def feed(
        self, data: Any, *, start: int = 0, steps: int | None = None, cycle: bool = False, per_worker: bool = False
    ) -> Iterable[Any]:
        if not per_worker:
            return itertools.islice(numbered_batches(data, start, cycle), steps)
        if not steps:
            raise ValueError(
                "under ParameterServerStrategy every worker cycles through its own data, so an epoch "
                "is a number of steps: give fit steps_per_epoch (and evaluate steps), as in TF"
            )
        iterator = self._iterators.get(id(data))
        if iterator is None:  # one per-worker iterator per data for this loop: epochs continue where they were
            dataset = self._coordinator.create_per_worker_dataset(WorkerBatches(_UntilEnd(data)))
            iterator = self._iterators[id(data)] = iter(dataset)
        return itertools.repeat(iterator, steps)

    def _step(self, fn: StepFn, from_iterator: bool) -> Callable[..., Any]:
        """The function to schedule for ``fn`` (made once, so it is sent to each worker once)."""
        key = (id(fn), from_iterator)
        wrapped = self._wrapped.get(key)
        if wrapped is None:
            strategy = self._strategy
            if from_iterator:

                def wrapped(iterator: Iterator[tuple[Any, Any, int]]) -> Any:
                    x, y, n = next(iterator)
                    if isinstance(y, str) and y == _END:
                        return _END
                    return strategy.run(fn, args=(x, y, n))
            else:

                def wrapped(x: Any, y: Any, n: int) -> Any:
                    return strategy.run(fn, args=(x, y, n))

            self._wrapped[key] = wrapped
        return wrapped

    def submit(self, fn: StepFn, step_input: Any) -> None:
        from_iterator = isinstance(step_input, PerWorkerIterator)
        args = (step_input,) if from_iterator else step_input
        self._pending.append((self._coordinator.schedule(self._step(fn, from_iterator), args=args), from_iterator))

    def completed(self, wait: bool) -> Iterator[Any]:
        while self._pending and (wait or self._pending[0][0].status in _FINAL):
            value, from_iterator = self._pending.popleft()
            result = value.fetch()  # raises the step's error, as join() would
            yield END_OF_DATA if from_iterator and isinstance(result, str) and result == _END else result
