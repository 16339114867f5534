"""What a worker's step raised, told to the other workers through the cluster's store.

When the user's code raises inside ``strategy.run`` on one worker, that worker's user sees the
error itself; the other workers are left waiting in a collective for a worker that will not come
(it exits, or goes on after catching the error), and their collective fails when its connection
closes or the timeout passes. Without more, such a worker can only say that a peer died or did not
answer. So the worker that raised writes one line, ``"worker 1 raised ValueError: ..."``, into the
store every worker joined through, before its error goes on up; a worker whose collective then fails
reads the lines of the others and names them in its ``CollectiveError`` instead of blaming the
network. A later step that runs withdraws the line, so a failure long after is not blamed on an
error the user caught and got past.

The store lives in worker 0's process. When worker 0 is the one that raised and its error ends the
process, its store ends with it, at the moment the others' collectives fail (gloo's connections stay
open until the process ends: leaving the group does not close them). Such a worker can then only say
that worker 0 is gone, and point to its output.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from distrib.comm.rendezvous import _listening

__all__ = ["StepErrorBoard", "describe"]

log = logging.getLogger("distrib.comm")

#: how long reading or writing the store may take while a worker reports (a store that is gone fails sooner)
STORE_SECONDS = 2.0
_RAISED = "distrib/raised"


def describe(error: BaseException, limit: int = 300) -> str:
    """``"ValueError: the first line of its message"``, at most ``limit`` characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StepErrorBoard:
    """The lines the workers' steps raised, in the store they joined through (one key per worker).

    Args:
        store: the cluster's ``torch.distributed`` store (worker 0 hosts it).
        rank: this worker's index.
        world_size: the number of workers.
        timeout: the store's own timeout (seconds), given back after each use of the board.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self._store, self._rank, self._world_size = store, rank, world_size
        self._timeout = datetime.timedelta(seconds=timeout)
        self._reported = False  # True while this worker's line is in the store

    @property
    def reported(self) -> bool:
        """Whether this worker's step raised and its line is in the store."""
        return self._reported

    def report(self, line: str) -> None:
        """Write this worker's line (``"worker R raised ..."``); a store that cannot be reached is left alone."""
        if self._call(lambda: self._store.set(f"{_RAISED}/{self._rank}", line)):
            self._reported = True

    def withdraw(self) -> None:
        """This worker's step ran: its earlier line no longer explains a failure."""
        if self._reported and self._call(lambda: self._store.delete_key(f"{_RAISED}/{self._rank}")):
            self._reported = False

    def others(self) -> list[str] | None:
        """The lines the other workers reported; None where the store cannot be reached (worker 0 is gone)."""
        if self._rank != 0 and not self._store_answers():
            return None
        keys = [f"{_RAISED}/{r}" for r in range(self._world_size) if r != self._rank]
        lines: list[str] = []

        def read() -> None:
            for key in keys:
                if self._store.check([key]):
                    lines.append(self._store.get(key).decode(errors="replace"))

        return lines if self._call(read) else None

    def _store_answers(self) -> bool:
        """Whether worker 0's store still listens, asked quietly (a store client that finds it gone logs a C++
        stack). Twice, 0.2 s apart: when worker 0's process ends, the collective's connections to it may close a
        moment before its store does."""
        host, port = getattr(self._store, "host", None), getattr(self._store, "port", None)
        if host is None or port is None:
            return True  # a store of another kind: asked directly
        if not _listening(host, port):
            return False
        time.sleep(0.2)
        return _listening(host, port)

    def explain(self, what: str, error: BaseException) -> str | None:
        """Why ``what`` failed on this worker, where the store tells: the lines of the workers whose steps raised,
        or that worker 0 is gone with its store; None where it does not (a peer died, hung, or was cut off)."""
        raised = self.others()
        where = f"{what} across {self._world_size} workers failed on worker {self._rank}"
        if raised:
            return (
                f"{where} because {'; '.join(raised)} in its step and left the collective ({describe(error, 160)}). "
                "The error is that worker's: see its traceback"
            )
        if raised is None and self._rank != 0:
            return (
                f"{where}: {describe(error, 160)}. Worker 0 is gone (the store it hosts no longer answers): its "
                "output says why (its step's error, if its step raised)"
            )
        return None

    def _call(self, fn: Any) -> bool:
        """``fn()`` against the store with a short timeout; False where the store failed (a peer gone, ...)."""
        try:
            self._store.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
            try:
                fn()
            finally:
                self._store.set_timeout(self._timeout)
            return True
        except Exception as e:  # noqa: BLE001 - the store is only a courtesy here: a dead one changes nothing
            log.debug("the store could not be used to report a step's error: %s", e)
            return False
