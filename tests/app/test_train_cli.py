"""`distrib train`, the main job, end to end on small IDX files the test writes itself."""

from __future__ import annotations

import re

import pytest

from distrib.app.cli import main
from distrib.app.datasets import DatasetNotFoundError, load_fashion_mnist, read_idx

LINE = re.compile(r"Epoch (\d+), Loss: ([\d.]+), Accuracy: ([\d.]+), Test Loss: ([\d.]+), "
                  r"Test Accuracy: ([\d.]+), Examples/s: (\d+)")


@pytest.mark.parametrize("strategy_args", [["--strategy", "mirrored", "--replicas", "2"], ["--strategy", "default"],
                                           ["--workers", "2"]])
def test_train_prints_an_epoch_line_checkpoints_every_two_epochs_and_restores(idx_dir, tmp_path, capsys, strategy_args):
    ckpt = tmp_path / "ckpt"
    code = main(["train", *strategy_args, "--epochs", "3", "--batch-size-per-replica", "32",
                 "--data-dir", str(idx_dir), "--checkpoint-dir", str(ckpt), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    if "--workers" in strategy_args:  # the chief alone prints, through the launcher's prefix
        assert "[worker 0] Epoch 3" in out and "[worker 1] Epoch" not in out
    epochs = [m.groups() for m in LINE.finditer(out)]
    assert [int(e[0]) for e in epochs] == [1, 2, 3]
    assert float(epochs[-1][4]) > 50.0  # the fake data is learnable: a broken update would stay near 10 %
    restored = float(re.search(r"Accuracy after restoring the saved model without strategy: ([\d.]+)", out).group(1))
    assert restored == pytest.approx(float(epochs[-1][4]), abs=1e-4)  # epoch 3 is the last checkpoint (epochs 1, 3)
    assert sorted(p.name for p in ckpt.glob("ckpt-*.pt")) == ["ckpt-1.pt", "ckpt-2.pt"]


def test_missing_data_is_a_clear_error_naming_the_debian_package(tmp_path, capsys):
    with pytest.raises(DatasetNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path / "nowhere")
    code = main(["train", "--epochs", "1", "--data-dir", str(tmp_path / "nowhere"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "dataset-fashion-mnist" in err and "nowhere" in err and "--data-dir" in err


def test_a_truncated_idx_file_is_rejected(idx_dir):
    import gzip

    path = idx_dir / "t10k-labels-idx1-ubyte.gz"
    with gzip.open(path, "rb") as f:
        data = f.read()
    with gzip.open(path, "wb") as f:
        f.write(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)


def test_train_through_fit_writes_tensorboard_scalars_and_a_metrics_jsonl(idx_dir, tmp_path, capsys):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    code = main(["train", "--fit", "--strategy", "mirrored", "--replicas", "2", "--epochs", "2",
                 "--batch-size-per-replica", "32", "--data-dir", str(idx_dir), "--checkpoint-dir", str(ckpt),
                 "--tensorboard", str(tb), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "Epoch 2/2" in out and " - val_accuracy: " in out
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]
    restored = float(re.search(r"without strategy: ([\d.]+)", out).group(1))
    assert restored == pytest.approx(rows[0]["val_accuracy"] * 100, abs=1e-3)  # epoch 1 is the last checkpoint
    tags = EventAccumulator(str(tb / "train")).Reload().Tags()["scalars"]
    assert {"epoch_loss", "epoch_accuracy"} <= set(tags)


def test_train_on_parameter_servers_through_launch(idx_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    code = main(["train", "--strategy", "parameter-server", "--workers", "2", "--ps", "1", "--epochs", "1",
                 "--batch-size-per-replica", "64", "--data-dir", str(idx_dir), "--checkpoint-dir", str(ckpt)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[chief 0] Epoch 1/1" in out and "[chief 0] 8/8 - " in out  # 512 examples / 64
    # scheduled evaluation steps sample the test set (each worker cycles its own copy, as in TF);
    # the restored model is evaluated on all of it: both well above chance (10 %) on this learnable data
    accuracy = float(re.search(r"8/8 - .* - val_accuracy: ([\d.]+)", out).group(1))
    restored = float(re.search(r"without strategy: ([\d.]+)", out).group(1))
    assert accuracy > 0.3 and restored > 30.0
    assert (ckpt / "ckpt-1.pt").exists()


def test_compile_reaches_every_worker_process(idx_dir, tmp_path, capsys):
    code = main(["train", "--workers", "2", "--compile", "--epochs", "1", "--batch-size-per-replica", "64",
                 "--data-dir", str(idx_dir), "--checkpoint-dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert code == 0, out
    for worker in (0, 1):  # `compiled` here; `fell back to eager` where this machine cannot compile
        assert re.search(rf"\[worker {worker}\] torch.compile: (compiled|fell back to eager) on worker {worker}", out)
