"""``fit``'s steps under parameter servers: scheduled on whichever worker is free.

Training and evaluation data is read by the workers themselves, as in TF: every
worker builds the data (a dataset, or ``dataset_fn(input_context)``) and cycles
through it, so an epoch is a number of steps, and a step input is the per-worker
iterator. ``predict``'s batches are read here and sent with each step, so that the
outputs come back in order. Results arrive asynchronously; :meth:`completed`
yields them in step order, as the coordinator learns of them, so the loop fires
batch hooks in order too.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

from distrib.parameter_server.client.dispatch import PerWorkerIterator
from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.datasets import WorkerBatches
from distrib.strategies.execution import StepFn, numbered_batches

if TYPE_CHECKING:
    from distrib.parameter_server.client.coordinator import ClusterCoordinator
    from distrib.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ScheduledExecutor"]

_FINAL = (RemoteValueStatus.READY, RemoteValueStatus.FAILED, RemoteValueStatus.CANCELLED)


class ScheduledExecutor:
    """Steps scheduled through a :class:`ClusterCoordinator`; results collected in step order."""

    def __init__(self, strategy: "ParameterServerStrategy", coordinator: "ClusterCoordinator") -> None:
        self._strategy = strategy
        self._coordinator = coordinator
        self._pending: deque[RemoteValue] = deque()
        self._iterators: dict[int, "PerWorkerIterator"] = {}
        self._wrapped: dict[tuple[int, bool], Callable[..., Any]] = {}

    def feed(self, data: Any, *, start: int = 0, steps: Optional[int] = None, cycle: bool = False,
             per_worker: bool = False) -> Iterable[Any]:
        if not per_worker:
            return itertools.islice(numbered_batches(data, start, cycle), steps)
        if not steps:
            raise ValueError("under ParameterServerStrategy every worker cycles through its own data, so an epoch "
                             "is a number of steps: give fit steps_per_epoch (and evaluate steps), as in TF")
        iterator = self._iterators.get(id(data))
        if iterator is None:  # one per-worker iterator per data for this loop: epochs continue where they were
            dataset = self._coordinator.create_per_worker_dataset(WorkerBatches(data))
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
                    return strategy.run(fn, args=next(iterator))
            else:
                def wrapped(x: Any, y: Any, n: int) -> Any:
                    return strategy.run(fn, args=(x, y, n))
            self._wrapped[key] = wrapped
        return wrapped

    def submit(self, fn: StepFn, step_input: Any) -> None:
        if isinstance(step_input, PerWorkerIterator):
            value = self._coordinator.schedule(self._step(fn, True), args=(step_input,))
        else:
            value = self._coordinator.schedule(self._step(fn, False), args=step_input)
        self._pending.append(value)

    def completed(self, wait: bool) -> Iterator[Any]:
        while self._pending and (wait or self._pending[0].status in _FINAL):
            yield self._pending.popleft().fetch()  # raises the step's error, as join() would
