"""Helpers shared by the tests: run `distrib launch` bounded in time, compare parameters."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"
#: what a timing test in the README's suite allows past a user's timeout: it must hold on a loaded 2-core machine
#: (load ~8 and more; the worst excess measured at load 17 was 0.3 s, docs/multi-node.md's timeout table); the
#: target, timeout + 1 s, is the fault suite's (tests/faults/test_timeouts.py)
LOADED_SLACK = 5.0


def run_bounded(
    cmd: list[str],
    timeout: float = 120,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group, stdout and stderr together; kill the whole group if it
    overruns (the test fails, showing the output) and, in any case, when it ends.

    A ``python SCRIPT ...`` that uses torch, or a ``python -m distrib.MODULE ...``, is forked from the test
    session's shared fork server (tests/conftest.py; as this session's launches start their tasks) instead of importing
    torch afresh: about 2.5 CPU-seconds less each. ``fresh=True`` (or ``DISTRIB_TEST_OWN_FORK_SERVERS=1``) starts a new
    interpreter: for what must be seen from one (what importing does, a parent's signals)."""
    if not fresh:
        server = _session_server(cmd, cwd, env)
        forked = None if server is None else _run_forked(server, cmd, timeout, cwd, env)
        if forked is not None:
            return forked
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=cwd, env=env
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{out}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing it started may outlive the test
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - start


def _session_server(cmd: list[str], cwd: str | Path | None, env: dict[str, str] | None) -> Any:
    """A session of the test process's shared fork server for ``cmd``, or None where it is to start fresh."""
    from distrib.cluster.forkserver import forkable
    from distrib.cluster.shared_forkserver import DIRECTORY_VARIABLE, session

    directory = os.environ.get(DIRECTORY_VARIABLE)
    if not directory or os.environ.get("DISTRIB_TEST_OWN_FORK_SERVERS") == "1":
        return None
    if not forkable(cmd, None if cwd is None else str(cwd)) or cmd[1:4] == ["-m", "distrib.app.cli", "launch"]:
        return None  # a launcher imports no torch: forked, it would only add a session's round trip
    if cmd[1] == "-m" and not cmd[2].startswith("distrib."):
        return None  # another program run as a module (torchrun's agent): the real one, as its users start it
    try:
        return session(directory, dict(os.environ if env is None else env))
    except OSError:
        return None  # started fresh, as a launch whose shared server cannot start does


def _run_forked(
    server: Any, cmd: list[str], timeout: float, cwd: str | Path | None, env: dict[str, str] | None
) -> tuple[int, str, float] | None:
    """:func:`run_bounded` for a task of ``server`` (a :class:`~distrib.cluster.forkserver.ForkServer` session);
    None where the server could not fork it (then it starts fresh, as a launch's task would)."""
    import threading

    start = time.monotonic()
    try:
        proc = server.start(cmd, dict(os.environ if env is None else env), None if cwd is None else str(cwd))
    except RuntimeError:
        return None
    finally:
        server.close()  # the task goes on: its exit code comes through its relay
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        reader.join(timeout)  # the output's end: the task and all it started are gone (as communicate() waits)
        if reader.is_alive():
            os.killpg(proc.pid, signal.SIGKILL)
            reader.join(10)
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{b''.join(chunks).decode(errors='replace')}")
        code = proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing it started may outlive the test
        except ProcessLookupError:
            pass
        proc.stdout.close()
    return code, b"".join(chunks).decode(errors="replace"), time.monotonic() - start


def launch(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run `distrib launch ARGS` bounded in time (see :func:`run_bounded`)."""
    return run_bounded([sys.executable, "-m", "distrib.app.cli", "launch", *args], timeout=timeout)


def start_launch(*args: str) -> subprocess.Popen[str]:
    """Start `distrib launch ARGS` in its own session, its output (text, stdout and stderr together) in
    ``stdout``: for a test that acts while it runs (a signal, a kill); the test stops its group when done."""
    return subprocess.Popen(
        [sys.executable, "-m", "distrib.app.cli", "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def assert_params_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def process_tree(root: int) -> set[int]:
    """Every live descendant of ``root`` (from /proc: children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":  # a zombie is already dead
                parents[int(entry)] = int(fields[1])
    tree, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - tree
        tree |= frontier
    return tree


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (not gone, not zombies)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(pid)
        except OSError:
            pass
    return out


@contextlib.contextmanager
def in_process_coordinator(num_workers: int, num_ps: int) -> Iterator[Any]:
    """A ``ClusterCoordinator`` over an in-process cluster of ``num_workers`` workers and ``num_ps`` ps tasks,
    closed and its servers stopped afterwards (the coordinator fixtures of the parameter-server tests)."""
    import distrib as ds

    resolver = ds.testing.create_in_process_cluster(num_workers=num_workers, num_ps=num_ps)
    coordinator = ds.coordinator.ClusterCoordinator(ds.ParameterServerStrategy(resolver))
    try:
        yield coordinator
    finally:
        coordinator.close()
        ds.testing.stop_in_process_cluster(resolver)
