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
    assert sorted(result["history"]) == sorted(reference["history"]) == ["accuracy", "loss"]
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


@pytest.mark.parametrize("optimizer_kind", ["keras", "torch"])
def test_a_compiled_keras_model_fits_on_two_workers_as_one_process(optimizer_kind: str, tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    code, log, _ = launch(
        "--workers", "2", str(SCRIPT), "--strategy", "multi-worker", "--optimizer", optimizer_kind, "--out", str(out),
        timeout=120,
    )  # fmt: skip
    assert code == 0, log
    assert_same_training(torch.load(out), optimizer_kind)


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
