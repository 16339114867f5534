"""Every example under examples/ runs, on small data the test makes (the parameter-server ones are in
tests/parameter_server/test_ps_units.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from conftest import make_idx_dir
from helpers import launch, run_bounded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_custom_training_seed_000(tmp_path):
    data = make_idx_dir(tmp_path / "data", n_train=1280)  # the iterator section takes 10 steps of 128
    code, out, _ = run_bounded(
        [
            sys.executable,
            str(EXAMPLES / "custom_training.py"),
            "--replicas",
            "2",
            "--epochs",
            "1",
            "--data-dir",
            str(data),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        timeout=180,
    )
    assert code == 0, out
    assert "Number of devices: 2" in out
    assert len(re.findall(r"Epoch 1, Loss: [\d.]+, Accuracy: [\d.]+", out)) == 3
    assert "Accuracy after restoring the saved model without strategy" in out


def test_multi_worker_ctl_seed_001_on_two_workers(tmp_path):
    data = make_idx_dir(tmp_path / "data")
    code, out, _ = launch(
        "--workers",
        "2",
        str(EXAMPLES / "multi_worker_ctl.py"),
        "--data-dir",
        str(data),
        "--epochs",
        "2",
        "--steps-per-epoch",
        "3",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    assert code == 0, out
    for worker in (0, 1):
        assert f"[worker {worker}] Epoch: 1, accuracy:" in out


def test_ps_fit_seed_003_in_process():
    code, out, _ = run_bounded([sys.executable, str(EXAMPLES / "ps_fit.py")], timeout=180)
    assert code == 0, out
    lines = [float(x) for x in re.findall(r"10/10 - \S+ - loss: ([\d.]+)", out)]
    assert len(lines) == 6, out  # 5 epochs of fit, then evaluate's line (verbose="auto": 2, as Keras)
    losses = lines[:5]
    # the example's data is random (as the tutorial's): a run may converge within two epochs, and then the bar's
    # four decimals tie (0.0003, 0.0003, ...): each epoch no higher than the one before, the last below the first
    assert len(losses) == 5 and all(b <= a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0], out
