"""LearningRateScheduler, TerminateOnNaN and CSVLogger with Keras' semantics, under every strategy; what a custom
callback reaches (self.optimizer, self.learning_rate)."""

from __future__ import annotations

import csv

import pytest
import torch
from helpers import SCRIPTS, launch

import distrib as ds


def data(n: int = 48, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return [(x[i : i + batch], x[i : i + batch, :1] * 2) for i in range(0, n, batch)]


STRATEGIES = [ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])]


def build(strategy: ds.Strategy, groups: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        params = (
            [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}]
            if groups
            else model.parameters()
        )
        return model, torch.optim.SGD(params, lr=0.1)


class LrSeen(ds.callbacks.Callback):
    """The learning rate of every group when each batch ends: what the optimizer really used."""

    def __init__(self) -> None:
        self.rates: list[list[float]] = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append([g["lr"] for g in self.loop.optimizer.param_groups])


@pytest.mark.parametrize("make", STRATEGIES)
def test_learning_rate_scheduler_sets_every_group_at_each_epoch_and_logs_lr(make, capsys):
    model, optimizer = build(make(), groups=True)
    seen = LrSeen()
    calls = []

    def schedule(epoch, lr):
        calls.append((epoch, lr))
        return 0.1 * 0.5**epoch

    history = ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=3,
        verbose=0,
        callbacks=[ds.callbacks.LearningRateScheduler(schedule, verbose=1), seen],
    )
    assert calls == [(0, 0.1), (1, 0.1), (2, 0.05)]  # the schedule gets the current rate (the first group's)
    assert history.history["lr"] == [0.1, 0.05, 0.025]
    assert seen.rates == [[0.1, 0.1]] * 6 + [[0.05, 0.05]] * 6 + [[0.025, 0.025]] * 6  # every group, every step
    assert "Epoch 00002: LearningRateScheduler setting learning rate to 0.05." in capsys.readouterr().out


def test_learning_rate_scheduler_takes_one_argument_schedules_and_refuses_bad_outputs():
    model, optimizer = build(ds.get_strategy())
    history = ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=2,
        verbose=0,
        callbacks=[ds.callbacks.LearningRateScheduler(lambda epoch: 0.01 * (epoch + 1))],
    )
    assert history.history["lr"] == [0.01, 0.02]
    with pytest.raises(ValueError, match="should be a finite float: schedule returned 'fast' for epoch 0"):
        ds.fit(
            model,
            data(),
            optimizer=optimizer,
            loss="mse",
            verbose=0,
            callbacks=[ds.callbacks.LearningRateScheduler(lambda epoch: "fast")],
        )
    with pytest.raises(TypeError, match="schedule must be a function"):
        ds.callbacks.LearningRateScheduler(0.1)


def test_under_parameter_servers_the_scheduled_rate_reaches_the_ps_tasks():
    resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    try:
        strategy = ds.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0], [0.0]])
        before = {k: v.clone() for k, v in model.state_dict().items()}  # state_dict reads the ps tasks
        frozen = ds.callbacks.LearningRateScheduler(lambda epoch, lr: 0.0)
        history = ds.fit(
            model, [(x, y)], optimizer=optimizer, loss="mse", epochs=2, steps_per_epoch=3, verbose=0, callbacks=[frozen]
        )
        assert history.history["lr"] == [0.0, 0.0]
        for k, v in model.state_dict().items():  # a rate of 0 on the ps tasks: nothing moved
            torch.testing.assert_close(v, before[k])
        ds.fit(
            model,
            [(x, y)],
            optimizer=optimizer,
            loss="mse",
            steps_per_epoch=3,
            verbose=0,
            callbacks=[ds.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1)],
        )
        assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        ds.testing.stop_in_process_cluster(resolver)


@pytest.mark.parametrize("make", STRATEGIES)
def test_a_callback_reads_and_sets_the_learning_rate_as_keras_model_optimizer_learning_rate(make):
    model, optimizer = build(make(), groups=True)
    seen = LrSeen()

    class Halve(ds.callbacks.Callback):  # Keras: self.model.optimizer.learning_rate = lr / 2
        def __init__(self) -> None:
            self.read: list[float] = []

        def on_epoch_end(self, epoch, logs=None):
            assert self.optimizer is optimizer and self.model is model
            self.read.append(self.learning_rate)
            self.learning_rate = self.learning_rate / 2

    halve = Halve()
    ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=3, verbose=0, callbacks=[halve, seen])
    assert halve.read == [0.1, 0.05, 0.025]  # the first group's rate
    assert seen.rates == [[0.1, 0.5]] * 6 + [[0.05, 0.05]] * 6 + [[0.025, 0.025]] * 6  # then every group's
    with pytest.raises(ValueError, match="Halve.learning_rate: a learning rate must be a finite float, got 'x'"):
        halve.learning_rate = "x"


def test_the_callback_shortcuts_name_the_fix_before_fit_and_without_an_optimizer():
    class Early(ds.callbacks.Callback):
        def __init__(self) -> None:
            self.learning_rate = 0.1  # a Keras habit that would silently shadow the optimizer's rate

    with pytest.raises(AttributeError, match=r"Early.learning_rate is the running loop's.*under another name"):
        Early()

    class Reader(ds.callbacks.Callback):
        def on_test_end(self, logs=None):
            assert self.optimizer is None
            _ = self.learning_rate

    model, _ = build(ds.get_strategy())
    with pytest.raises(ValueError, match="Reader.learning_rate needs an optimizer.*evaluate and predict train nothing"):
        ds.evaluate(model, data(), loss="mse", callbacks=[Reader()], verbose=0)
    with pytest.raises(AttributeError, match="Reader.optimizer is the optimizer fit trains with, not settable"):
        Reader().optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


