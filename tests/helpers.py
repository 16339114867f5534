"""Helpers shared by the tests: run `distrib launch` bounded in time, compare parameters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"


def launch(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run `distrib launch ARGS` in its own process group; kill the whole group if it overruns."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "distrib.app.cli", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"distrib launch {' '.join(args)} did not finish in {timeout}s:\n{out}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing it started may outlive the test
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - start


def assert_params_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
