"""The ports of pytorch/examples (examples/mnist.py, examples/multigpu_torchrun.py) run and train right.

They run as users run them: a plain ``python`` process, ``distrib launch`` and the real ``torchrun``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_idx_dir
from helpers import launch, run_bounded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"port_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mnist_port_learns_on_two_replicas_and_saves_the_model_it_tested(tmp_path):
    data = make_idx_dir(tmp_path / "data", n_train=640, n_test=200)
    code, out, _ = run_bounded(
        [
            sys.executable,
            str(EXAMPLES / "mnist.py"),
            "--data-dir",
            str(data),
            "--replicas",
            "2",
            "--epochs",
            "2",
            "--log-interval",
            "4",
            "--test-batch-size",
            "64",
            "--save-model",
        ],
        timeout=240,
        cwd=tmp_path,
    )
    assert code == 0, out
    assert "Replicas in sync: 2" in out
    losses = [float(x) for x in re.findall(r"Train Epoch: \d \[\d+/640 \(\d+%\)\]\tLoss: ([\d.]+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0] / 10, out
    tests = re.findall(r"Test set: Average loss: ([\d.]+), Accuracy: (\d+)/200", out)
    assert len(tests) == 2 and int(tests[-1][1]) >= 180, out

    # the saved state dict is the trained model: a plain Net, no strategy, scores what the port printed
    mnist = _module("mnist")
    net = mnist.Net()
    net.load_state_dict(torch.load(tmp_path / "mnist_cnn.pt", weights_only=True))
    net.eval()
    from distrib.app.datasets import load_fashion_mnist

    _, (x, y) = load_fashion_mnist(data)
    with torch.no_grad():
        output = net((x - 0.1307) / 0.3081)
    assert int(output.argmax(1).eq(y).sum()) == int(tests[-1][1])
    assert F.nll_loss(output, y).item() == pytest.approx(float(tests[-1][0]), abs=1e-4)


def test_mnist_port_on_two_workers_logs_once_from_the_chief(tmp_path):
    data = make_idx_dir(tmp_path / "data", n_train=256, n_test=128)
    code, out, _ = launch(
        "--workers",
        "2",
        str(EXAMPLES / "mnist.py"),
        "--data-dir",
        str(data),
        "--epochs",
        "1",
        "--log-interval",
        "2",
        "--test-batch-size",
        "64",
        timeout=180,
    )
    assert code == 0, out
    assert out.count("Replicas in sync: 2") == 1, out
    assert len(re.findall(r"Train Epoch: 1 \[\d+/256", out)) == 2, out  # steps 0 and 2 of 4, printed once
    assert len(re.findall(r"Test set: Average loss: [\d.]+, Accuracy: \d+/128", out)) == 1, out


def _torchrun(nproc: int, *args: str, cwd: Path) -> str:
    code, out, _ = run_bounded(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(EXAMPLES / "multigpu_torchrun.py"),
            *args,
        ],
        timeout=180,
        cwd=cwd,
    )
    assert code == 0, out
    return out


def test_torchrun_port_on_two_processes_equals_one_process_with_the_global_batch_and_resumes(tmp_path):
    """2 workers x 32 (DistributedSampler interleaves indices) see each step's 64 examples that one process
    with --batch_size 64 sees: the same summed gradient, the same model. Then a second torchrun resumes."""
    two = tmp_path / "two.pt"
    out = _torchrun(2, "2", "1", "--snapshot_path", str(two), cwd=tmp_path)
    assert "[worker 0] Epoch 1 | Batchsize: 32 | Steps: 32" in out and "[worker 1] Epoch 1" in out, out
    assert out.count("Training snapshot saved") == 2, out  # the chief only, epochs 0 and 1

    one = tmp_path / "one.pt"
    code, out1, _ = run_bounded(
        [
            sys.executable,
            str(EXAMPLES / "multigpu_torchrun.py"),
            "2",
            "1",
            "--batch_size",
            "64",
            "--snapshot_path",
            str(one),
        ],
        timeout=120,
        cwd=tmp_path,
    )
    assert code == 0, out1
    a, b = (torch.load(p, weights_only=True) for p in (two, one))
    assert a["EPOCHS_RUN"] == b["EPOCHS_RUN"] == 2
    for key in ("weight", "bias"):
        torch.testing.assert_close(a["MODEL_STATE"][key], b["MODEL_STATE"][key], rtol=1e-5, atol=1e-6)
    losses = [float(x) for x in re.findall(r"Epoch \d \| loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out  # it trains (the original's loss is always 0)

    out = _torchrun(2, "3", "1", "--snapshot_path", str(two), cwd=tmp_path)
    assert out.count("Resuming training from snapshot at Epoch 2") == 2, out
    assert "[worker 0] Epoch 2 |" in out and "[worker 0] Epoch 1 |" not in out, out
