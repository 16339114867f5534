"""Which strategy is current, which replica the calling thread runs, and who owns an object.

Two kinds of context, as in ``tf.distribute``:

* the *cross-replica context*: inside ``strategy.scope()`` but outside ``run``;
  ``get_strategy()`` returns the scope's strategy and ``get_replica_context()``
  returns ``None``;
* the *replica context*: inside the function given to ``strategy.run``;
  ``get_replica_context()`` returns the calling replica's ``ReplicaContext``.

Outside any scope the default strategy is current, and ``get_replica_context()``
returns its (single) replica context, as TF does.

Ownership: a strategy that distributes a module or an optimizer records itself as
the object's owner in a weak-key registry (:func:`set_owner` / :func:`owner_of`), so
that checkpoints, ``fit`` and metrics find the strategy of an object without any
attribute being set on it; :func:`strategy_of` is the one lookup they use.

This module imports no strategy: the strategies package installs the default
strategy (:func:`install_default`) when it is imported, which ``import distrib``
always does first.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy
    from distrib.strategies.replica import ReplicaContext

__all__ = [
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "get_cross_replica_context",
    "in_cross_replica_context",
    "strategy_of",
]

_thread = threading.local()
# Scopes nest per process, not per thread: replica threads must see the scope
# that the user's main thread entered.
_scope_stack: list[Strategy] = []
_default: tuple[Strategy, ReplicaContext] | None = None
_default_factory: Callable[[], tuple[Strategy, ReplicaContext]] | None = None
# The latest strategy of this process that spans several workers: checkpoints saved outside
# any scope still write on its chief only.
_cluster: weakref.ref[Strategy] | None = None
_owners: weakref.WeakKeyDictionary[Any, Strategy] = weakref.WeakKeyDictionary()


def install_default(factory: Callable[[], tuple[Strategy, ReplicaContext]]) -> None:
    """Tell this module how to make the default strategy and its replica context (done once, by strategies)."""
    global _default_factory
    _default_factory = factory


def _default_pair() -> tuple[Strategy, ReplicaContext]:
    global _default
    if _default is None:
        if _default_factory is None:  # the strategies install it when imported: a part used before them
            import importlib

            importlib.import_module("distrib.strategies")
        if _default_factory is None:  # pragma: no cover
            raise RuntimeError("distrib.strategies did not install the default strategy")
        _default = _default_factory()
    return _default


def default_strategy() -> Strategy:
    """The process-wide default strategy: one replica, the current device, no placement."""
    return _default_pair()[0]


def set_owner(obj: Any, strategy: Strategy) -> None:
    """Record that ``strategy`` distributes ``obj`` (a module, an optimizer)."""
    _owners[obj] = strategy


def owner_of(obj: Any) -> Strategy | None:
    """The strategy that distributes ``obj``, or None."""
    try:
        return _owners.get(obj)
    except TypeError:  # not weak-referenceable (a plain tensor subclass, a dict): nobody owns it
        return None


def strategy_of(*objects: Any) -> Strategy:
    """The strategy in charge of ``objects`` (modules, optimizers, tensors, ...): the one lookup of the package.

    In order: the strategy that distributes one of them, or a module inside one (a compiled
    or wrapping module); else the current strategy, if it is not the default (inside a scope
    or a replica function); else the latest multi-worker strategy of this process (a
    checkpoint saved, or ``fit`` called, outside the scope, as the tutorials do, still
    belongs to the cluster: the chief alone writes, and an optimizer built outside the
    scope is an error naming the fix rather than a worker training alone); else the default.
    """
    owner = distributor_of(*objects)
    if owner is not None:
        return owner
    if has_strategy():
        return get_strategy()
    return cluster_strategy() or get_strategy()


def distributor_of(*objects: Any) -> Strategy | None:
    """The strategy that distributes one of ``objects`` (or a module inside one), or None: their state is then
    whole and plain, whatever strategy the process runs."""
    import torch

    for obj in objects:
        for part in obj.modules() if isinstance(obj, torch.nn.Module) else (obj,):
            owner = owner_of(part)
            if owner is not None:
                return owner
    return None


def register_cluster_strategy(strategy: Strategy) -> None:
    """Remember ``strategy`` as this process's multi-worker strategy (weakly)."""
    global _cluster
    _cluster = weakref.ref(strategy)


def cluster_strategy() -> Strategy | None:
    """The latest multi-worker strategy made in this process (alive), or None."""
    return _cluster() if _cluster is not None else None


#: who wants to know which strategies ``run`` steps (``ds.function`` while it warms up a step); empty otherwise
run_observers: list[Callable[[Strategy], None]] = []


