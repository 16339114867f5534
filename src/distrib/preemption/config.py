"""``TerminationConfig``: what counts as a termination notice, how to exit, and how long there is (TF's class).

TF's defaults on a platform other than Borg or GCP, which distrib keeps: the notice is
SIGTERM, the exit is ``sys.exit(42)`` (42, :data:`PREEMPTION_EXIT_CODE`, is the code
``distrib launch`` restarts without counting it against ``--max-restarts``), and the
checkpoint is saved at the first step every worker can agree on.

distrib's additions, keyword-only: ``signals`` (Slurm's ``--signal=USR1@120`` sends
SIGUSR1 ahead of the time limit) and ``exit_code`` (what the default ``exit_fn`` and the
deadline's forced exit use). ``grace_period`` is, as in TF, the time from the notice to
the kill; distrib uses it as a bound: a worker that has not saved and exited by then (a
peer hung, a save too slow) exits anyway a little before the kill, with ``exit_code``,
leaving the last good checkpoint (saves are atomic). TF also trains on during a long grace
period and saves again near its end; distrib saves at once (docs/migration.md).
"""

from __future__ import annotations

import os
import signal as signal_module
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DEFAULT_GRACE_PERIOD", "GRACE_ENV", "PREEMPTION_EXIT_CODE", "TerminationConfig", "exit_deadline"]

#: TF's exit code after a preemption checkpoint on platforms other than GCP ("an arbitrary code", 42)
PREEMPTION_EXIT_CODE = 42
#: set by ``distrib launch`` for its tasks: how long it waits after forwarding a signal before it kills
GRACE_ENV = "DISTRIB_GRACE_SECONDS"
#: the grace period when neither the config nor the launcher gives one: Kubernetes' and Slurm's default (30 s)
DEFAULT_GRACE_PERIOD = 30.0

_UNCATCHABLE = {signal_module.SIGKILL, signal_module.SIGSTOP}


