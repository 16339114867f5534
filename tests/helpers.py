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
    cmd: list[str], timeout: float = 120, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group, stdout and stderr together; kill the whole group if it
    overruns (the test fails, showing the output) and, in any case, when it ends."""
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
