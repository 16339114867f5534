"""ds.fit / evaluate / predict under every strategy; callbacks; TensorBoard."""

from __future__ import annotations

import os
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, launch, run_bounded

import distrib as ds


def data(n: int = 96, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2]
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def build(strategy: ds.Strategy) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)


def custom_loop(strategy: ds.Strategy, batches: list, epochs: int) -> list[torch.Tensor]:
    model, optimizer = build(strategy)

    def step(inputs):
        x, y = inputs
        loss = ds.compute_average_loss(F.mse_loss(model(x), y, reduction="none").mean(1), global_batch_size=16)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(epochs):
        for x in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(x,))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])])
def test_fit_gives_the_weights_of_the_equivalent_custom_loop(make):
    batches = data()
    expected = custom_loop(make(), batches, epochs=2)
    model, optimizer = build(make())
    history = ds.fit(model, batches, optimizer=optimizer, loss="mse", epochs=2, metrics=["mae"], verbose=0)
    for p, q in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)
    assert history.epoch == [0, 1] and len(history.history["loss"]) == 2
    assert history.history["loss"][1] < history.history["loss"][0]
    logs = ds.evaluate(model, batches, loss="mse", metrics=["mae"], return_dict=True)
    with torch.no_grad():
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        direct = F.mse_loss(model(x), y)
        assert logs["loss"] == pytest.approx(float(direct), rel=1e-5)
        torch.testing.assert_close(ds.predict(model, batches), model(x))


@pytest.fixture
def seed_003():
    """Seed 003's regression on an in-process cluster: (model, optimizer, features, labels)."""
    resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    try:
        strategy = ds.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(2, 1))
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
        yield model, optimizer, torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]]), torch.tensor([[0.3], [0.5], [0.7]])
    finally:
        ds.testing.stop_in_process_cluster(resolver)


