"""`distrib train --workers 2` and preemption (issue 23): SIGTERM to worker 1 mid-epoch; both workers save before
the same batch and exit 42; the launcher restarts them; the job resumes at that batch and ends with the same model
as an uninterrupted run (seed 000's end-of-epoch checkpoint compared tensor by tensor)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import make_idx_dir
from helpers import process_tree

from distrib.checkpoint import format as fmt

ARGS = ["--workers", "2", "--epochs", "1", "--batch-size-per-replica", "8", "--log-every", "1", "--no-progress"]


def _train(idx_dir: Path, ckpt: Path, kill_after_step: int = -1, timeout: float = 300) -> str:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distrib.app.cli",
            "train",
            *ARGS,
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(ckpt),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # fresh tasks: _worker finds worker 1 by its /proc/PID/environ, which a forked task shares with the fork
        # server (docs/multi-node.md)
        env={**os.environ, "DISTRIB_START_METHOD": "spawn"},
    )
    try:
        deadline = time.monotonic() + timeout
        if kill_after_step >= 0:
            metrics = ckpt / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().count('"step"') >= kill_after_step):
                assert time.monotonic() < deadline and proc.poll() is None, "training ended before the notice"
                time.sleep(0.01)
            os.kill(_worker(proc.pid, 1), signal.SIGTERM)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, out
        return out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _worker(launcher: int, index: int) -> int:
    """The pid of the task ``worker index`` under the launcher (from its TF_CONFIG)."""
    for pid in process_tree(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f'"task": {{"type": "worker", "index": {index}}}'.encode() in environ and b"DISTRIB_RESTART=0" in environ:
            return pid
    raise AssertionError(f"no worker {index} under the launcher")


def _model(ckpt: Path) -> dict[str, torch.Tensor]:
    return fmt.load(str(ckpt / "ckpt-1.pt"))["objects"]["model"]


def test_distrib_train_saves_on_a_notice_and_resumes_at_the_batch(tmp_path):
    # 256 examples, global batch 16: 16 batches in the epoch, so a notice after batch 5 is mid-epoch; the evaluation
    # set is small too (its accuracy is not what is checked here)
    idx_dir = make_idx_dir(tmp_path / "fashion", n_train=256, n_test=64)
    _train(idx_dir, tmp_path / "clean")
    out = _train(idx_dir, tmp_path / "preempted", kill_after_step=5)
    saved = re.findall(r"worker (\d): preemption checkpoint at run (\d+) saved", out)
    assert len(saved) == 2 and len({run for _, run in saved}) == 1, out
    assert "not counted against --max-restarts" in out
    resumed = re.findall(r"resuming after a preemption at epoch 1, batch (\d+)", out)
    assert len(resumed) == 2 and 16 > int(resumed[0]) == int(saved[0][1]) > 5, out  # 16 batches: mid-epoch
    expected, got = _model(tmp_path / "clean"), _model(tmp_path / "preempted")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert not (tmp_path / "preempted" / "preemption").exists()  # removed once training ended
