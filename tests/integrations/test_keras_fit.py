"""A Keras 3 model compiled in ``strategy.scope()`` and trained with ``ds.fit``: the parameters, the history,
``ds.evaluate`` and ``ds.predict`` equal to Keras' own ``model.fit`` / ``evaluate`` / ``predict`` in one process on the
same global batches; what ``ds.fit`` cannot honour is an error naming the fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import distrib as ds

keras = pytest.importorskip("keras")

from helpers import SCRIPTS, launch  # noqa: E402

SCRIPT = SCRIPTS / "keras_fit.py"
_spec = importlib.util.spec_from_file_location("keras_fit_script", SCRIPT)
assert _spec is not None and _spec.loader is not None
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

_reference: dict[str, dict[str, Any]] = {}


def one_process(optimizer_kind: str) -> dict[str, Any]:
    """Keras' own fit (Keras optimizer), or ds.fit without a strategy (torch optimizer): what every strategy gives."""
    if optimizer_kind not in _reference:
        _reference[optimizer_kind] = script.train("none" if optimizer_kind == "keras" else "one-device", optimizer_kind)
    return _reference[optimizer_kind]


def assert_same_training(result: dict[str, Any], optimizer_kind: str) -> float:
    reference = one_process(optimizer_kind)
    worst = max((a - b).abs().max().item() for a, b in zip(reference["weights"], result["weights"]))
    assert worst <= 1e-5, f"largest parameter difference after {script.EPOCHS * script.STEPS} steps: {worst}"
    assert sorted(result["history"]) == sorted(reference["history"]) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key, values in reference["history"].items():
        assert result["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    assert result["evaluate"] == pytest.approx(reference["evaluate"], rel=1e-5, abs=1e-6)
    assert result["predict"].shape == reference["predict"].shape == (script.GLOBAL_BATCH * script.STEPS, 10)
    torch.testing.assert_close(result["predict"], reference["predict"], atol=1e-5, rtol=1e-5)
    return worst


@pytest.mark.parametrize("optimizer_kind", ["keras", "torch"])
@pytest.mark.parametrize("strategy_name", ["one-device", "mirrored2"])
def test_a_compiled_keras_model_fits_as_keras_own_fit_in_one_process(strategy_name: str, optimizer_kind: str) -> None:
    assert_same_training(script.train(strategy_name, optimizer_kind), optimizer_kind)


@pytest.mark.parametrize(("workers", "optimizer_kind"), [(2, "keras"), (2, "torch"), (4, "keras")])
def test_a_compiled_keras_model_fits_on_several_workers_as_one_process(
    workers: int, optimizer_kind: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.pt"
    code, log, _ = launch(
        "--workers", str(workers), str(SCRIPT), "--strategy", "multi-worker", "--optimizer", optimizer_kind, "--out", str(out),
        timeout=120,
    )  # fmt: skip
    assert code == 0, log
    result = torch.load(out)
    assert_same_training(result, optimizer_kind)
    assert "Train with ds.fit(model, dataset" in result["own_fit"] and f"{workers} replicas" in result["own_fit"]


def test_keras_own_fit_over_several_replicas_is_an_error_naming_ds_fit_and_stays_keras_own_on_one() -> None:
    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = small_compiled(optimizer="sgd", loss="mse")
    x, y = torch.ones(8, 4), torch.zeros(8, 3)
    with pytest.raises(NotImplementedError, match=r"model.fit\(\) of Keras model .* over 2 replicas.*ds.fit\(model"):
        model.fit(x, y, verbose=0)
    with pytest.raises(NotImplementedError, match=r"model.train_on_batch\(\)"):
        model.train_on_batch(x, y)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(float(((model(x) - y) ** 2).mean()), rel=1e-5)
    with ds.OneDeviceStrategy("cpu").scope():
        alone = small_compiled(optimizer="sgd", loss="mse")
    assert len(alone.fit(x, y, verbose=0).history["loss"]) == 1


# --------------------------------------------------------------------------- what ds.fit cannot honour


def small_compiled(**compile_args: Any) -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(**compile_args)
    return model


DATA = [(torch.ones(4, 4), torch.zeros(4, 3))]


def test_keras_callback_objects_are_an_error_naming_ds_callbacks() -> None:
    model = small_compiled(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match=r"ds\.callbacks\.EarlyStopping"):
        ds.fit(model, DATA, callbacks=[keras.callbacks.EarlyStopping()], verbose=0)


def test_a_model_compiled_without_a_loss_or_optimizer_is_an_error_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"no loss; call model.compile\(loss=...\)"):
        ds.fit(small_compiled(optimizer="sgd"), DATA, verbose=0)
    uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"no optimizer; call model.compile\(optimizer=...\)"):
        ds.fit(uncompiled, DATA, loss="mse", verbose=0)


