"""``RemoteValue``: the future result of a scheduled function, with a documented life cycle.

Status transitions, and the only ones allowed (anything else is a bug and raises)::

    PENDING  -> RUNNING    a worker took the function
    RUNNING  -> PENDING    that worker was lost mid-call; the function goes back to the front of the queue
    RUNNING  -> READY      the function returned; fetch() gives its result
    RUNNING  -> FAILED     it raised on the worker, or a parameter server was lost; fetch() raises
    PENDING  -> CANCELLED  an earlier scheduled function failed; fetch() raises ClosureCancelledError
    RUNNING  -> CANCELLED  as above, for a function a worker had taken (sent ahead to its worker, or
                           taken back from a lost one) that had not started there when the error came
    PENDING  -> FAILED     the cluster failed (a ps was lost) before the function ran

READY, FAILED and CANCELLED are final. Because RUNNING can go back to PENDING, a
function may run more than once (at least once, never lost), as in TF.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

__all__ = ["RemoteValue", "RemoteValueStatus"]


class RemoteValueStatus(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


_ALLOWED = {
    RemoteValueStatus.PENDING: {RemoteValueStatus.RUNNING, RemoteValueStatus.CANCELLED, RemoteValueStatus.FAILED},
    RemoteValueStatus.RUNNING: {
        RemoteValueStatus.PENDING,
        RemoteValueStatus.READY,
        RemoteValueStatus.FAILED,
        RemoteValueStatus.CANCELLED,
    },
}
_FINAL = (RemoteValueStatus.READY, RemoteValueStatus.FAILED, RemoteValueStatus.CANCELLED)


class RemoteValue:
    """The result of ``ClusterCoordinator.schedule`` (``tf.distribute.experimental.coordinator.RemoteValue``).

    ``fetch()`` blocks until the function has run and returns its result (tensors
    and Python values as the function returned them), or raises its error. ``status`` says where the
    function is in its life cycle (see the module docstring for the transitions); ``worker`` is the task
    that produced the result and ``attempts`` how many workers took the function. A RemoteValue can be
    passed in a later ``schedule(..., args=...)`` (the worker gets its result), not captured by a function.

    Example::

        >>> rv = RemoteValue()
        >>> rv.transition(RemoteValueStatus.RUNNING)
        >>> rv.transition(RemoteValueStatus.READY, value=3)
        >>> rv.status, rv.fetch()
        (<RemoteValueStatus.READY: 'ready'>, 3)
    """

    __slots__ = ("_status", "_value", "_error", "_done", "_lock", "worker", "attempts")

    def __init__(self) -> None:
        self._status = RemoteValueStatus.PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        #: the task that produced the result (or the last one that tried)
        self.worker: str | None = None
        #: how many times a worker took the function
        self.attempts = 0

    @property
    def status(self) -> RemoteValueStatus:
        """Where the function is: PENDING, RUNNING, READY, FAILED or CANCELLED (the last three are final)."""
        return self._status

    def transition(self, new: RemoteValueStatus, value: Any = None, error: BaseException | None = None) -> None:
        """Move to status ``new`` (with the result ``value`` or the ``error``), if the life cycle allows it.

        Called by the coordinator's :class:`~distrib.parameter_server.client.dispatch_state.ClosureQueue`
        as the function is taken, put back, finished, failed or cancelled; user code only reads
        ``status`` and calls ``fetch``. A transition the module docstring does not list raises
        RuntimeError (a bug in the dispatch, never a silent overwrite of a final result).
        Going to RUNNING counts one more attempt.

        Args:
            new: the status to move to.
            value: the function's result (with ``READY``).
            error: the error ``fetch`` will raise (with ``FAILED`` or ``CANCELLED``).

        Raises:
            RuntimeError: the life cycle does not allow going from the current status to ``new``.
        """
        with self._lock:
            if new not in _ALLOWED.get(self._status, ()):
                raise RuntimeError(f"RemoteValue cannot go from {self._status.name} to {new.name}")
            self._status = new
            if new is RemoteValueStatus.RUNNING:
                self.attempts += 1
            self._value, self._error = value, error
            if new in _FINAL:
                self._done.set()

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's result; blocks until it is known (``get`` is the same, TF's other name).

        Args:
            timeout: the most seconds to wait (a distrib extension); None: as long as it takes.

        Returns:
            What the function returned.

        Raises:
            TimeoutError: ``timeout`` passed before the function finished.
            ScheduledFunctionError: the function raised on its worker (FAILED; also an instance of the
                error's builtin class).
            ClosureCancelledError: the function was cancelled because an earlier one failed.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"the scheduled function has not finished within {timeout}s (status {self._status.name})"
            )
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch

    def __reduce__(self) -> tuple:
        raise TypeError(
            "a RemoteValue cannot be captured by a scheduled function; pass it in args=(...) "
            "(it is fetched first) or fetch() it on the coordinator"
        )

    def __repr__(self) -> str:
        return f"RemoteValue(status={self._status.name}{', worker=' + self.worker if self.worker else ''})"
