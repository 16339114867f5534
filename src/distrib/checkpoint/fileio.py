"""Atomic file writes that turn every operating-system failure into a :class:`CheckpointError`.

A file is written to a ``.tmp-<host>-<pid>-<random>`` file beside its final name, flushed,
fsync'ed and renamed over the final name, so a reader sees the old file or the new one,
never half of one. A crash leaves only the temporary file, which the next save removes
(:func:`remove_stale_temp_files`). A failing write (a full disk, a quota, an I/O error) is a
:class:`CheckpointError` naming the file and the cause; the previous file is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

from distrib.checkpoint.errors import CheckpointError

__all__ = ["TEMP_PREFIX", "atomic_write", "remove_stale_temp_files", "describe_os_error"]

TEMP_PREFIX = ".tmp-"


def describe_os_error(e: BaseException) -> str:
    """``"No space left on device (ENOSPC)"``-style text for an OSError, else ``str(e)``."""
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{e.strerror or os.strerror(e.errno)} ({name})"
    return f"{type(e).__name__}: {e}"


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "host"


class _Sink:
    """A file object that remembers the OSError of a failed ``write``.

    ``torch.save`` reports a failed write of its zip writer as a bare ``RuntimeError``
    (``[enforce fail at inline_container.cc]``); the remembered OSError names the real cause.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._file.write(data))
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as e:
            self.error = e
            raise


def atomic_write(final: str, write: Callable[[Any], None]) -> None:
    """Write ``final`` through ``write(fileobj)``: all of it, or nothing (the old file stays).

    Raises :class:`CheckpointError` naming ``final`` and the cause when the system refuses
    (no space, no permission, I/O error). Other exceptions from ``write`` propagate unchanged.
    """
    directory = os.path.dirname(final) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{_host()}-{os.getpid()}-", dir=directory)
    except OSError as e:
        raise CheckpointError(
            f"Cannot write checkpoint file {final!r}: creating a file in {directory!r} failed: {describe_os_error(e)}"
        ) from e
    sink: _Sink | None = None
    try:
        with os.fdopen(fd, "wb") as f:
            sink = _Sink(f)
            write(sink)
            sink.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        cause = sink.error if sink is not None and sink.error is not None else e
        if isinstance(e, Exception) and isinstance(cause, OSError):
            raise CheckpointError(
                f"Writing checkpoint file {final!r} failed: {describe_os_error(cause)}. "
                "Nothing was replaced: the previous checkpoint is intact."
            ) from cause
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX only)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _in_use(name: str) -> bool:
    """Whether the temporary file ``name`` may belong to a write still running (on this host)."""
    host, _, pid = name[len(TEMP_PREFIX) :].rpartition("-")[0].rpartition("-")  # .tmp-<host>-<pid>-<random>
    if host != _host() or not pid.isdigit():
        return False  # a crash leftover of an older distrib, or of a chief on another host that is gone
    if int(pid) == os.getpid():
        return True  # this process writes one file at a time; a concurrent thread's is not ours to remove
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(directory: str) -> list[str]:
    """Remove the ``.tmp-*`` files a crashed save left in ``directory``; return their names.

    Files of a write that may still be running on this host (a live process id) are kept.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.startswith(TEMP_PREFIX) and not _in_use(name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
                removed.append(name)
    return removed
