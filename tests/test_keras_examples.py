"""The Keras 3 ports of TF's custom-loop tutorials under examples/ run, on small data the test makes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import make_idx_dir
from helpers import launch, run_bounded

pytest.importorskip("keras")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_keras_custom_training_two_replicas(tmp_path):
    data = make_idx_dir(tmp_path / "data", n_train=1280)  # the iterator section takes 10 steps of 128
    code, out, _ = run_bounded(
        [
            sys.executable,
            str(EXAMPLES / "keras_custom_training.py"),
            "--replicas",
            "2",
            "--epochs",
            "1",
            "--data-dir",
            str(data),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        timeout=120,
    )
    assert code == 0, out
    assert "Number of devices: 2" in out
    epochs = re.findall(r"Epoch 1, Loss: ([\d.]+), Accuracy: ([\d.]+)", out)
    assert len(epochs) == 3, out
    # the learnable images: the last section's accuracy is far above chance (10 %)
    assert float(epochs[-1][1]) > 50, out
    test_accuracy = re.search(r"Test Accuracy: ([\d.]+)", out)
    restored = re.search(r"Accuracy after restoring the saved model without strategy: ([\d.]+)", out)
    assert test_accuracy and restored, out
    # the checkpoint of epoch 1 restored into a model built without a strategy: the same test accuracy
    assert float(restored.group(1)) == pytest.approx(float(test_accuracy.group(1))), out


def test_keras_multi_worker_ctl_on_two_workers(tmp_path):
    data = make_idx_dir(tmp_path / "data")
    code, out, _ = launch(
        "--workers",
        "2",
        str(EXAMPLES / "keras_multi_worker_ctl.py"),
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
    lines = {
        w: re.findall(rf"\[worker {w}\] Epoch: (\d), accuracy: ([\d.]+), train_loss: ([\d.]+)\.", out) for w in (0, 1)
    }
    assert [e for e, _, _ in lines[0]] == ["0", "1"], out
    # one global step: both workers report the same reduced loss and the same global accuracy
    assert lines[0] == lines[1], out
    assert float(lines[0][1][2]) < float(lines[0][0][2]), out
    assert (tmp_path / "ckpt" / "checkpoint").exists()
    assert not list((tmp_path / "ckpt").glob("workertemp_*")), "the non-chief's copy is removed, as the tutorial does"