def _signals(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return (int(signal_module.SIGTERM),)
    items = (value,) if isinstance(value, int) else tuple(value)
    if not items:
        raise ValueError(
            "TerminationConfig(signals=()): give at least one signal, e.g. signal.SIGTERM, or a termination_watcher_fn"
        )
    out = []
    for sig in items:
        if not isinstance(sig, int) or isinstance(sig, bool):
            raise TypeError(f"TerminationConfig(signals=...): {sig!r} is not a signal number (e.g. signal.SIGUSR1)")
        if sig in _UNCATCHABLE:
            raise ValueError(
                f"TerminationConfig(signals=...): {signal_module.Signals(sig).name} cannot be caught; "
                "use SIGTERM, or the signal your scheduler sends ahead of the kill (Slurm: "
                "--signal=USR1@120 and signals=signal.SIGUSR1)"
            )
        out.append(int(sig))
    return tuple(out)


class TerminationConfig:
    """How a :class:`~distrib.preemption.PreemptionCheckpointHandler` learns of, and answers, a termination notice.

    TF's defaults, which distrib keeps (see the module docstring): the notice is SIGTERM, the exit is
    ``sys.exit(42)``. ``signals`` and ``exit_code`` are distrib's additions, keyword-only.

    Args:
        termination_watcher_fn: called about once a second, returns True once a notice is there (a cloud
            metadata query, a file); when given, no signal handler is installed.
        exit_fn: called after the checkpoint is saved; None: ``sys.exit(exit_code)``.
        grace_period: seconds from the notice to the kill; the handler exits before it whatever happens.
            None (or 0): ``$DISTRIB_GRACE_SECONDS``, which ``distrib launch`` sets, else 30.
        save_fn: called on every worker instead of ``CheckpointManager.save()`` to save, with the arguments
            given to ``save_checkpoint_if_preempted``.
        signals: the notice's signal(s) (Slurm's ``--signal=USR1@120`` sends SIGUSR1 ahead of the time
            limit); None: SIGTERM.
        exit_code: what the default ``exit_fn`` and the deadline's forced exit use (42: ``distrib launch``
            restarts without counting it against ``--max-restarts``).

    Raises:
        TypeError: ``termination_watcher_fn``, ``exit_fn`` or ``save_fn`` is not callable, or a signal is not
            a signal number.
        ValueError: ``grace_period`` is negative, ``exit_code`` is not in 1..255, ``signals`` is empty or
            names SIGKILL or SIGSTOP (which cannot be caught).

    Example::

        >>> import signal
        >>> config = TerminationConfig(grace_period=120, signals=signal.SIGUSR1)
        >>> config.signals == (signal.SIGUSR1,), config.exit_code, config.deadline_seconds()
        (True, 42, 118.0)
    """

    def __init__(
        self,
        termination_watcher_fn: Callable[[], bool] | None = None,
        exit_fn: Callable[[], Any] | None = None,
        grace_period: float | None = None,
        save_fn: Callable[..., Any] | None = None,
        *,
        signals: int | Iterable[int] | None = None,
        exit_code: int = PREEMPTION_EXIT_CODE,
    ) -> None:
        if termination_watcher_fn is not None and not callable(termination_watcher_fn):
            raise TypeError(
                f"termination_watcher_fn must be callable (returning True on a notice), got {termination_watcher_fn!r}"
            )
        if exit_fn is not None and not callable(exit_fn):
            raise TypeError(f"exit_fn must be callable, e.g. lambda: sys.exit(42), got {exit_fn!r}")
        if save_fn is not None and not callable(save_fn):
            raise TypeError(f"save_fn must be callable, got {save_fn!r}")
        if grace_period is not None and not (isinstance(grace_period, (int, float)) and grace_period >= 0):
            raise ValueError(f"grace_period={grace_period!r}: give the seconds from the notice to the kill (>= 0)")
        if not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
            raise ValueError(
                f"exit_code={exit_code!r}: give a process exit code from 1 to 255 (0 would read as a "
                "finished job, which no launcher restarts)"
            )
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn if exit_fn is not None else (lambda: sys.exit(exit_code))
        self.grace_period = grace_period
        self.save_fn = save_fn
        self.signals = _signals(signals)
        self.exit_code = exit_code

    def grace_seconds(self) -> float:
        """The grace period in force, read now.

        Returns:
            The config's ``grace_period`` if positive, else ``$DISTRIB_GRACE_SECONDS`` if positive, else 30 (s).

        Raises:
            ValueError: ``$DISTRIB_GRACE_SECONDS`` is not a number.
        """
        if self.grace_period:
            return float(self.grace_period)
        given = os.environ.get(GRACE_ENV)
        if given:
            try:
                value = float(given)
            except ValueError:
                raise ValueError(f"${GRACE_ENV}={given!r} is not a number of seconds") from None
            if value > 0:
                return value
        return DEFAULT_GRACE_PERIOD

    def deadline_seconds(self) -> float:
        """When the handler gives up on the save (a hung peer, a save too slow) and exits anyway.

        Returns:
            Seconds after the notice: :meth:`grace_seconds` less a margin of 20 %, at most 2 s, for the exit
            itself (:func:`exit_deadline`).

        Raises:
            ValueError: ``$DISTRIB_GRACE_SECONDS`` is not a number.
        """
        return exit_deadline(self.grace_seconds())

    def __repr__(self) -> str:
        names = ", ".join(signal_module.Signals(s).name for s in self.signals)
        return (
            f"TerminationConfig(grace_period={self.grace_period!r}, signals=({names}), "
            f"exit_code={self.exit_code}, watcher={'yes' if self.termination_watcher_fn else 'no'})"
        )


def exit_deadline(grace: float) -> float:
    """When to give up on the save: ``grace`` less a margin of 20 % (at most 2 s) for the exit itself.

    >>> exit_deadline(30.0), exit_deadline(5.0), exit_deadline(1.0)
    (28.0, 4.0, 0.8)
    """
    return grace - min(2.0, 0.2 * grace)
