"""`distrib train`, the main job, end to end on small IDX files the test writes itself."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from distrib.app.cli import main
from distrib.app.datasets import DatasetNotFoundError, load_fashion_mnist, read_idx

# seed 000's fields, with readable precision: 4 decimals for losses, 2 for accuracies (percent, as the seed)
LINE = re.compile(
    r"Epoch (\d+), Loss: (\d+\.\d{4}), Accuracy: (\d+\.\d{2}), Test Loss: (\d+\.\d{4}), "
    r"Test Accuracy: (\d+\.\d{2}), Examples/s: (\d+)$",
    re.MULTILINE,
)


def test_the_epoch_line_is_formatted_by_field_name_whatever_the_rows_order() -> None:
    from distrib.app.train import EPOCH_TEMPLATE

    row = {
        "epoch": 1,
        "loss": 0.5080123,
        "accuracy": 81.5432,
        "test_loss": 0.38049,
        "test_accuracy": 86.2899,
        "examples_per_sec": 169.4,
    }
    want = "Epoch 1, Loss: 0.5080, Accuracy: 81.54, Test Loss: 0.3805, Test Accuracy: 86.29, Examples/s: 169"
    assert EPOCH_TEMPLATE.format(**row) == want and LINE.match(want)
    assert EPOCH_TEMPLATE.format(**dict(reversed(row.items()))) == want


def is_png(path: os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        head = f.read(16)
    return head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"  # tests/app/test_plot.py checks more


@pytest.mark.parametrize(
    "strategy_args", [["--strategy", "mirrored", "--replicas", "2"], ["--strategy", "default"], ["--workers", "2"]]
)
def test_train_prints_an_epoch_line_checkpoints_every_two_epochs_and_restores(
    idx_dir, tmp_path, capsys, monkeypatch, strategy_args
):
    ckpt = tmp_path / "ckpt"
    workers = "--workers" in strategy_args
    if workers:  # a progress line at every step, so a short test epoch shows them
        monkeypatch.setenv("DISTRIB_PROGRESS_INTERVAL", "0")
    if strategy_args[-1] == "default":  # hide matplotlib: the run ends with a note, not a picture
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(
        [
            "train",
            *strategy_args,
            "--epochs",
            "3",
            "--batch-size-per-replica",
            "32",
            "--log-every",
            "3",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(ckpt),
            *([] if workers else ["--no-progress"]),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    if workers:  # the chief alone prints, through the launcher's prefix, its progress included
        assert "[worker 0] Epoch 3" in out and "[worker 1] Epoch" not in out
        progress = re.findall(r"^\[worker 0\] epoch 2/3: +\d+%\|.*\| (\d+)/8 \[.*\]$", out, re.MULTILINE)
        assert progress == [str(n) for n in range(1, 9)], out  # 512 examples / (32 x 2 workers): 8 steps
        assert re.search(
            r"^\[worker 0\] epoch 2/3: 100%.* 8/8 .*loss=\d\.\d{4}, accuracy=\d+\.\d{2}\]$", out, re.MULTILINE
        )
        assert "[worker 1] epoch" not in out
        out = re.sub(r"^\[worker 0\] ", "", out, flags=re.MULTILINE)
    else:
        assert "epoch 1/3" not in out  # --no-progress: the epoch lines only
    epochs = [m.groups() for m in LINE.finditer(out)]
    assert [int(e[0]) for e in epochs] == [1, 2, 3]
    assert all(len(m.group(0)) <= 100 for m in LINE.finditer(out))  # fits a terminal with a task prefix
    assert float(epochs[-1][4]) > 50.0  # the fake data is learnable: a broken update would stay near 10 %
    restored = re.search(r"Accuracy after restoring the saved model without strategy: (\d+\.\d\d)$", out, re.MULTILINE)
    assert restored.group(1) == epochs[-1][4]  # epoch 3 is the last checkpoint (epochs 1, 3)
    assert sorted(p.name for p in ckpt.glob("ckpt-*.pt")) == ["ckpt-1.pt", "ckpt-2.pt"]
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = 16 if strategy_args[-1] == "default" else 8  # 512 / 32 on one replica, 512 / 64 on two
    assert [r["step"] for r in rows if "step" in r] == list(range(3, 3 * steps_per_epoch + 1, 3))
    assert [(r["epoch"], r["steps"]) for r in rows if "step" not in r] == [(e, e * steps_per_epoch) for e in (1, 2, 3)]
    epoch_rows = [r for r in rows if "step" not in r]
    assert [f"{r['loss']:.4f}" for r in epoch_rows] == [e[1] for e in epochs]  # the file holds what was printed
    if strategy_args[-1] == "default":
        assert re.search(
            r"^training picture not drawn: matplotlib is missing; pip install 'distrib\[plot\]', "
            rf"then: distrib plot {re.escape(str(ckpt))}$",
            out,
            re.MULTILINE,
        )
        assert not (ckpt / "training.png").exists()
    else:
        assert f"Training picture: {ckpt / 'training.png'}" in out and is_png(ckpt / "training.png")


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
    code = main(
        [
            "train",
            "--fit",
            "--strategy",
            "mirrored",
            "--replicas",
            "2",
            "--epochs",
            "2",
            "--batch-size-per-replica",
            "32",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(ckpt),
            "--tensorboard",
            str(tb),
            "--log-every",
            "4",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "Epoch 2/2" in out and " - val_accuracy: " in out
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "step" not in r]  # step lines carry a "step" key; epoch lines never do
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[1]["loss"] < epochs[0]["loss"]
    assert [(r["step"], r["epoch"]) for r in rows if "step" in r] == [(4, 1), (8, 1), (12, 2), (16, 2)]
    assert all({"loss", "accuracy"} <= set(r) for r in rows)
    restored = float(re.search(r"without strategy: ([\d.]+)", out).group(1))
    assert restored == pytest.approx(epochs[0]["val_accuracy"] * 100, abs=0.006)  # epoch 1 is the last checkpoint
    scalars = EventAccumulator(str(tb / "train")).Reload()
    assert {"epoch_loss", "epoch_accuracy", "batch_loss", "batch_accuracy"} <= set(scalars.Tags()["scalars"])
    assert [e.step for e in scalars.Scalars("batch_loss")] == [4, 8, 12, 16]  # a curve, not 2 epoch points
    assert is_png(ckpt / "training.png")


def test_custom_loop_step_scalars_reach_tensorboard(idx_dir, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    code = main(
        [
            "train",
            "--strategy",
            "default",
            "--epochs",
            "1",
            "--batch-size-per-replica",
            "64",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--tensorboard",
            str(tb),
            "--log-every",
            "2",
            "--no-progress",
        ]
    )
    assert code == 0
    scalars = EventAccumulator(str(tb / "train")).Reload()
    assert [e.step for e in scalars.Scalars("batch_loss")] == [2, 4, 6, 8]
    assert [e.step for e in scalars.Scalars("epoch_loss")] == [0]
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in scalars.Scalars("batch_loss")] == pytest.approx([r["loss"] for r in rows if "step" in r])


def test_train_sharded_writes_each_workers_shards_and_the_chief_restores_them_without_strategy(
    idx_dir, tmp_path, capsys
):
    """`--strategy sharded --workers 2`: checkpoints are the sharded format (a shard file per worker); the chief
    alone restores the last one into a plain model, reading it whole (no collective the other worker would miss)."""
    ckpt = tmp_path / "ckpt"
    code = main(
        [
            "train",
            "--strategy",
            "sharded",
            "--workers",
            "2",
            "--epochs",
            "1",
            "--batch-size-per-replica",
            "32",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(ckpt),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    epochs = [m.groups() for m in LINE.finditer(re.sub(r"^\[worker 0\] ", "", out, flags=re.MULTILINE))]
    assert [int(e[0]) for e in epochs] == [1] and float(epochs[0][4]) > 30.0, out
    assert sorted(p.name for p in (ckpt / "ckpt-1.dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    restored = re.search(r"Accuracy after restoring the saved model without strategy: (\d+\.\d\d)$", out, re.MULTILINE)
    assert restored is not None and restored.group(1) == epochs[0][4], out


def test_train_on_parameter_servers_through_launch(idx_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    code = main(
        [
            "train",
            "--strategy",
            "parameter-server",
            "--workers",
            "2",
            "--ps",
            "1",
            "--epochs",
            "1",
            "--batch-size-per-replica",
            "64",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(ckpt),
            "--log-every",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[chief 0] Epoch 1/1" in out and "[chief 0] 8/8 - " in out  # 512 examples / 64
    # scheduled evaluation steps sample the test set (each worker cycles its own copy, as in TF);
    # the restored model is evaluated on all of it: both well above chance (10 %) on this learnable data
    accuracy = float(re.search(r"8/8 - .* - val_accuracy: ([\d.]+)", out).group(1))
    restored = float(re.search(r"without strategy: ([\d.]+)", out).group(1))
    assert accuracy > 0.3 and restored > 30.0
    assert (ckpt / "ckpt-1.pt").exists()
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in rows] == [4, 8, None] and rows[-1]["steps"] == 8  # step lines from the coordinator


def test_train_16_mixed_on_parameter_servers(idx_dir, tmp_path, capsys):
    """float16 with a GradScaler under ParameterServerStrategy: each scheduled step scales on its worker,
    the coordinator's scaler replays the outcomes (distrib/parameter_server/scaler.py)."""
    ckpt = tmp_path / "ckpt"
    code = main(
        [
            "train",
            "--ps",
            "1",
            "--workers",
            "2",
            "--precision",
            "16-mixed",
            "--epochs",
            "1",
            "--batch-size-per-replica",
            "64",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(ckpt),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Using float16 Automatic Mixed Precision (AMP)" in out and "[chief 0] 8/8 - " in out
    from distrib.precision import Precision

    if Precision.parse("16-mixed").slow_here("cpu"):  # measured slow on this CPU: the chief says so
        assert "Note: float16 autocast is slow on this CPU" in out and "is the faster choice here" in out, out
    accuracy = float(re.search(r"8/8 - .* - val_accuracy: ([\d.]+)", out).group(1))
    restored = float(re.search(r"without strategy: ([\d.]+)", out).group(1))
    assert accuracy > 0.3 and restored > 30.0, out  # it learned: the skipped steps were only the overflowing ones
    assert (ckpt / "ckpt-1.pt").exists()


def test_compile_reaches_every_worker_process(idx_dir, tmp_path, capsys):
    code = main(
        [
            "train",
            "--workers",
            "2",
            "--compile",
            "--epochs",
            "1",
            "--batch-size-per-replica",
            "64",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for worker in (0, 1):  # `compiled` here; `fell back to eager` where this machine cannot compile
        assert re.search(rf"\[worker {worker}\] torch.compile: (compiled|fell back to eager) on worker {worker}", out)


def run_in_terminal(argv: list[str], timeout: float = 240) -> str:
    """Run ``argv`` with a pseudo-terminal (120 x 30) as stdout and stderr, as a user at a terminal runs it."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import subprocess
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = {**os.environ, "TQDM_MININTERVAL": "0", "TF_CONFIG": ""}  # tqdm redraws at every step: no timing in the test
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the terminal's other side is closed
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            pytest.fail(f"{' '.join(argv)} did not finish in {timeout}s:\n{b''.join(chunks).decode(errors='replace')}")
        assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("fit", [False, True], ids=["custom-loop", "fit"])
def test_on_a_terminal_the_bar_shows_the_running_loss_and_accuracy(idx_dir, tmp_path, fit):
    """At a terminal `distrib train` draws tqdm's bar with the loss and accuracy beside it, and
    `distrib train --fit` Keras' bar (issue 13: it printed nothing until the epoch ended)."""
    out = run_in_terminal(
        [
            sys.executable,
            "-m",
            "distrib",
            "train",
            "--strategy",
            "default",
            "--epochs",
            "1",
            "--batch-size-per-replica",
            "16",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            *(["--fit"] if fit else []),
        ]
    )
    if fit:  # redrawn in place ("\r"), with an ETA and the running logs, then the epoch's summary
        assert re.search(r"\r\s*\d+/32 \[=*>\.*\] - ETA: \d+s - loss: \d\.\d{4} - accuracy: \d\.\d{4}", out), out
        assert re.search(r"\r32/32 \[=+\] - \d+s \d+m?s/step - loss: \d\.\d{4} - accuracy: \d\.\d{4} - val_loss: ", out)
    else:  # 512 examples / 16: 32 steps; the postfix appears after POSTFIX_EVERY (10) steps
        bars = re.findall(
            r"\repoch 1/1: +\d+%\|[^\r\n]*\| (\d+)/32 \[[^\]]*?(?:, loss=(\d\.\d{4}), "
            r"accuracy=(\d+\.\d{2}))?\]",
            out,
        )
        assert [int(n) for n, _, _ in bars][-1] == 32 and len(bars) >= 20, out
        assert all(loss for n, loss, _ in bars if int(n) > 10) and not any(loss for n, loss, _ in bars if int(n) < 10)
        assert re.search(r"\rEpoch 1, Loss: \d\.\d{4}, .*\r\n", out)  # after the bar, which is cleared


def test_the_custom_loop_and_fit_are_one_job_and_both_return_the_history(idx_dir, tmp_path, capsys):
    """One path through `distrib train` (issue 19): the same model, optimizer, checkpoints and callbacks, then
    the seed's loop or fit; both return Keras' history, with the same losses (same seed, same batches)."""
    from distrib.app.train import TrainConfig, train

    runs = {}
    for fit in (False, True):
        config = TrainConfig(
            strategy="mirrored",
            replicas=2,
            epochs=2,
            batch_size_per_replica=32,
            progress=False,
            data_dir=str(idx_dir),
            checkpoint_dir=str(tmp_path / f"fit{fit}"),
            fit=fit,
            log_every=0,
        )
        runs[fit] = train(config)
        assert sorted(p.name for p in (tmp_path / f"fit{fit}").glob("ckpt-*.pt")) == ["ckpt-1.pt"]  # after epoch 1
    custom, fitted = runs[False]["history"], runs[True]["history"]
    assert set(fitted) == {"loss", "accuracy", "val_loss", "val_accuracy"} and set(custom) == {
        *fitted,
        "examples_per_sec",
    }
    assert len(custom["loss"]) == 2 and custom["loss"][1] < custom["loss"][0]
    for name in fitted:
        assert fitted[name] == pytest.approx(custom[name], rel=1e-5), name
    assert runs[False]["restored_accuracy"] == runs[True]["restored_accuracy"]


@pytest.mark.parametrize("fit", [False, True])
def test_function_gives_the_same_history_and_says_once_where_it_runs_eagerly(idx_dir, tmp_path, caplog, fit):
    """`--function` (issue 28): the seed's @tf.function as @ds.function. On a CPU no graph can be captured: the steps
    run eagerly, the run is the one without it, and the log says why, once per step function."""
    import logging

    from distrib.app.train import TrainConfig, train, use_function

    runs = {}
    for function in (False, True):
        config = TrainConfig(
            strategy="default",
            epochs=2,
            batch_size_per_replica=64,
            progress=False,
            fit=fit,
            data_dir=str(idx_dir),
            checkpoint_dir=str(tmp_path / f"f{function}"),
            log_every=0,
            function=function,
        )
        with caplog.at_level(logging.WARNING, logger="distrib.function"):
            runs[function] = train(config)["history"]
    for name, values in runs[False].items():
        if name != "examples_per_sec":
            assert runs[True][name] == pytest.approx(values, rel=1e-6), name
    said = [r.getMessage() for r in caplog.records if r.name == "distrib.function"]
    assert said and all("runs eagerly" in m for m in said) and len(said) == len(set(said)), said
    # the default: eager (auto never captures; --function opts in)
    import distrib as ds

    assert use_function(TrainConfig(), ds.OneDeviceStrategy("cpu")) is False
    assert use_function(TrainConfig(function=True), ds.OneDeviceStrategy("cpu")) is True


def test_compile_and_function_together_are_refused(idx_dir, tmp_path):
    from distrib.app.train import TrainConfig, train

    with pytest.raises(ValueError, match="--compile and --function"):
        train(
            TrainConfig(
                strategy="default",
                epochs=1,
                data_dir=str(idx_dir),
                checkpoint_dir=str(tmp_path),
                compile=True,
                function=True,
                progress=False,
            )
        )
