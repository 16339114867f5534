"""ds.Checkpoint of a Keras 3 model and optimizer (torch backend): written under one strategy and number of workers,
restored under another, the resumed run equal to the uninterrupted one (parameters and the optimizer's state)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distrib as ds

keras = pytest.importorskip("keras")

from helpers import SCRIPTS, launch, run_bounded  # noqa: E402

SCRIPT = SCRIPTS / "keras_checkpoint.py"
_spec = importlib.util.spec_from_file_location("keras_checkpoint", SCRIPT)
assert _spec is not None and _spec.loader is not None
resume = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resume)

SAVED_AT = 5
_reference: dict[str, dict[str, Any]] = {}


def uninterrupted(optimizer_kind: str) -> dict[str, Any]:
    """All steps in one process without a strategy: what every resumed run must give."""
    if optimizer_kind not in _reference:
        _reference[optimizer_kind] = resume.train(None, optimizer_kind, resume.STEPS, None)
    return _reference[optimizer_kind]


def largest_difference(result: dict[str, Any], optimizer_kind: str) -> float:
    reference = uninterrupted(optimizer_kind)
    pairs = list(zip(reference["weights"], result["weights"])) + list(zip(reference["optimizer"], result["optimizer"]))
    assert len(result["optimizer"]) == len(reference["optimizer"]) > 2  # the slots, not only iterations and the rate
    return max((a.double() - b.double()).abs().max().item() for a, b in pairs)


def run_part(strategy_name: str, optimizer_kind: str, until: int, directory: Path, out: Path) -> dict[str, Any]:
    """Train up to ``until`` under ``strategy_name`` (restoring ``directory``'s latest), save; the chief's result."""
    if strategy_name == "multi-worker2":
        code, log, _ = launch(
            "--workers", "2", str(SCRIPT), "--strategy", "multi-worker", "--optimizer", optimizer_kind,
            "--until", str(until), "--dir", str(directory), "--out", str(out), timeout=60,
        )  # fmt: skip
        assert code == 0, log
        return torch.load(out)
    return resume.train(resume.make_strategy(strategy_name), optimizer_kind, until, str(directory))


@pytest.mark.parametrize(
    ("saved_under", "restored_under", "optimizer_kind"),
    [
        ("one-device", "mirrored2", "keras"),
        ("mirrored2", "multi-worker2", "keras"),
        ("multi-worker2", "one-device", "keras"),
        ("mirrored2", "one-device", "torch"),
    ],
)
def test_saved_under_one_strategy_resumed_under_another_equals_the_uninterrupted_run(
    saved_under: str, restored_under: str, optimizer_kind: str, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    run_part(saved_under, optimizer_kind, SAVED_AT, directory, tmp_path / "first.pt")
    assert ds.latest_checkpoint(str(directory)) is not None
    result = run_part(restored_under, optimizer_kind, resume.STEPS, directory, tmp_path / "second.pt")
    if optimizer_kind == "keras":
        assert int(result["optimizer"][0]) == resume.STEPS  # Keras' iterations: every step once, not per replica
    worst = largest_difference(result, optimizer_kind)
    print(f"RESUME {saved_under} -> {restored_under} ({optimizer_kind}): largest difference {worst:.2e}")
    assert worst <= 1e-6


def test_a_keras_optimizer_s_variables_are_in_the_checkpoint_and_restored(tmp_path: Path) -> None:
    keras.utils.clear_session()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(learning_rate=1e-2)
    model.zero_grad()
    model(torch.randn(4, 3)).square().sum().backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in model.trainable_weights], model.trainable_weights)
    checkpoint = ds.Checkpoint(model=model, optimizer=optimizer)
    assert checkpoint.optimizer is optimizer and checkpoint.objects["optimizer"] is optimizer
    path = checkpoint.save(str(tmp_path / "ckpt"))
    keras.utils.clear_session()
    again = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    fresh = keras.optimizers.Adam(learning_rate=1e-2)  # not built: restoring builds it over the model's variables
    ds.Checkpoint(model=again, optimizer=fresh).restore(path).assert_consumed()
    assert len(fresh.variables) == len(optimizer.variables) == 6
    for saved, restored in zip(optimizer.variables, fresh.variables):
        torch.testing.assert_close(restored.value, saved.value, rtol=0, atol=0)
    assert int(fresh.iterations.value) == 1


def test_an_optimizer_over_other_variables_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    keras.utils.clear_session()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    path = ds.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5)])
    wrong = keras.optimizers.Adam()
    wrong.build(other.trainable_variables)
    before = [v.value.clone() for v in wrong.variables]
    with pytest.raises(ds.CheckpointError, match="build the optimizer over the same trainable variables"):
        ds.Checkpoint(optimizer=wrong).restore(path).expect_partial()
    assert all(torch.equal(a, v.value) for a, v in zip(before, wrong.variables))
    unbuilt = keras.optimizers.Adam()
    with pytest.raises(ds.CheckpointError, match=r"optimizer.build\(model.trainable_variables\)"):
        ds.Checkpoint(optimizer=unbuilt).restore(path).expect_partial()


def test_a_keras_model_built_with_other_layer_names_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    keras.utils.clear_session()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    path = ds.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    second = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])  # sequential_1/dense_1 in this process
    with pytest.raises(ds.CheckpointError, match="clear_session"):
        ds.Checkpoint(model=second).restore(path)


LOAD_WITHOUT_DISTRIB = """
import os, sys
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy, torch
directory, probe_file = sys.argv[1], sys.argv[2]
probe = torch.load(probe_file)["input"].numpy()
model = keras.saving.load_model(os.path.join(directory, "model.keras"))
first = model.predict(probe, verbose=0)
for v in model.weights:
    v.assign(numpy.zeros(v.shape, v.dtype))
model.load_weights(os.path.join(directory, "model.weights.h5"))
second = model.predict(probe, verbose=0)
tutorial = keras.saving.load_model(os.path.join(directory, "tutorial", "model.keras")).predict(probe, verbose=0)
assert "distrib" not in sys.modules
torch.save({"model": torch.as_tensor(first), "weights": torch.as_tensor(second), "tutorial": torch.as_tensor(tutorial)},
           os.path.join(directory, "loaded.pt"))
"""


def test_model_save_on_every_worker_is_written_by_the_chief_and_loads_in_plain_keras(tmp_path: Path) -> None:
    directory, out = tmp_path / "saved", tmp_path / "chief.pt"
    code, log, _ = launch(
        "--workers", "2", str(SCRIPTS / "keras_save_worker.py"), "--dir", str(directory), "--out", str(out), timeout=60
    )  # fmt: skip
    assert code == 0, log
    # Keras really wrote on the chief every file, on worker 1 only its own copy at TF's temporary path (deleted)
    assert "WROTE worker=0 save=2 weights=1" in log and "WROTE worker=1 save=1 weights=0" in log, log
    assert sorted(p.name for p in directory.iterdir()) == ["model.keras", "model.weights.h5", "tutorial"]
    assert sorted(p.name for p in (directory / "tutorial").iterdir()) == ["model.keras"]
    loaded = run_bounded([sys.executable, "-c", LOAD_WITHOUT_DISTRIB, str(directory), str(out)], timeout=60, fresh=True)
    assert loaded[0] == 0, loaded[1]
    expected = torch.load(out)["predictions"]
    for kind, predictions in torch.load(directory / "loaded.pt").items():
        worst = (predictions - expected).abs().max().item()
        print(f"LOADED without distrib ({kind}): largest prediction difference {worst:.2e}")
        assert worst <= 1e-6, kind


def test_saving_in_one_process_keeps_keras_own_answer_for_a_path_without_its_suffix() -> None:
    from distrib.integrations import keras_saving

    keras.utils.clear_session()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="extension"):  # one process: Keras' own error, as without distrib
        keras_saving.save_model(model, "model.bin")


def test_a_preempted_keras_custom_loop_resumes_exactly(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    code, log, _ = launch(
        "--workers", "2", "--max-restarts", "0", str(SCRIPT), "--strategy", "multi-worker", "--optimizer", "keras",
        "--until", str(resume.STEPS), "--dir", str(tmp_path / "ckpt"), "--preempt-at", str(SAVED_AT),
        "--out", str(out), timeout=90,
    )  # fmt: skip
    assert code == 0, log
    # the first attempt saved at the run after the notice; the restarted group's handlers restored it
    assert log.count("START worker=") == 4 and log.count(f"run={SAVED_AT + 1}") == 2, log
    result = torch.load(out)
    assert int(result["optimizer"][0]) == resume.STEPS
    worst = largest_difference(result, "keras")
    print(f"PREEMPTED at run {SAVED_AT} on 2 workers, resumed: largest difference {worst:.2e}")
    assert worst <= 1e-6
