"""Which strategy is current, and which replica (if any) the calling thread runs.

Two kinds of context, as in ``tf.distribute``:

* the *cross-replica context*: inside ``strategy.scope()`` but outside ``run``;
  ``get_strategy()`` returns the scope's strategy and ``get_replica_context()``
  returns ``None``;
* the *replica context*: inside the function given to ``strategy.run``;
  ``get_replica_context()`` returns the calling replica's :class:`ReplicaContext`.

Outside any scope the default strategy is current, and ``get_replica_context()``
returns its (single) replica context, as TF does.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from distrib.replica import ReplicaContext
    from distrib.strategies.base import Strategy

__all__ = ["get_strategy", "has_strategy", "get_replica_context", "in_cross_replica_context"]

_thread = threading.local()
# Scopes nest per process, not per thread: replica threads must see the scope
# that the user's main thread entered.
_scope_stack: list["Strategy"] = []
_default: Optional["Strategy"] = None
# The latest strategy of this process that spans several workers: checkpoints saved outside
# any scope still write on its chief only.
_cluster: Optional["weakref.ref[Strategy]"] = None


def register_cluster_strategy(strategy: "Strategy") -> None:
    global _cluster
    _cluster = weakref.ref(strategy)


def cluster_strategy() -> Optional["Strategy"]:
    """The latest multi-worker strategy made in this process (alive), or None."""
    return _cluster() if _cluster is not None else None


def current_replica() -> Optional["ReplicaContext"]:
    """The replica context set on this thread by ``strategy.run``, or None."""
    return getattr(_thread, "replica", None)


def set_current_replica(ctx: Optional["ReplicaContext"]) -> Optional["ReplicaContext"]:
    """Set this thread's replica context; returns the previous one (to restore it)."""
    previous = getattr(_thread, "replica", None)
    _thread.replica = ctx
    return previous


def default_strategy() -> "Strategy":
    """The process-wide default strategy: one replica, the current device, no placement."""
    global _default
    if _default is None:
        from distrib.strategies.default import DefaultStrategy

        _default = DefaultStrategy()
    return _default


def get_strategy() -> "Strategy":
    """The current strategy: the replica's, else the innermost scope's, else the default one."""
    ctx = current_replica()
    if ctx is not None:
        return ctx.strategy
    if _scope_stack:
        return _scope_stack[-1]
    return default_strategy()


def has_strategy() -> bool:
    """True inside a non-default strategy's scope or replica function."""
    return get_strategy() is not _default


def in_cross_replica_context() -> bool:
    """True inside a scope and outside ``run``."""
    return current_replica() is None and bool(_scope_stack)


def get_replica_context() -> Optional["ReplicaContext"]:
    """The calling replica's context inside ``run``; None in a cross-replica context.

    Outside every scope this returns the default strategy's replica context, so that
    code written for one device (``ctx.num_replicas_in_sync == 1``) runs unchanged.
    """
    ctx = current_replica()
    if ctx is not None:
        return ctx
    if _scope_stack:
        return None
    return default_strategy()._default_replica_context()


def push_scope(strategy: "Strategy") -> None:
    if _scope_stack and _scope_stack[-1] is not strategy:
        raise RuntimeError(
            f"cannot enter {type(strategy).__name__}.scope() inside the scope of a different "
            f"strategy ({type(_scope_stack[-1]).__name__}); leave that scope first: objects "
            "created under one strategy cannot be distributed by another"
        )
    _scope_stack.append(strategy)


def pop_scope(strategy: "Strategy") -> None:
    if not _scope_stack or _scope_stack[-1] is not strategy:
        raise RuntimeError("strategy scopes were exited out of order")
    _scope_stack.pop()


def scope_depth(strategy: "Strategy") -> int:
    return sum(1 for s in _scope_stack if s is strategy)
