"""Preemption under torchrun (issue 23): how torch's agent turns the handler's exit 42 into a restart.

* A notice to one worker: both save at the same run and exit 42; the agent restarts both
  (``--max-restarts=1``: torch's agent cannot tell a preemption from a crash, so it counts it), and
  training ends with an uninterrupted run's parameters.
* A notice to the agent (how a scheduler stops torchrun): the agent forwards SIGTERM to its workers
  ("Received 15 death signal, shutting down workers"), both save and exit 42, and torchrun exits
  non-zero without restarting (it was itself told to stop); the scheduler's restart of the same
  command resumes from the checkpoint and ends with the same parameters.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS
from scripts.torchrun_processes import clean_env, run_job

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import preemption as bench  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return bench.reference(tmp_path_factory.mktemp("reference"))


def _torchrun(directory: Path, *extra: str) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        str(SCRIPTS / "preempt_train.py"),
        "--out",
        str(directory / "out.pt"),
        "--checkpoint-dir",
        str(directory / "ckpt"),
        *extra,
    ]
    code, out, left = run_job(cmd, directory / f"log{len(list(directory.glob('log*')))}", timeout=180, env=clean_env())
    assert code is not None and not left, out
    return code, out


def _saved(out: str) -> set[str]:
    runs = re.findall(r"worker \d: preemption checkpoint at run (\d+) saved", out)
    assert len(runs) == 2, out
    return set(runs)


def test_torchrun_restarts_a_worker_that_saved_on_a_notice(tmp_path, reference):
    code, out = _torchrun(tmp_path, "--notice-at", "7")
    assert code == 0, out
    assert _saved(out) == {"8"} and "exitcode: 42" in out
    assert re.findall(r"START worker=\d restart=0 run=8", out), out  # the agent's restart resumed at run 8
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out.pt"), reference))


def test_a_notice_to_the_torchrun_agent_saves_and_a_rerun_resumes(tmp_path, reference):
    code, out = _torchrun(tmp_path, "--notice-at", "7", "--notice-to", "launcher", "--step-seconds", "0.02")
    assert code != 0 and "Received 15 death signal, shutting down workers" in out, out
    run = _saved(out).pop()
    code, out = _torchrun(tmp_path)  # the scheduler starts the same command again
    assert code == 0 and f"START worker=0 restart=0 run={run}" in out, out
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out.pt"), reference))