def test_fit_under_an_in_process_parameter_server_cluster_lowers_the_loss_every_epoch(seed_003):
    model, optimizer, features, labels = seed_003
    history = ds.fit(
        model, [(features, labels)], optimizer=optimizer, loss="mse", epochs=5, steps_per_epoch=10, verbose=0
    )
    losses = history.history["loss"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    loss = ds.evaluate(model, [(features, labels)], loss="mse", steps=4)  # no metrics: Keras' scalar
    assert isinstance(loss, float) and loss < losses[0]
    with pytest.raises(ValueError, match="steps_per_epoch"):
        ds.fit(model, [(features, labels)], optimizer=optimizer, loss="mse")


def test_verbose_auto_is_a_bar_and_under_parameter_servers_a_line_per_epoch_as_keras(seed_003, capsys, monkeypatch):
    monkeypatch.setenv("DISTRIB_PROGRESS_INTERVAL", "0")  # on a pipe, verbose=1 writes a bar line at every step
    model, optimizer, features, labels = seed_003
    ds.fit(model, [(features, labels)], optimizer=optimizer, loss="mse", epochs=1, steps_per_epoch=3)
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out and re.search(r"^3/3 - \S+ - loss: ", out, re.M) and not re.search(r"^\d/3 \[", out, re.M)
    local, local_optimizer = build(ds.get_strategy())
    ds.fit(local, data(), optimizer=local_optimizer, loss="mse")
    assert re.search(r"^1/6 \[=", capsys.readouterr().out, re.M)  # elsewhere: the bar
    with pytest.raises(ValueError, match=r"verbose=3: expected 'auto', 0 \(silent\), 1 \(progress bar\) or 2"):
        ds.fit(local, data(), optimizer=local_optimizer, loss="mse", verbose=3)


class Recorder(ds.callbacks.Callback):
    """Every hook call, in order, as (hook, batch or epoch)."""

    def __init__(self, backup_dir: str = "") -> None:
        self.calls: list[tuple[str, object]] = []
        self.backup_dir = backup_dir
        self.backup_at_first_epoch_end: object = None
        self.train_end_logs: object = None

    def __getattribute__(self, name: str):  # record every on_* hook without writing each one
        if name.startswith("on_"):
            calls = object.__getattribute__(self, "calls")
            special = object.__getattribute__(self, "_special")

            def hook(*args: object) -> None:
                calls.append((name, args[0] if args and isinstance(args[0], int) else None))
                special(name, args)

            return hook
        return object.__getattribute__(self, name)

    def _special(self, name: str, args: tuple) -> None:
        if name == "on_epoch_end" and args[0] == 0 and self.backup_dir:
            self.backup_at_first_epoch_end = ds.latest_checkpoint(self.backup_dir)
        if name == "on_train_end":
            self.train_end_logs = args[0] if args else None

    def count(self, hook: str) -> int:
        return sum(1 for name, _ in self.calls if name == hook)

    def batches(self, hook: str) -> list[object]:
        return [i for name, i in self.calls if name == hook]


def test_under_parameter_servers_every_hook_fires_batch_ends_in_step_order_and_backups_are_mid_epoch(
    tmp_path, seed_003
):
    model, optimizer, features, labels = seed_003
    backup = str(tmp_path / "backup")
    recorder = Recorder(backup_dir=backup)
    ds.fit(
        model,
        [(features, labels)],
        optimizer=optimizer,
        loss="mse",
        epochs=3,
        steps_per_epoch=10,
        validation_data=[(features, labels)],
        validation_steps=2,
        verbose=0,
        callbacks=[ds.callbacks.BackupAndRestore(backup, save_freq=4, delete_checkpoint=False), recorder],
    )
    assert recorder.count("on_train_batch_end") == 30
    assert recorder.batches("on_train_batch_end") == list(range(10)) * 3  # in step order, every epoch
    assert recorder.count("on_train_batch_begin") == 30
    assert recorder.backup_at_first_epoch_end is not None  # written by save_freq=4, before the epoch ended
    assert recorder.count("on_test_batch_end") == 6 and recorder.count("on_test_end") == 3
    assert set(recorder.train_end_logs) == {"loss", "val_loss"}
    ds.predict(model, [features, features], callbacks=[recorder])
    assert recorder.batches("on_predict_batch_end") == [0, 1] and recorder.count("on_predict_end") == 1


@pytest.mark.parametrize("make", [ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])])
def test_every_hook_fires_under_synchronous_strategies(make):
    model, optimizer = build(make())
    recorder = Recorder()
    ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=2,
        validation_data=data(32),
        verbose=0,
        callbacks=[recorder],
    )
    assert recorder.batches("on_train_batch_end") == list(range(6)) * 2
    assert recorder.count("on_test_batch_end") == 4 and recorder.count("on_epoch_end") == 2
    assert set(recorder.train_end_logs) == {"loss", "val_loss"}
    out = ds.predict(model, data(32), callbacks=[recorder])
    assert out.shape == (32, 1) and recorder.batches("on_predict_batch_end") == [0, 1]
    assert [name for name, _ in recorder.calls if "predict" in name] == [
        "on_predict_begin",
        "on_predict_batch_begin",
        "on_predict_batch_end",
        "on_predict_batch_begin",
        "on_predict_batch_end",
        "on_predict_end",
    ]


def run_fit(*args: str, attempt: int = 0) -> tuple[int, str]:
    """fit_worker.py's exit code and output (stdout and stderr together)."""
    env = {**os.environ, "FIT_ATTEMPT": str(attempt), "TF_CONFIG": ""}
    code, out, _ = run_bounded([sys.executable, str(SCRIPTS / "fit_worker.py"), *args], timeout=120, env=env)
    return code, out


def test_backup_and_restore_after_a_kill_mid_epoch_resumes_at_the_exact_step(tmp_path):
    code, out = run_fit("--out", str(tmp_path / "plain.pt"))
    assert code == 0, out
    backup = str(tmp_path / "backup")
    code, out = run_fit("--out", str(tmp_path / "resumed.pt"), "--backup-dir", backup, "--kill-at", "8")
    assert code == -9, out  # killed in epoch 2 (5 steps per epoch), step 3
    assert os.path.isdir(backup)
    code, out = run_fit("--out", str(tmp_path / "resumed.pt"), "--backup-dir", backup, "--kill-at", "8", attempt=1)
    assert code == 0, out
    assert "Epoch 1/3" not in out and "Epoch 2/3" in out  # epoch 1 was not redone
    for a, b in zip(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "plain.pt")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not os.path.exists(backup)  # a finished fit deletes its backup


