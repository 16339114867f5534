"""Errors of parameter-server training, as the coordinator reports them.

Two families: the cluster's (a peer is unreachable, a call was refused) and the
user's (a scheduled function raised; a function was cancelled because an earlier
one failed). The remote exception itself is never unpickled: the coordinator
receives its type name, message and formatted traceback and raises a
:class:`ScheduledFunctionError` that also derives from the original class when
that is a Python builtin (so ``except ValueError`` still works).
"""

from __future__ import annotations

import builtins

__all__ = [
    "PeerUnavailableError",
    "ParameterServerUnavailableError",
    "WorkerUnavailableError",
    "AuthenticationError",
    "RemoteProtocolError",
    "ScheduledFunctionError",
    "ClosureCancelledError",
    "scheduled_function_error",
]


class PeerUnavailableError(ConnectionError):
    """A task of the cluster could not be reached (dead, restarting, or not started yet)."""

    def __init__(self, address: str, detail: str = "", task: str | None = None) -> None:
        self.address = address
        self.task = task
        where = f"{task} at {address}" if task else address
        super().__init__(f"{where} is unavailable" + (f": {detail}" if detail else ""))


class ParameterServerUnavailableError(PeerUnavailableError):
    """A parameter server is unreachable; its variables (and their updates) are gone.

    Training cannot go on without it: restart the whole cluster and restore the
    latest checkpoint (``ds.CheckpointManager(...).restore_or_initialize()``).
    """

    def __init__(self, address: str, detail: str = "", task: str | None = None) -> None:
        super().__init__(address, detail, task)
        self.args = (
            f"{self.args[0]}. A parameter server holds the only copy of its variables, so training "
            "cannot continue: restart the cluster (every ps and worker task) and restore the latest "
            "checkpoint, e.g. ds.CheckpointManager(checkpoint, dir).restore_or_initialize()",
        )


class WorkerUnavailableError(PeerUnavailableError):
    """A worker is unreachable; the coordinator runs its functions on another worker."""


class AuthenticationError(PermissionError):
    """A peer refused a call: the cluster token was missing or wrong."""


class RemoteProtocolError(RuntimeError):
    """A peer answered with something this version of distrib does not understand."""


class ScheduledFunctionError(RuntimeError):
    """A function scheduled with ``ClusterCoordinator.schedule`` raised on a worker.

    ``remote_type`` is the exception's class name, ``remote_traceback`` the
    formatted traceback from the worker, ``worker`` the task that ran it.
    """

    remote_type: str = ""
    remote_traceback: str = ""
    worker: str = ""


class ClosureCancelledError(RuntimeError):
    """A scheduled function was not run because an earlier scheduled function failed."""


_subclasses: dict[str, type] = {}


def scheduled_function_error(
    remote_type: str, message: str, remote_traceback: str, worker: str
) -> ScheduledFunctionError:
    """A :class:`ScheduledFunctionError` for a remote exception, also an instance of its builtin class."""
    cls: type = ScheduledFunctionError
    base = getattr(builtins, remote_type, None)
    if isinstance(base, type) and issubclass(base, Exception) and base not in (Exception, RuntimeError):
        known = _subclasses.get(remote_type)
        if known is None:
            try:
                known = type(remote_type, (ScheduledFunctionError, base), {"__module__": __name__})
            except TypeError:  # incompatible instance layouts (e.g. OSError): keep the plain class
                known = ScheduledFunctionError
            _subclasses[remote_type] = known
        cls = known
    text = (
        f"scheduled function raised {remote_type} on {worker}: {message}\n\n"
        f"Remote traceback (most recent call last, on {worker}):\n{remote_traceback.rstrip()}"
    )
    try:
        error = cls(text)
    except TypeError:  # a builtin whose constructor needs more arguments (UnicodeDecodeError, ...)
        error = ScheduledFunctionError(text)
    error.remote_type, error.remote_traceback, error.worker = remote_type, remote_traceback, worker
    return error
