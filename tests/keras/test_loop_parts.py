"""The loop's parts that know no strategy: the one owner lookup and the one step driver."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import distrib as ds
from distrib import context
from distrib.keras.loop import _drive
from distrib.strategies.execution import END_OF_DATA


def test_strategy_of_finds_the_owner_of_a_wrapped_module_before_the_scope_and_the_default():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        inner = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    wrapper = torch.nn.Sequential(inner)  # built outside the scope, as a compiled or wrapping module is
    assert context.strategy_of(wrapper) is strategy and context.strategy_of(torch.ones(1), optimizer) is strategy
    plain = torch.nn.Linear(2, 1)
    assert context.strategy_of(plain) is ds.get_strategy()  # nobody's: the default (no multi-worker strategy here)
    other = ds.MirroredStrategy(["cpu:0"])
    with other.scope():
        assert context.strategy_of(plain) is other and context.strategy_of(wrapper) is strategy


class _Scheduled:
    """An executor whose steps complete later, and whose data ends after ``ends_after`` steps."""

    scheduled = True

    def __init__(self, ends_after: int) -> None:
        self.ends_after, self.submitted = ends_after, 0
        self.pending: deque[Any] = deque()

    def feed(
        self, data: Any, *, start: int = 0, steps: int | None = None, cycle: bool = False, per_worker: bool = False
    ) -> Iterable[Any]:
        return range(steps or 100)

    def submit(self, fn: Any, step_input: Any) -> None:
        self.submitted += 1
        self.pending.append(END_OF_DATA if self.submitted > self.ends_after else fn(step_input, None, 1))

    def completed(self, wait: bool) -> Iterator[Any]:
        while self.pending and (wait or len(self.pending) > 1):  # one step stays in flight until the end
            yield self.pending.popleft()


def test_the_driver_stops_at_the_typed_end_of_data_and_settles_what_is_in_flight():
    executor = _Scheduled(ends_after=3)
    begun: list[int] = []
    done: list[Any] = []
    driven = _drive(
        executor, executor.feed(None, steps=10), lambda x, y, n: x * 10, first=5, begin=begun.append, done=done.append
    )
    assert done == [0, 10, 20] and driven.ran == 3 and driven.ended  # the end is not a result handed to done
    assert begun == [5, 6, 7, 8, 9] and driven.submitted == executor.submitted == 5  # stopped once the end settled


def test_the_driver_stops_when_asked_after_a_step():
    executor = _Scheduled(ends_after=100)
    done: list[Any] = []
    driven = _drive(
        executor,
        executor.feed(None, steps=10),
        lambda x, y, n: x,
        begin=lambda i: None,
        done=done.append,
        stop=lambda: len(done) >= 2,
    )
    assert done == [0, 1, 2] and driven.submitted == 3 and not driven.ended  # the step in flight still settles