class Batches(ds.callbacks.Callback):
    def __init__(self) -> None:
        self.ends: list[int] = []
        self.epoch_ends = 0

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ends += 1


@pytest.mark.parametrize("make", STRATEGIES)
def test_terminate_on_nan_stops_after_the_first_bad_batch_and_the_csv_says_na_for_the_rest(make, tmp_path, capsys):
    model, optimizer = build(make())
    batches = data()
    batches[2] = (batches[2][0].clone(), batches[2][1].clone())
    batches[2][0][0, 0] = float("inf")
    seen = Batches()
    path = tmp_path / "log.csv"
    history = ds.fit(
        model,
        batches,
        optimizer=optimizer,
        loss="mse",
        epochs=4,
        verbose=0,
        validation_data=data(16),
        callbacks=[ds.callbacks.TerminateOnNaN(), seen, ds.callbacks.CSVLogger(str(path))],
    )
    assert seen.ends == [0, 1, 2] and seen.epoch_ends == 1 and history.epoch == [0]  # no batch after batch 2
    assert "Batch 2: Invalid loss, terminating training" in capsys.readouterr().out
    rows = list(csv.DictReader(path.open()))
    assert [r["epoch"] for r in rows] == ["0"] and rows[0]["loss"] == "nan"


def test_csv_logger_writes_every_epoch_in_sorted_columns_and_appends_under_one_header(tmp_path):
    model, optimizer = build(ds.get_strategy())
    path = tmp_path / "sub" / "log.tsv"
    history = ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=2,
        metrics=["mae"],
        verbose=0,
        validation_data=data(16),
        callbacks=[ds.callbacks.CSVLogger(str(path), separator="\t")],
    )
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch\tloss\tmae\tval_loss\tval_mae" and len(lines) == 3
    rows = list(csv.DictReader(path.open(), delimiter="\t"))
    assert [float(r["val_loss"]) for r in rows] == pytest.approx(history.history["val_loss"])
    assert [r["epoch"] for r in rows] == ["0", "1"]
    ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=1,
        metrics=["mae"],
        verbose=0,
        validation_data=data(16),
        callbacks=[ds.callbacks.CSVLogger(str(path), separator="\t", append=True)],
    )
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and lines.count(lines[0]) == 1  # appended, header kept once
    ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=1,
        verbose=0,
        callbacks=[ds.callbacks.CSVLogger(str(path))],
    )
    assert path.read_text().splitlines()[0] == "epoch,loss"  # append=False starts the file again


def test_on_two_workers_every_worker_stops_after_the_same_bad_batch_and_only_the_chief_writes_csv(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "fit_callbacks_worker.py"), str(tmp_path), timeout=120)
    assert code == 0, out
    # only worker 1's half of batch 2 holds the NaN; both stop after it, as TerminateOnNaN agrees across workers
    assert "[worker 0] DONE worker=0 batches=3 lr=[0.05] epochs=[0]" in out, out
    assert "[worker 1] DONE worker=1 batches=3 lr=[0.05] epochs=[0]" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log0.csv"]
    assert (tmp_path / "log0.csv").read_text().splitlines() == ["epoch,loss,lr", "0,nan,0.05"]


@pytest.mark.parametrize("make", STRATEGIES, ids=["default", "mirrored"])
def test_jsonl_logger_writes_step_lines_every_n_steps_beside_its_epoch_lines(make, tmp_path):
    import json

    strategy = make()
    model, optimizer = build(strategy)
    path = tmp_path / "metrics.jsonl"
    history = ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        metrics=["mae"],
        epochs=2,
        verbose=0,
        validation_data=data(16),
        callbacks=[ds.callbacks.JsonlLogger(str(path), log_every=4)],
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps, epochs = [r for r in rows if "step" in r], [r for r in rows if "step" not in r]
    assert [(r["step"], r["epoch"]) for r in steps] == [(4, 1), (8, 2), (12, 2)]  # 6 batches per epoch
    assert [(r["epoch"], r["steps"]) for r in epochs] == [(1, 6), (2, 12)]
    assert all(set(r) == {"step", "epoch", "loss", "mae", "seconds"} for r in steps)
    assert [r["val_loss"] for r in epochs] == pytest.approx(history.history["val_loss"])
    assert steps[2]["loss"] == pytest.approx(epochs[1]["loss"])  # the last step's running mean is the epoch's loss


def test_jsonl_logger_writes_every_nth_step_whatever_its_logs_and_refuses_a_negative_interval(tmp_path):
    import json

    path = tmp_path / "m.jsonl"
    logger = ds.callbacks.JsonlLogger(str(path), log_every=2)
    model, optimizer = build(ds.get_strategy())
    from distrib.keras.training import Loop

    logger.set_loop(Loop(model, optimizer, ds.get_strategy()))
    logger.on_epoch_begin(0)
    for batch in range(4):  # no special case for a loop that gives no logs: the step line is written all the same
        logger.on_train_batch_end(batch, {"loss": 1.0} if batch == 3 else None)
    logger.on_epoch_end(0, {"loss": 1.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [sorted(r) for r in rows[:2]] == [["epoch", "seconds", "step"], ["epoch", "loss", "seconds", "step"]]
    assert [r.get("step") for r in rows] == [2, 4, None] and rows[1]["loss"] == 1.0 and rows[2]["steps"] == 4
    with pytest.raises(ValueError, match=r"JsonlLogger\(log_every=-1\): give 0"):
        ds.callbacks.JsonlLogger(str(path), log_every=-1)