def test_tensorboard_writes_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, optimizer = build(ds.get_strategy())
    logdir = tmp_path / "tb"
    ds.fit(
        model,
        data(),
        optimizer=optimizer,
        loss="mse",
        epochs=2,
        metrics=["mae"],
        verbose=0,
        validation_data=data()[:2],
        callbacks=[ds.callbacks.TensorBoard(str(logdir))],
    )
    train = EventAccumulator(str(logdir / "train")).Reload()
    validation = EventAccumulator(str(logdir / "validation")).Reload()
    assert set(train.Tags()["scalars"]) == {"epoch_loss", "epoch_mae"}
    assert set(validation.Tags()["scalars"]) == {"epoch_loss", "epoch_mae"}
    assert [e.step for e in train.Scalars("epoch_loss")] == [0, 1]


@pytest.mark.parametrize("make", [ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])])
def test_tensorboard_writes_the_model_graph_by_default_and_writing_it_changes_no_result(make, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def train(write_graph: bool) -> list[torch.Tensor]:
        with make().scope():
            torch.manual_seed(1)
            model = torch.nn.Sequential(
                torch.nn.Linear(4, 8),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.5),
                torch.nn.BatchNorm1d(8),
                torch.nn.Linear(8, 1),
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(2)  # the dropout masks: tracing must draw none of them
        ds.fit(
            model,
            data(),
            optimizer=optimizer,
            loss="mse",
            epochs=2,
            verbose=0,
            callbacks=[ds.callbacks.TensorBoard(str(tmp_path / str(write_graph)), write_graph=write_graph)],
        )
        return [t.detach().clone() for t in model.state_dict().values()]  # BatchNorm's running stats included

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TracerWarning or other noise reaches the user
        traced = train(True)
    plain = train(False)
    for a, b in zip(traced, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    graph = EventAccumulator(str(tmp_path / "True" / "train")).Reload()
    ops = [node.op for node in graph.Graph().node]
    assert graph.Tags()["graph"] and ops.count("aten::linear") == 2 and "aten::batch_norm" in ops, ops
    assert not EventAccumulator(str(tmp_path / "False" / "train")).Reload().Tags()["graph"]


def test_tensorboard_histogram_freq_writes_every_weight_and_buffer_as_keras(tmp_path):
    """guide/migrate/tensorboard.ipynb: TensorBoard(log_dir=log_dir, histogram_freq=1) (before: a TypeError)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tensorboard_callback = ds.callbacks.TensorBoard(log_dir=str(tmp_path), histogram_freq=2)
    ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=3, verbose=0, callbacks=[tensorboard_callback])
    train = EventAccumulator(str(tmp_path / "train"), size_guidance={"histograms": 0}).Reload()
    floats = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    assert sorted(train.Tags()["histograms"]) == sorted(floats)  # num_batches_tracked (int64) has none
    last = train.Histograms("0.weight")[-1]
    assert [h.step for h in train.Histograms("0.weight")] == [0, 2] and last.histogram_value.num == 32
    assert last.histogram_value.min == pytest.approx(float(model[0].weight.detach().min()))
    with pytest.raises(ValueError, match="histogram_freq=-1"):
        ds.callbacks.TensorBoard(str(tmp_path), histogram_freq=-1)


def test_tensorboard_warns_once_and_trains_on_when_the_model_cannot_be_traced(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Untraceable(torch.nn.Linear):
        def forward(self, x):
            if torch.jit.is_tracing():  # what libraries whose models cannot be traced do
                raise RuntimeError("this model cannot be traced")
            return super().forward(x)

    model = Untraceable(4, 1)
    with pytest.warns(
        UserWarning,
        match=r"TensorBoard\(write_graph=True\): the graph of Untraceable could not be "
        r"traced .*this model cannot be traced.*pass write_graph=False",
    ) as record:
        history = ds.fit(
            model,
            data(),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss="mse",
            epochs=2,
            verbose=0,
            callbacks=[ds.callbacks.TensorBoard(str(tmp_path))],
        )
    assert len([w for w in record if "TensorBoard" in str(w.message)]) == 1 and history.epoch == [0, 1]
    train = EventAccumulator(str(tmp_path / "train")).Reload()
    assert not train.Tags()["graph"] and [e.step for e in train.Scalars("epoch_loss")] == [0, 1]


def test_tensorboard_under_parameter_servers_says_why_it_writes_no_graph(seed_003, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, optimizer, features, labels = seed_003
    with pytest.warns(
        UserWarning, match="no graph is written: under ParameterServerStrategy the model runs on the workers"
    ) as record:
        ds.fit(
            model,
            [(features, labels)],
            optimizer=optimizer,
            loss="mse",
            epochs=2,
            steps_per_epoch=3,
            verbose=0,
            callbacks=[ds.callbacks.TensorBoard(str(tmp_path))],
        )
    assert record[0].filename == __file__  # pointed at the user's fit
    train = EventAccumulator(str(tmp_path / "train")).Reload()
    assert not train.Tags()["graph"] and [e.step for e in train.Scalars("epoch_loss")] == [0, 1]


def test_on_two_workers_only_the_chief_writes_events_and_every_worker_prints_progress(tmp_path):
    code, out, _ = launch(
        "--workers",
        "2",
        str(SCRIPTS / "fit_worker.py"),
        "--out",
        str(tmp_path / "w.pt"),
        "--tensorboard",
        str(tmp_path / "tb"),
    )
    assert code == 0, out
    for worker in (0, 1):  # as tf.keras: fit shows its output on every worker (here verbose=2: a line per epoch)
        assert f"[worker {worker}] Epoch 3/3" in out and f"[worker {worker}] 5/5 - " in out, out
    assert (tmp_path / "tb" / "task0" / "train").is_dir()
    assert not (tmp_path / "tb" / "task1").exists()


def test_early_stopping_and_model_checkpoint(tmp_path):
    model, optimizer = build(ds.get_strategy())

    class Worse(ds.callbacks.Callback):  # a monitored value that never improves after epoch 1
        def on_epoch_end(self, epoch, logs=None):
            logs["bad"] = float(epoch)

    stop = ds.callbacks.EarlyStopping(monitor="bad", patience=2, mode="min")
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}"), monitor="loss", save_best_only=True)
    history = ds.fit(
        model, data(), optimizer=optimizer, loss="mse", epochs=10, verbose=0, callbacks=[Worse(), stop, save]
    )
    assert history.epoch == [0, 1, 2] and stop.stopped_epoch == 2
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-1.pt", "ckpt-2.pt", "ckpt-3.pt"]


# ---------------------------------------------------------------- evaluate's list, data shorter than asked (A.6)


def test_evaluate_gives_keras_list_in_compile_order_by_default_a_scalar_without_metrics_and_a_dict_if_asked():
    model, _ = build(ds.get_strategy())
    batches = data()
    logs = ds.evaluate(model, batches, loss="mse", metrics=["mae", "mse"], return_dict=True)
    assert list(logs) == ["loss", "mae", "mse"] and logs["loss"] == pytest.approx(logs["mse"])
    loss, mae, mse = ds.evaluate(model, batches, loss="mse", metrics=["mae", "mse"])  # Keras' return_dict=False
    assert [loss, mae, mse] == [logs["loss"], logs["mae"], logs["mse"]] and type(mae) is float
    with torch.no_grad():
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        assert mae == pytest.approx(float((model(x) - y).abs().mean()), rel=1e-5)  # numbers, not the keys
    alone = ds.evaluate(model, batches, loss="mse")
    assert isinstance(alone, float) and alone == pytest.approx(logs["loss"])
    assert ds.evaluate(model, batches, loss="mse", return_dict=False) == alone


@pytest.mark.parametrize("make", [ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])])
def test_empty_data_is_a_value_error_for_fit_evaluate_and_predict(make):
    model, optimizer = build(make())
    with pytest.raises(ValueError, match="fit: the data gave no batch"):
        ds.fit(model, [], optimizer=optimizer, loss="mse", epochs=2, verbose=0)
    with pytest.raises(ValueError, match="fit: the data gave no batch"):
        ds.fit(model, iter([]), optimizer=optimizer, loss="mse", steps_per_epoch=3, verbose=0)
    with pytest.raises(ValueError, match="evaluate: the data gave no batch"):
        ds.evaluate(model, [], loss="mse")
    with pytest.raises(ValueError, match="predict: the data gave no batch"):
        ds.predict(model, [])
    with pytest.raises(ValueError, match="the validation of fit: the data gave no batch"):
        ds.fit(model, data(), optimizer=optimizer, loss="mse", validation_data=[], verbose=0)


@pytest.mark.parametrize("make", [ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])])
def test_data_that_runs_out_warns_once_ends_the_epoch_and_records_no_epoch_of_zeros(make):
    model, optimizer = build(make())
    recorder = Recorder()
    with pytest.warns(UserWarning) as caught:
        history = ds.fit(
            model,
            iter(data()),
            optimizer=optimizer,
            loss="mse",
            epochs=3,
            steps_per_epoch=10,
            verbose=0,
            callbacks=[recorder],
        )
    messages = [str(w.message) for w in caught if "ran out of data" in str(w.message)]
    assert len(messages) == 1, messages
    assert "ran 6 of steps_per_epoch=10 steps (the data gave 6 batches)" in messages[0]
    assert history.epoch == [0] and recorder.count("on_train_batch_end") == 6 and history.history["loss"][0] > 0
    # without steps_per_epoch: a generator is read once, the second epoch gets nothing and training stops there
    with pytest.warns(UserWarning, match="epoch 2 of fit got no batch, after 6 in the epochs before"):
        history = ds.fit(model, (b for b in data()), optimizer=optimizer, loss="mse", epochs=3, verbose=0)
    assert history.epoch == [0] and len(history.history["loss"]) == 1
    # data that can be read again is read again: no warning, every step runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = ds.fit(model, data(), optimizer=optimizer, loss="mse", epochs=2, steps_per_epoch=10, verbose=0)
    assert history.epoch == [0, 1]
    with pytest.warns(UserWarning, match="evaluate ran 6 of steps=8 steps"):
        ds.evaluate(model, iter(data()), loss="mse", steps=8)
    with pytest.warns(UserWarning, match="predict ran 6 of steps=8 steps"):
        assert ds.predict(model, iter(data()), steps=8).shape == (96, 1)


def classes(n: int = 64, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def test_keras_metric_names_in_fit_give_the_same_values_on_one_and_two_replicas():
    names = ["accuracy", "sparse_categorical_accuracy", "sparse_top_k_categorical_accuracy"]
    results = []
    for make in (ds.get_strategy, lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])):
        strategy = make()
        with strategy.scope():
            torch.manual_seed(3)
            model = torch.nn.Linear(4, 3)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        top2 = ds.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")  # an object built outside the scope
        history = ds.fit(
            model,
            classes(),
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            epochs=2,
            metrics=[*names, top2],
            verbose=0,
        )
        assert top2.strategy is strategy
        results.append(history.history)
    assert set(results[0]) == {"loss", *names, "top2"}
    for key in results[0]:
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key
    assert results[0]["accuracy"] == results[0]["sparse_categorical_accuracy"]


def test_under_parameter_servers_data_that_runs_out_warns_and_empty_data_is_an_error(seed_003):
    model, optimizer, features, labels = seed_003

    def three_batches(input_context):
        return iter([(features, labels)] * 3)

    with pytest.warns(UserWarning, match="epoch 1 of fit ran 6 of steps_per_epoch=10 steps"):  # 2 workers x 3
        history = ds.fit(
            model,
            three_batches,
            optimizer=optimizer,
            loss="mse",
            epochs=3,
            steps_per_epoch=10,
            metrics=["mae"],
            verbose=0,
        )
    assert history.epoch == [0] and set(history.history) == {"loss", "mae"}
    with pytest.raises(ValueError, match="fit: the data gave no batch"):
        ds.fit(model, [], optimizer=optimizer, loss="mse", steps_per_epoch=4, verbose=0)
    history = ds.fit(
        model, [(features, labels)], optimizer=optimizer, loss="mse", epochs=2, steps_per_epoch=4, verbose=0
    )  # the cluster is still usable, and a dataset is read again from the start
    assert history.epoch == [0, 1]
    assert ds.evaluate(model, [(features, labels)], loss="mse", steps=2, metrics=["mae"], return_dict=False)[1] > 0