@pytest.mark.parametrize(
    ("compile_args", "match"),
    [
        ({"loss": "mse", "loss_weights": [2.0]}, "loss_weights"),
        ({"loss": keras.losses.MeanSquaredError(reduction="sum")}, "reduction='sum'"),
        ({"loss": ["mse", "mae"]}, "a loss per output"),
    ],
)
def test_compile_arguments_ds_fit_cannot_honour_are_errors(compile_args: dict[str, Any], match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        ds.fit(small_compiled(optimizer="sgd", **compile_args), DATA, verbose=0)


def test_a_keras_optimizer_with_mixed_precision_is_an_error_naming_a_torch_optimizer() -> None:
    with pytest.raises(ValueError, match=r"give ds.fit a torch.optim optimizer"):
        ds.fit(small_compiled(optimizer="sgd", loss="mse"), DATA, precision="bf16-mixed", verbose=0)


def test_a_keras_metric_object_keeps_its_name_and_a_foreign_one_is_an_error() -> None:
    model = small_compiled(optimizer="sgd", loss="mse", metrics=[keras.metrics.MeanAbsoluteError(name="m")])
    logs = ds.evaluate(model, DATA, return_dict=True, verbose=0)
    assert sorted(logs) == ["loss", "m"]
    assert logs["m"] == pytest.approx(float(keras.ops.mean(keras.ops.abs(model(DATA[0][0])))), rel=1e-6)
    with pytest.raises(ValueError, match=r"ds.metrics.MeanMetricWrapper"):
        ds.evaluate(small_compiled(loss="mse", metrics=[keras.metrics.AUC()]), DATA, verbose=0)


# --------------------------------------------------------------------------- callbacks


def test_callbacks_on_two_workers_write_once_and_a_resumed_run_ends_as_one_uninterrupted(tmp_path: Path) -> None:
    """ModelCheckpoint, BackupAndRestore, TensorBoard write on the chief only; the second run restores the first's
    backup (the Keras optimizer's slots too) and trains epoch 2 alone: Keras' own two-epoch fit's parameters."""
    script_path = str(SCRIPTS / "keras_fit_callbacks.py")
    for epochs in (1, 2):
        out = tmp_path / f"result{epochs}.pt"
        code, log, _ = launch("--workers", "2", script_path, str(tmp_path), str(epochs), str(out), timeout=120)
        assert code == 0 and log.count("DONE") == 2, log
    result = torch.load(tmp_path / "result2.pt")
    assert list(result["history"]["loss"]) == pytest.approx(one_process("keras")["history"]["loss"][1:], rel=1e-5)
    worst = max((a - b).abs().max().item() for a, b in zip(one_process("keras")["weights"], result["weights"]))
    assert worst <= 1e-5, worst
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert checkpoints == ["checkpoint", "weights-1.pt", "weights-2.pt"], checkpoints
    events = [p for p in (tmp_path / "logs").rglob("*") if p.name.startswith("events.out.tfevents")]
    assert len(events) == 2, events  # one file per run: the chief's
    assert not [p for p in tmp_path.rglob("*") if "workertemp" in p.name]


def test_early_stopping_on_a_keras_model_stops_as_keras_does() -> None:
    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = small_compiled(optimizer="sgd", loss="mse")
    stop = ds.callbacks.EarlyStopping(monitor="loss", min_delta=1e3, patience=1)
    history = ds.fit(model, DATA * 2, epochs=5, callbacks=[stop], verbose=0)
    assert history.epoch == [0, 1]


def test_learning_rate_scheduler_sets_a_keras_optimizer_s_rate() -> None:
    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = small_compiled(optimizer=keras.optimizers.SGD(learning_rate=0.4), loss="mse")
    schedule = ds.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2)
    history = ds.fit(model, DATA, epochs=3, callbacks=[schedule], verbose=0)
    assert history.history["lr"] == pytest.approx([0.2, 0.1, 0.05])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.05)


@pytest.mark.parametrize("adds", ["kernel_regularizer", "activity_regularizer"])
def test_a_model_that_adds_losses_is_an_error_not_trained_without_them(adds: str) -> None:
    """ds.fit computes the compiled loss: a regulariser's term left out would train another model, silently."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, **{adds: keras.regularizers.L2(0.1)})])
    model.compile(optimizer="sgd", loss="mse")
    before = [w.detach().clone() for w in model.parameters()]
    with pytest.raises(NotImplementedError, match=r"adds 1 loss term.*scale_regularization_loss"):
        ds.fit(model, DATA, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a step was applied without them"