def note_run(strategy: Strategy) -> None:
    """``strategy.run`` was called: tell the observers (``Strategy.run`` calls this only when there are some)."""
    for observe in list(run_observers):
        observe(strategy)


def current_replica() -> ReplicaContext | None:
    """The replica context set on this thread by ``strategy.run``, or None."""
    return getattr(_thread, "replica", None)


def set_current_replica(ctx: ReplicaContext | None) -> ReplicaContext | None:
    """Set this thread's replica context; returns the previous one (to restore it)."""
    previous = getattr(_thread, "replica", None)
    _thread.replica = ctx
    return previous


def current_scope() -> Strategy | None:
    """The strategy of the innermost open ``scope()``, or None (always None on a detached thread)."""
    if not _scope_stack or getattr(_thread, "detached", False):
        return None
    return _scope_stack[-1]


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Run the block on this thread as if no scope were open.

    For threads that serve other processes (a parameter server of an in-process
    cluster): objects they build must not be captured by the scope the user's
    thread has open.
    """
    previous = getattr(_thread, "detached", False)
    _thread.detached = True
    try:
        yield
    finally:
        _thread.detached = previous


def get_strategy() -> Strategy:
    """The current strategy: the replica's, else the innermost scope's, else the default one.

    Returns:
        The current strategy (the default one outside any scope).
    """
    ctx = current_replica()
    if ctx is not None:
        return ctx.strategy
    return current_scope() or default_strategy()


def has_strategy() -> bool:
    """True inside a non-default strategy's scope or replica function.

    Returns:
        True inside a non-default strategy's ``scope()`` or replica function.
    """
    return get_strategy() is not default_strategy()


def in_cross_replica_context() -> bool:
    """True inside a scope and outside ``run``.

    Returns:
        True inside a ``scope()`` and outside ``run``.
    """
    return current_replica() is None and current_scope() is not None


def get_cross_replica_context() -> Strategy | None:
    """The current strategy in a cross-replica context (inside a scope, outside ``run``); None otherwise.

    As TF: exactly one of ``get_replica_context()`` and ``get_cross_replica_context()`` is
    None in any block; outside every scope the default replica context is current, so
    this returns None there.

    Returns:
        The current strategy in a cross-replica context, else None.
    """
    if current_replica() is not None:
        return None
    return current_scope()


def get_replica_context() -> ReplicaContext | None:
    """The calling replica's context inside ``run``; None in a cross-replica context.

    Outside every scope this returns the default strategy's replica context, so that
    code written for one device (``ctx.num_replicas_in_sync == 1``) runs unchanged.

    Returns:
        The current ``ReplicaContext``, the default strategy's outside any scope, None in a cross-replica context.
    """
    ctx = current_replica()
    if ctx is not None:
        return ctx
    if current_scope() is not None:
        return None
    return _default_pair()[1]


_default_scopes = [0]  # open scopes of the default strategy: they change nothing but forbid other scopes


@contextlib.contextmanager
def default_scope() -> Iterator[None]:
    """The default strategy's scope: still the default state (TF), but another strategy's scope may not open in it."""
    _default_scopes[0] += 1
    try:
        yield
    finally:
        _default_scopes[0] -= 1


def push_scope(strategy: Strategy) -> None:
    """Enter ``strategy``'s scope; nested scopes must be of the same strategy."""
    if _default_scopes[0] and strategy is not default_strategy():
        raise RuntimeError(
            f"Mixing different strategies: cannot enter {type(strategy).__name__}.scope() inside the default "
            "strategy's scope; leave that scope first"
        )
    if _scope_stack and _scope_stack[-1] is not strategy:
        raise RuntimeError(
            f"Mixing different strategies: cannot enter {type(strategy).__name__}.scope() inside the scope of "
            f"a different strategy ({type(_scope_stack[-1]).__name__}); leave that scope first: objects "
            "created under one strategy cannot be distributed by another"
        )
    _scope_stack.append(strategy)


def pop_scope(strategy: Strategy) -> None:
    """Leave ``strategy``'s scope (the innermost one)."""
    if not _scope_stack or _scope_stack[-1] is not strategy:
        raise RuntimeError("strategy scopes were exited out of order")
    _scope_stack.pop()


def refuse_mixing(strategy: Strategy, api: str) -> None:
    """TF's rule: a strategy's cross-replica API is not called inside another strategy's scope."""
    scope = current_scope()
    if scope is not None and scope is not strategy:
        raise RuntimeError(
            f"Mixing different strategies: {type(strategy).__name__}.{api} was called inside the "
            f"scope of {type(scope).__name__}; call it outside that scope, or use that strategy"
        )
