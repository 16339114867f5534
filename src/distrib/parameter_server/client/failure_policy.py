"""Deciding what a failure means for a scheduled function: run it again elsewhere, or raise.

The coordinator classifies every failure into a :class:`FailureKind` and asks the
policy; it never branches on exception types itself. TF's behaviour is the default:

* a worker lost (unreachable, killed mid-call): retry on another worker, however
  many times it takes (``max_attempts=None``); the lost worker is probed and used
  again when it answers;
* the function raised: raise (from ``join``/``fetch``), cancel what has not run yet;
* a parameter server lost: raise, and the coordinator stays failed (its variables
  are gone): the cluster must be restarted and restored from a checkpoint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["FailureKind", "Decision", "FailurePolicy"]


class FailureKind(enum.Enum):
    WORKER_LOST = "worker_lost"
    FUNCTION_ERROR = "function_error"
    PS_LOST = "ps_lost"
    PROTOCOL = "protocol"  # refused token, incompatible peer, unsendable arguments


class Decision(enum.Enum):
    RETRY = "retry"  # put the function back in the queue for any worker
    RAISE = "raise"  # fail the function; cancel the ones not started; join() raises
    RAISE_FATAL = "raise_fatal"  # as RAISE, and every later schedule/join raises too


@dataclass(frozen=True)
class FailurePolicy:
    """What the coordinator does when a scheduled function fails: retry it on another worker, or raise.

    Give it to ``ClusterCoordinator(strategy, failure_policy=...)``; the default is TF's behaviour (see the
    module docstring): a function whose worker was lost runs again elsewhere, however many times it takes.

    Attributes:
        max_attempts: how many workers may take one function before a lost worker fails it (its RemoteValue
            FAILED, ``join`` raises); None: no limit.

    Raises:
        ValueError: ``max_attempts`` is neither a positive int nor None.

    Example::

        >>> FailurePolicy().decide(FailureKind.WORKER_LOST, attempts=3)
        <Decision.RETRY: 'retry'>
        >>> FailurePolicy(max_attempts=2).decide(FailureKind.WORKER_LOST, attempts=2)
        <Decision.RAISE: 'raise'>
    """

    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"FailurePolicy(max_attempts={self.max_attempts!r}): must be a positive int or None")

    def decide(self, kind: FailureKind, attempts: int) -> Decision:
        """What to do after a failure of ``kind`` on the function's ``attempts``-th run.

        Args:
            kind: what failed: the worker was lost, the function raised, a ps task was lost, or a protocol
                error (a refused token, an incompatible peer, arguments that cannot be sent).
            attempts: how many workers have taken the function so far, this failed run included.

        Returns:
            ``Decision.RETRY`` for a lost worker while ``attempts < max_attempts`` (always without a limit);
            ``Decision.RAISE_FATAL`` for a lost ps task (every later ``schedule``/``join`` raises too); else
            ``Decision.RAISE``.
        """
        if kind is FailureKind.WORKER_LOST:
            if self.max_attempts is None or attempts < self.max_attempts:
                return Decision.RETRY
            return Decision.RAISE
        if kind is FailureKind.PS_LOST:
            return Decision.RAISE_FATAL
        return Decision.RAISE
