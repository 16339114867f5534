"""Launcher signals (issue 10, B.2): SIGTERM and SIGHUP to `distrib launch` (how Slurm, Kubernetes, systemd and
`timeout` stop a job) stop every task; none survives the grace period.

Before: the launcher died and left every task running (10 of 10 tasks survived).
"""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest
from helpers import alive, process_tree, start_launch

# these look at the launcher's own process tree: with a fork server, its own (tests/conftest.py), not the shared one
pytestmark = pytest.mark.usefixtures("own_fork_server")

# the chief of a parameter-server cluster that ignores the polite signals and starts a process of its own:
# the launcher must kill both after its grace period
STUBBORN_CHIEF = textwrap.dedent("""
    import signal, subprocess, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "120"])
    print("ready", flush=True)
    time.sleep(120)
""")


def _one_trial(script: str, sig: int) -> tuple[int, int, int]:
    """(launcher exit code, tasks and their children started, how many are alive after the launcher exited)."""
    proc = start_launch("--workers", "2", "--ps", "1", script)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        lines = []
        while not any("[chief 0] ready" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        _wait_for_servers(proc.pid, expected=5, deadline=deadline)
        started = process_tree(proc.pid)
        proc.send_signal(sig)
        proc.communicate(timeout=120)
        return proc.returncode, len(started), len(alive(started))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _wait_for_servers(launcher: int, expected: int, deadline: float) -> None:
    """Until the launcher's tree holds the 4 tasks and the chief's child."""
    while len(process_tree(launcher)) < expected:
        assert time.monotonic() < deadline, "the cluster did not start"
        time.sleep(0.1)


def _signals(tmp_path, trials: int) -> None:
    script = tmp_path / "stubborn_chief.py"
    script.write_text(STUBBORN_CHIEF)
    for sig, expected in ((signal.SIGTERM, 143), (signal.SIGHUP, 129)):
        codes, started, survivors = [], 0, 0
        for _ in range(trials):
            code, n, alive = _one_trial(str(script), sig)
            codes.append(code)
            started += n
            survivors += alive
        print(
            f"FAULT {signal.Signals(sig).name} to distrib launch (--workers 2 --ps 1, a chief ignoring it): "
            f"{trials} trial(s), {started} processes started, {survivors} alive after the grace period, exit codes "
            f"{sorted(set(codes))} (before: 10 of 10 tasks survived)"
        )
        assert survivors == 0 and set(codes) == {expected}


def test_launcher_signals_leave_no_task_running(tmp_path):
    _signals(tmp_path, 1)


@pytest.mark.faults_full
def test_launcher_signals_leave_no_task_running_5_times(tmp_path):
    _signals(tmp_path, 5)
