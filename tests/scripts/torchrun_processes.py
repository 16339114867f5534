"""Process bookkeeping for the torchrun and resize tests (imported by them; not a script to run).

torchrun starts each worker in a session of its own, so killing torchrun's process group does
not reach them, and a worker whose agent was killed is re-parented away from the test. A
:class:`Job` therefore records, while it runs, every process started under it (with its start
time, so a reused pid is never killed), and :meth:`Job.kill` ends each of them by its id.

A shared fork server (:mod:`distrib.cluster.shared_forkserver`, which the test session's launches use) is not
one of them: the launch that finds none for its import environment starts it as its own child, and it is meant to
outlive that launch (serving the later ones until the session stops it). Counting it made a launch "leave a
process behind" whenever it happened to be the one to start it (the first of a session or of a changed source
tree, or the first after the server's idle exit on a loaded machine), and killing it cost the next launch a new one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

# tracked processes: pid -> start time (field 22 of /proc/<pid>/stat)
Tracked = dict[int, int]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, start time)`` of a live process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def alive(tracked: Tracked) -> Tracked:
    """Those of ``tracked`` still running (the same process: same start time; zombies count as gone)."""
    out = {}
    for pid, start in tracked.items():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == start:
            out[pid] = start
    return out


#: the command line of a shared fork server and of its sessions (forks of it): processes that outlive a launch
SHARED_FORK_SERVER = b"distrib.cluster.shared_forkserver"


def _is_shared_fork_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return SHARED_FORK_SERVER in f.read()
    except OSError:
        return False


def descendants(roots: Tracked) -> Tracked:
    """Every live process whose parent chain reaches one of ``roots``, short of a shared fork server (and so of
    what it forks: a shared server's tasks are never the launcher's descendants, whoever started the server)."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z" and not _is_shared_fork_server(int(entry)):
                table[int(entry)] = (stat[1], stat[2])
    found: Tracked = {}
    frontier = set(alive(roots))
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier and pid not in found}
        found.update({pid: table[pid][1] for pid in frontier})
    return found


class Job:
    """A command started in its own session, output to ``log``, every process under it tracked."""

    def __init__(
        self, cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: str | Path | None = None
    ) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd
        )
        stat = _stat(self.proc.pid)
        self.tracked: Tracked = {self.proc.pid: stat[2]} if stat else {}

    def track(self) -> None:
        self.tracked.update(descendants(self.tracked))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> bool:
        """Whether ``text`` appears in the output within ``timeout`` seconds (False too if the job ended first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.track()
            if text in self.output():
                return True
            if self.proc.poll() is not None:
                return text in self.output()
            time.sleep(0.1)
        return False

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if the job still runs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.track()
            code = self.proc.poll()
            if code is not None:
                return code
            time.sleep(0.1)
        return None

    def kill(self) -> Tracked:
        """SIGKILL every tracked process still running (by its id, after checking its start time); what was left."""
        self.track()
        left = alive(self.tracked)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while alive(left) and time.monotonic() < deadline:  # SIGKILL is delivered, not instant
            time.sleep(0.05)
        try:
            self.proc.wait(timeout=10)
        finally:
            self._out.close()
        return left


def run_job(
    cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> tuple[int | None, str, Tracked]:
    """Run ``cmd`` to its end (at most ``timeout`` s): ``(exit code or None on timeout, output, processes left)``.

    Every process it started is killed in any case; ``processes left`` lists those that were
    still running when it ended (none for a job that cleans up after itself).
    """
    job = Job(cmd, log, env, cwd)
    try:
        code = job.wait(timeout)
        time.sleep(0.3 if code is not None else 0)  # a worker the agent is still reaping
    finally:
        left = job.kill()
    return code, job.output(), left


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any cluster's variables (and without torch's workaround for pytorch#135712)."""
    drop = (
        "TF_CONFIG",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "DISTRIB_RESTART",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(extra)
    return env
