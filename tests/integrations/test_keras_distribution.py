"""Keras 3's ``keras.distribution`` on torch through ``ds.experimental.keras_distribution``: real workers against one
process, and the errors.

tests/scripts/keras_mesh_train.py trains a Keras ``Sequential`` of three ``Dense`` layers for 20 Adam steps on gloo
workers and the same model in one process on each whole global batch (see its docstring). Keras' ``ModelParallel``
on a 2 x 2 mesh (the first kernel split over its outputs, ``(None, "model")``, the second over its inputs) and
``DataParallel`` on 2 workers must give every variable within 1e-5 of the one process, and the same losses; so must
Keras' own Adam over variables that ``ModelParallel`` splits (1 x 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import SCRIPTS, launch

keras = pytest.importorskip("keras")

import distrib as ds  # noqa: E402
from distrib.integrations import keras_distribution as kdist  # noqa: E402
from distrib.integrations import keras_layouts  # noqa: E402

SCRIPT = str(SCRIPTS / "keras_mesh_train.py")


def _train(tmp_path: Path, workers: int, *options: str) -> tuple[int, str, dict[str, object]]:
    out = tmp_path / "result.json"
    code, log, _ = launch("--workers", str(workers), SCRIPT, "--out", str(out), *options, timeout=240)
    return code, log, json.loads(out.read_text()) if out.exists() else {}


def test_model_parallel_on_a_2x2_mesh_equals_one_process(tmp_path: Path) -> None:
    code, log, got = _train(tmp_path, 4, "--mode", "model_parallel", "--checkpoint", str(tmp_path / "ckpt"))
    assert code == 0, log
    assert got["max_diff"] <= 1e-5, got["diffs"]
    assert got["losses"] == pytest.approx(got["ref_losses"], abs=1e-5)  # reduce counts each model-axis group once
    # Keras' kernel is (in, out) = (12, 16): (None, "model") splits the outputs, so each worker holds 12 x 8 and the
    # chief's part is the first 8 columns of the whole kernel
    assert got["kernel_shape"] == [12, 16] and got["local_shapes"] == [[12, 8]] * 4
    assert got["chief_part_is_columns"]
    assert got["param_types"] == ["DTensor", "Parameter"]  # the split layers' variables, the head's replicated ones
    assert "glibc's allocator" not in log  # the advice for FSDP's buffers: no FSDP here
    # ds.Checkpoint of the laid-out model: restored into one laid out again, and into a plain one-process model
    assert got["restored"] == {"laid_out": 0.0, "plain": 0.0}, got["restored"]
    print("ModelParallel 2x2, largest difference:", got["max_diff"])


def test_data_parallel_on_two_workers_equals_one_process(tmp_path: Path) -> None:
    code, log, got = _train(tmp_path, 2, "--mode", "data_parallel", "--optimizer", "torch")
    assert code == 0, log
    assert got["max_diff"] <= 1e-5, got["diffs"]
    assert got["losses"] == pytest.approx(got["ref_losses"], abs=1e-5)
    assert got["local_shapes"] == [[12, 16]] * 2 and got["param_types"] == ["Parameter"]
    print("DataParallel 2 workers, largest difference:", got["max_diff"])


def test_one_worker_lays_the_model_out_on_a_1x1_mesh_and_equals_one_process(tmp_path: Path) -> None:
    code, log, got = _train(tmp_path, 1, "--mode", "model_parallel", "--steps", "5")
    assert code == 0, log
    assert got["max_diff"] <= 1e-5, got["diffs"]
    assert got["param_types"] == ["DTensor", "Parameter"] and got["local_shapes"] == [[12, 16]]
    assert "splits no variable" not in log


def test_keys_that_match_no_variable_path_are_said(tmp_path: Path) -> None:
    code, log, got = _train(tmp_path, 1, "--mode", "model_parallel", "--steps", "5", "--keys", "unanchored")
    assert code == 0, log
    assert "ModelParallel splits no variable of Sequential 'mlp'" in log and "'mlp/dense_up/kernel'" in log, log
    assert got["param_types"] == ["Parameter"] and got["max_diff"] <= 1e-5  # replicated: right, only not split


def test_a_keras_optimizer_over_split_variables_equals_one_process(tmp_path: Path) -> None:
    # 1 x 2: both workers of one model-axis group; Keras' Adam updates DTensors from its whole slot variables
    code, log, got = _train(tmp_path, 2, "--mode", "model_parallel", "--optimizer", "keras")
    assert code == 0, log
    assert got["max_diff"] <= 1e-5, got["diffs"]
    assert got["local_shapes"] == [[12, 8]] * 2 and got["param_types"] == ["DTensor", "Parameter"]
    print("ModelParallel 1x2 with Keras' Adam, largest difference:", got["max_diff"])


def test_a_backward_outside_strategy_run_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    code, log, got = _train(tmp_path, 2, "--mode", "data_parallel", "--outside")
    assert code == 0, log
    message = got["outside"]
    assert "computed outside strategy.run" in message and "Keras' own model.fit" in message, message


# ----------------------------------------------------------------------------- one process: the mapping and its errors
def _mesh(shape: tuple[int, ...] = (2, 2), names: tuple[str, ...] = ("batch", "model")) -> object:
    return keras.distribution.DeviceMesh(shape, list(names), devices=[f"cpu:{i}" for i in range(4)])


def _model_parallel(**layouts: tuple[str | None, ...]) -> object:
    layout_map = keras.distribution.LayoutMap(_mesh())
    for key, layout in layouts.items():
        layout_map[key.replace("__", "/")] = layout
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _model() -> object:
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, name="dense_up"),
            keras.layers.Dense(3, name="dense_out"),
        ],
        name="net",
    )


def test_a_dense_kernel_layout_splits_keras_orientation() -> None:
    model = _model()
    planned = keras_layouts.plan_layouts(
        model,
        _model_parallel(net__dense_up__kernel=(None, "model"), net__dense_out__kernel=("model", None)),
        "model",
        2,
    )
    split = {item.path: item.split_dims for item in planned}
    # (in, out): (None, "model") splits dimension 1, the 8 outputs; ("model", None) dimension 0, the 8 inputs; each
    # split layer's other variables (the biases) join it replicated
    assert split == {
        "net/dense_up/kernel": (1,),
        "net/dense_out/kernel": (0,),
        "net/dense_up/bias": (),
        "net/dense_out/bias": (),
    }


@pytest.mark.parametrize(
    ("layouts", "words"),
    [
        ({".*conv.*kernel": (None, None, None, "model")}, ["'net/conv/kernel'", "Conv2D", "keras.layers.Dense"]),
        ({".*dense_up.*kernel": ("batch", None)}, ["'net/dense_up/kernel'", "batch axis 'batch'", "put None there"]),
        ({".*dense_up.*kernel": ("model",)}, ["'net/dense_up/kernel'", "1 entries", "one axis name"]),
        ({".*dense_out.*bias": ("model",)}, ["'net/dense_out/bias'", "(3)", "does not divide by the 2 workers"]),
    ],
)
def test_layouts_distrib_cannot_apply_are_errors_naming_the_variable_and_the_fix(
    layouts: dict[str, tuple[str | None, ...]], words: list[str]
) -> None:
    layout_map = keras.distribution.LayoutMap(_mesh())
    for key, layout in layouts.items():
        layout_map[key] = layout
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with pytest.raises(ValueError) as err:
        keras_layouts.plan_layouts(_model(), distribution, "model", 2)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_two_keys_matching_one_variable_are_keras_own_error() -> None:
    distribution = _model_parallel(**{".*dense_up.*": (None, "model"), ".*up/kernel": (None, "model")})
    with pytest.raises(ValueError, match="matches multiple layout"):
        keras_layouts.plan_layouts(_model(), distribution, "model", 2)


def test_batch_normalisation_layers_are_found_for_the_warning() -> None:
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2)]
    )
    assert keras_layouts.batch_statistics_layers(model) == ["'bn'"]
    assert keras_layouts.batch_statistics_layers(_model()) == []


def test_the_keras_mesh_becomes_distribs() -> None:
    mesh = kdist.device_mesh_of(_mesh((2, 2), ("data", "model")), "data")
    assert mesh.shape == (2, 2) and mesh.data_axes == ("data",) and mesh.model_axes == ("model",)
    with pytest.raises(ValueError, match="batch axis first"):
        kdist.device_mesh_of(_mesh((2, 2), ("model", "batch")), "batch")
    with pytest.raises(ValueError, match="one model axis at most"):
        kdist.device_mesh_of(
            keras.distribution.DeviceMesh((1, 2, 2), ["batch", "a", "b"], devices=[f"cpu:{i}" for i in range(4)]),
            "batch",
        )


def test_what_keras_distribution_refuses() -> None:
    with pytest.raises(TypeError, match="DataParallel"):
        ds.experimental.keras_distribution(object())
    sharded_by_hand = keras.distribution.DataParallel(device_mesh=_mesh((4,), ("batch",)), auto_shard_dataset=False)
    with pytest.raises(ValueError, match="distribute_datasets_from_function"):
        ds.experimental.keras_distribution(sharded_by_hand)


def test_list_devices_names_one_device_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert kdist.list_devices("cpu") == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert kdist.list_devices("gpu")[3] == "cuda:3"
    monkeypatch.delenv("WORLD_SIZE")
    assert len(kdist.list_devices()) == 1 and os.environ.get("WORLD_SIZE") is None
