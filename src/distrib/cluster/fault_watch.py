"""``distrib launch --fault-tolerant``: the store the workers agree through, and what the launcher tells it.

The launcher hosts a ``torch.distributed`` ``TCPStore`` on the launch's host (loopback by default) for
as long as it runs, so that no worker's death, the chief's included, takes the store with it; every
task finds it in ``DISTRIB_FAULT_TOLERANT_STORE``. The launcher sees a task die at once, and reads a
stopped one's state in ``/proc``: it writes ``dead/ID`` (with the exit code) and ``stopped/ID`` (removed
when the task runs again) there, so that the survivors need not wait their whole timeout for a peer
that cannot answer (:mod:`distrib.comm.membership`). ``ID`` is the task's rank among the script tasks.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FaultWatch", "process_stopped"]


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): ``T`` or ``t`` in ``/proc/PID/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


class FaultWatch:
    """The launcher's store for fault-tolerant workers, and the deaths and stops it records there.

    Example::

        >>> watch = FaultWatch("127.0.0.1")
        >>> watch.address.startswith("127.0.0.1:")
        True
        >>> watch.close()
    """

    def __init__(self, host: str) -> None:
        import torch.distributed as dist  # only a fault-tolerant launch pays for importing torch here

        self._store: Any = dist.TCPStore(
            host, 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False, multi_tenant=False
        )
        self.address = f"{host}:{self._store.port}"
        self._dead: set[int] = set()
        self._stopped: set[int] = set()

    def look(self, pids: Sequence[int | None], codes: Sequence[int | None]) -> list[int]:
        """Record the script tasks' state (``pids[i]``, ``codes[i]``: task ``i``'s pid and exit code, None while it
        runs); returns the ids that died since the last look."""
        from distrib.comm.membership import store_key

        died = []
        for i, (pid, code) in enumerate(zip(pids, codes)):
            if code is not None:
                if i not in self._dead:
                    self._dead.add(i)
                    self._store.set(store_key("dead", i), str(code))
                    died.append(i)
                continue
            stopped = pid is not None and process_stopped(pid)
            if stopped and i not in self._stopped:
                self._stopped.add(i)
                self._store.set(store_key("stopped", i), "1")
            elif not stopped and i in self._stopped:
                self._stopped.discard(i)
                self._store.delete_key(store_key("stopped", i))
        return died

    def verdict(self, tasks: Sequence[Any], say: Callable[[str], None]) -> tuple[bool, int, str] | None:
        """One look at the launch's script ``tasks`` (each with ``poll()``, ``proc`` and ``name``): record their
        state and say which died; None while any runs, else ``(ok, exit_code, who)``: ok when one finished (exit
        0), else the first failure's code (128 + signal for a signal) and task."""
        codes = [t.poll() for t in tasks]
        for i in self.look([t.proc.pid if t.proc is not None else None for t in tasks], codes):
            if codes[i] != 0:
                say(f"{tasks[i].name} exited with code {_exit_code(codes[i])}: the others go on")
        if any(c is None for c in codes):
            return None
        failed = [(t, c) for t, c in zip(tasks, codes) if c != 0]
        if len(failed) < len(tasks):
            return True, 0, ""
        return False, _exit_code(failed[0][1]) or 1, failed[0][0].name

    def close(self) -> None:
        """Stop hosting the store."""
        self._store = None


def _exit_code(returncode: int | None) -> int:
    """A process's exit code as a shell shows it: 128 + N for a death by signal N."""
    code = returncode or 0
    return 128 - code if code < 0 else code
