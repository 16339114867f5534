"""ds.callbacks.ModelCheckpoint as Keras': files found by latest_checkpoint, save_weights_only, best-only, frequency."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
from helpers import launch

import distrib as ds
from distrib.checkpoint import CheckpointError


def data(n: int = 64, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [(x[i : i + batch], x[i : i + batch, :1] * 2) for i in range(0, n, batch)]


def build(strategy=None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with (strategy or ds.get_strategy()).scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)


class Feed(ds.callbacks.Callback):
    """Puts a scripted value into the epoch logs, as a validation metric would be."""

    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values = name, values

    def on_epoch_end(self, epoch, logs=None):
        logs[self.name] = self.values[epoch]


def stored(path: str) -> set[str]:
    return set(torch.load(path + ".pt", weights_only=True)["objects"])


def test_files_are_found_by_latest_checkpoint_and_hold_model_and_optimizer(tmp_path):
    model, optimizer = build()
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch:02d}"))
    ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=3, verbose=0, callbacks=[save])
    latest = ds.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "ckpt-03") and stored(latest) == {"model", "optimizer"}
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["ckpt-01.pt", "ckpt-02.pt", "ckpt-03.pt"]
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.5)
    ds.Checkpoint(model=plain, optimizer=plain_opt).restore(latest).assert_consumed()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert plain_opt.state_dict()["param_groups"][0]["lr"] == 0.01
    # the side-car evaluator restores the model alone, and says it meant to
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        ds.Checkpoint(model=evaluator).restore(latest).expect_partial()
    assert torch.equal(evaluator[0].weight, model[0].weight)


def test_save_weights_only_holds_the_model_alone(tmp_path):
    model, optimizer = build()
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "weights.pt"), save_weights_only=True)
    ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=2, verbose=0, callbacks=[save])
    latest = ds.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "weights") and (tmp_path / "weights.pt").is_file()  # ".pt" not doubled
    assert stored(latest) == {"model"}
    ds.Checkpoint(model=build()[0]).restore(latest).assert_consumed()
    fresh, fresh_opt = build()
    with pytest.raises(CheckpointError, match=r"does not hold \['optimizer'\]"):
        ds.Checkpoint(model=fresh, optimizer=fresh_opt).restore(latest)


def test_save_best_only_min_with_an_initial_threshold_and_verbose_lines(tmp_path, capsys):
    model, optimizer = build()
    values = [3.0, 1.0, 2.0, 0.5]
    save = ds.callbacks.ModelCheckpoint(
        str(tmp_path / "best-{epoch}"), monitor="val_loss", save_best_only=True, verbose=1
    )
    ds.fit(
        model, data(), optimizer=optimizer, loss="mse", epochs=4, verbose=0, callbacks=[Feed("val_loss", values), save]
    )
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["best-1.pt", "best-2.pt", "best-4.pt"]
    assert save.best == 0.5 and ds.latest_checkpoint(tmp_path) == str(tmp_path / "best-4")
    out = capsys.readouterr().out
    assert f"Epoch 1: val_loss improved from inf to 3.00000, saving model to {tmp_path / 'best-1'}" in out
    assert "Epoch 3: val_loss did not improve from 1.00000" in out

    thresholded = tmp_path / "thr"
    save = ds.callbacks.ModelCheckpoint(
        str(thresholded / "best-{epoch}"), save_best_only=True, initial_value_threshold=2.5
    )
    ds.fit(
        model, data(), optimizer=optimizer, loss="mse", epochs=4, verbose=0, callbacks=[Feed("val_loss", values), save]
    )
    assert sorted(p.name for p in thresholded.glob("*.pt")) == ["best-2.pt", "best-4.pt"]


def test_save_best_only_max_and_auto_for_accuracies(tmp_path):
    model, optimizer = build()
    for mode, expected in (
        ("max", ["e-1.pt", "e-2.pt", "e-4.pt"]),
        ("auto", ["e-1.pt", "e-2.pt", "e-4.pt"]),
        ("min", ["e-1.pt", "e-3.pt"]),
    ):
        out = tmp_path / mode
        save = ds.callbacks.ModelCheckpoint(
            str(out / "e-{epoch}"), monitor="val_accuracy", save_best_only=True, mode=mode
        )
        ds.fit(
            model,
            data(),
            optimizer=optimizer,
            loss="mse",
            epochs=4,
            verbose=0,
            callbacks=[Feed("val_accuracy", [0.5, 0.7, 0.4, 0.9]), save],
        )
        assert sorted(p.name for p in out.glob("*.pt")) == expected, mode


def test_a_directory_as_filepath_is_refused_naming_a_file_in_it(tmp_path):
    """guide/migrate/checkpoint_saver.ipynb passes ModelCheckpoint(filepath=tempfile.mkdtemp()): Keras 2 wrote a
    SavedModel into it; a distrib checkpoint is one file, which would land beside the directory, not in it."""
    with pytest.raises(ValueError, match=r"that is a directory.*give a file name in it, e\.g\. '.*/ckpt-\{epoch\}'"):
        ds.callbacks.ModelCheckpoint(filepath=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_monitor_missing_from_the_logs_warns_and_skips(tmp_path):
    model, optimizer = build()
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "c-{epoch}"), monitor="val_loss", save_best_only=True)
    with pytest.warns(UserWarning, match="only with 'val_loss' available.*validation_data"):
        ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=1, verbose=0, callbacks=[save])
    assert not list(tmp_path.glob("*.pt")) and ds.latest_checkpoint(tmp_path) is None


def test_integer_save_freq_counts_batches_across_epochs(tmp_path):
    model, optimizer = build()  # 4 batches per epoch, 2 epochs: batches 3 and 6 are saved
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "c-{epoch}-{batch}"), save_freq=3)
    ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=2, verbose=0, callbacks=[save])
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["c-1-3.pt", "c-2-2.pt"]
    assert ds.latest_checkpoint(tmp_path) == str(tmp_path / "c-2-2")


def test_bad_arguments_are_errors_that_name_them(tmp_path):
    for freq in (0, "batch", 2.5, True):
        with pytest.raises(ValueError, match=f"save_freq={freq!r}"):
            ds.callbacks.ModelCheckpoint(str(tmp_path / "c"), save_freq=freq)
    model, optimizer = build()
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "c-{epoch}-{val_acc:.2f}"))
    with pytest.raises(KeyError, match=r"could not format filepath .*\{val_acc:.2f\}.*\['loss'\]"):
        ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=1, verbose=0, callbacks=[save])


def test_under_mirrored_replicas_the_file_restores_into_a_plain_model(tmp_path):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    model, optimizer = build(strategy)
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}"), save_weights_only=True)
    ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=2, verbose=0, callbacks=[save])
    plain = build()[0]
    ds.Checkpoint(model=plain).restore(ds.latest_checkpoint(tmp_path)).assert_consumed()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


WORKER = textwrap.dedent("""
    import sys
    import torch
    import distrib as ds

    out = sys.argv[1]
    strategy = ds.MultiWorkerMirroredStrategy()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    batches = [(x[i:i + 16], x[i:i + 16, :1] * 2) for i in range(0, 64, 16)]  # each worker trains on half a batch:
    # the per-batch logs a callback sees are this worker's, and differ between the workers
    with strategy.scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    save = ds.callbacks.ModelCheckpoint(out + "/b-{epoch}-{batch}", monitor="loss", save_best_only=True,
                                        save_freq=1)
    ds.fit(model, batches, optimizer=optimizer, loss="mse", epochs=2, verbose=0, callbacks=[save])
    print("best", save.best, "latest", ds.latest_checkpoint(out), flush=True)
""")


def test_two_workers_share_the_chief_s_best_only_decision_on_batch_saves(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    code, log, _ = launch("--workers", "2", str(script), str(out), timeout=150)
    assert code == 0, log
    lines = {line.split("]")[0] + "]": line for line in log.splitlines() if "best" in line and "latest" in line}
    assert set(lines) == {"[worker 0]", "[worker 1]"}, log
    assert lines["[worker 0]"].split("] ")[1] == lines["[worker 1]"].split("] ")[1]  # same best, same latest
    latest = ds.latest_checkpoint(out)
    assert latest is not None and stored(latest) == {"model", "optimizer"}
