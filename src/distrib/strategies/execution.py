"""How a high-level loop (``ds.fit``) executes its steps under a strategy.

``fit``, ``evaluate`` and ``predict`` are written once; what differs between
strategies is only *where* a step runs, behind :class:`StepExecutor`:

* :class:`SynchronousExecutor` (every synchronous strategy): each global batch is
  split over the replicas and the step runs at once, in place or on every local
  replica, through ``strategy.run``;
* under parameter servers the step is *scheduled* on whichever worker is free, and
  its result is known later (``distrib.parameter_server.client.step_executor``).

A step function is called as ``fn(x, y, global_batch_size)`` on each replica and
returns a value; :meth:`StepExecutor.completed` yields each step's ``strategy.run``
result, in step order, as soon as it is known, or :data:`END_OF_DATA` for a step
that found its data ended (where workers read their own data, the loop learns of
the end from a step's result, not from its own iterator). The loop asks the
executor, never the strategy's class, how it runs.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from distrib.input.positions import numbered_batches, split_xy  # re-exported: the executors' data positions

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["StepExecutor", "SynchronousExecutor", "StepFn", "EndOfData", "END_OF_DATA", "numbered_batches", "split_xy"]

StepFn = Callable[[Any, Any, int], Any]


class EndOfData:
    """What :meth:`StepExecutor.completed` yields for a step that ran no function: its data had ended.

    A type of its own, so that no value a step function returns can be mistaken for it.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "END_OF_DATA"


#: the one :class:`EndOfData`
END_OF_DATA = EndOfData()


class StepExecutor(Protocol):
    """Runs the steps of a loop: feed it data, submit a step per input, collect results in order."""

    #: True where steps are scheduled on other processes and complete later (Keras' ``verbose="auto"`` then
    #: shows one line per epoch rather than a bar, as tf.keras does under parameter servers)
    scheduled: bool

    def feed(
        self, data: Any, *, start: int = 0, steps: int | None = None, cycle: bool = False, per_worker: bool = False
    ) -> Iterable[Any]:
        """The step inputs for ``steps`` steps of ``data`` (None: one pass), from global position ``start``.

        ``data`` yields batches ``x``, ``(x,)`` or ``(x, y, ...)``. With ``cycle`` the data is
        read again from the start when it ends. ``per_worker``: every worker may read
        the data itself (parameter servers); ignored by synchronous strategies.
        """
        ...

    def submit(self, fn: StepFn, step_input: Any) -> None:
        """Run (or schedule) one step of ``fn`` on ``step_input``."""
        ...

    def completed(self, wait: bool) -> Iterator[Any]:
        """Results of submitted steps, in submission order: all of them if ``wait``, else those known now.

        A step that found its data ended gives :data:`END_OF_DATA` instead of a result.
        """
        ...

    def use_graphs(self, on: bool) -> None:
        """Run each step as ``ds.function`` runs a step (captured once per signature, then replayed), or not:
        ``fit(jit_compile=...)``, Keras' name. An executor whose steps cannot be captured ignores it."""
        ...


class SynchronousExecutor:
    """Steps of a synchronous strategy: each global batch split over the replicas, run at once.

    The data is read here, so its end is the end of :meth:`feed`'s inputs: no step gives
    :data:`END_OF_DATA`.
    """

    scheduled = False

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._results: deque[Any] = deque()
        self._step: Callable[[StepFn, Any], Any] = self.fit_step

    def fit_step(self, fn: StepFn, step_input: Any) -> Any:
        """One step: ``fn`` on the replicas with ``step_input`` (``(x, y, global batch size)``)."""
        return self._strategy.run(fn, args=step_input)

    def use_graphs(self, on: bool) -> None:
        from distrib.graphs import function

        self._step = function(self.fit_step) if on else self.fit_step

    def feed(
        self, data: Any, *, start: int = 0, steps: int | None = None, cycle: bool = False, per_worker: bool = False
    ) -> Iterable[Any]:
        from distrib.input import DistributedDataset

        # a DataLoader over a map-style dataset is auto-sharded, and a resumed fit skips to `start` in its batch
        # sampler (the skipped batches are drawn, never loaded); other data is read whole and split as before
        batches = DistributedDataset(data, self._strategy).numbered_batches(start, cycle)
        return itertools.islice(batches, steps)

    def submit(self, fn: StepFn, step_input: Any) -> None:
        self._results.append(self._step(fn, step_input))

    def completed(self, wait: bool) -> Iterator[Any]:
        while self._results:
            yield self._results.popleft()
