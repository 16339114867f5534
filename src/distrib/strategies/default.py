"""The default strategy: what ``ds.get_strategy()`` returns outside every scope."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from distrib import context
from distrib.strategies.base import ReusableScope, Strategy
from distrib.strategies.replica import ReplicaContext
from distrib.strategies.synchronous import SynchronousStrategy

__all__ = ["DefaultStrategy"]


class DefaultStrategy(SynchronousStrategy):
    """``run`` calls ``fn`` once, in place: one replica, no placement, no communication.

    Nothing is moved to a device and batches are passed on as they are, so a loop
    written against the strategy API costs nothing when no strategy is chosen.

    Example::

        >>> import distrib as ds
        >>> ds.get_strategy().num_replicas_in_sync
        1
    """

    def __init__(self) -> None:
        super().__init__([None], device_names=["default"])

    def distribute_module(self, module: torch.nn.Module) -> None:
        """Modules stay as they are: the default strategy places nothing."""
        return None

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """As TF: entering the default strategy's scope changes nothing (still the default replica context)."""
        return ReusableScope(self._default_scope)

    @contextlib.contextmanager
    def _default_scope(self) -> Iterator[Strategy]:
        """As TF: entering the default strategy's scope changes nothing (still the default replica context)."""
        current = context.current_scope()
        if current is not None and current is not self:
            raise RuntimeError(
                f"Mixing different strategies: cannot enter the default strategy's scope inside "
                f"the scope of {type(current).__name__}; leave that scope first"
            )
        with context.default_scope():
            yield self


def _make_default() -> tuple[DefaultStrategy, ReplicaContext]:
    strategy = DefaultStrategy()
    return strategy, strategy.replica_context(0)


context.install_default(_make_default)
