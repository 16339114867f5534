"""TF's custom loop with Keras 3 objects (torch backend) under the strategies: the same parameters as one process, the
metrics global, and TF's errors (with distrib's fix) for what a strategy cannot do right."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import distrib as ds

keras = pytest.importorskip("keras")

from helpers import SCRIPTS, launch  # noqa: E402

SCRIPT = SCRIPTS / "keras_custom_loop.py"
_spec = importlib.util.spec_from_file_location("keras_custom_loop", SCRIPT)
assert _spec is not None and _spec.loader is not None
loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop)

_reference: dict[str, dict[str, Any]] = {}


def one_process(optimizer_kind: str) -> dict[str, Any]:
    """The same loop without any strategy: the result every strategy must give."""
    if optimizer_kind not in _reference:
        _reference[optimizer_kind] = loop.train(None, optimizer_kind)
    return _reference[optimizer_kind]


def assert_same_training(result: dict[str, Any], optimizer_kind: str) -> None:
    reference = one_process(optimizer_kind)
    worst = max((a - b).abs().max().item() for a, b in zip(reference["weights"], result["weights"]))
    assert worst <= 1e-5, f"largest parameter difference after {loop.STEPS} steps: {worst}"
    assert result["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-6)
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)


@pytest.mark.parametrize("optimizer_kind", ["keras", "keras-adagrad", "torch"])
@pytest.mark.parametrize("strategy_name", ["one-device", "mirrored2"])
def test_the_tutorial_s_loop_trains_as_one_process(strategy_name: str, optimizer_kind: str) -> None:
    assert_same_training(loop.train(loop.make_strategy(strategy_name), optimizer_kind), optimizer_kind)


@pytest.mark.parametrize("optimizer_kind", ["keras", "torch"])
@pytest.mark.parametrize("workers", [2, 4])
def test_the_tutorial_s_loop_on_several_workers_trains_as_one_process(
    workers: int, optimizer_kind: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.pt"
    code, log, _ = launch(
        "--workers", str(workers), str(SCRIPT), "--strategy", "multi-worker", "--optimizer", optimizer_kind,
        "--out", str(out), timeout=240,
    )  # fmt: skip
    assert code == 0, log
    assert_same_training(torch.load(out), optimizer_kind)


# --------------------------------------------------------------------------- errors


def small_model() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def test_a_loss_that_averages_per_replica_is_tf_s_error_with_the_fix() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = small_model()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # sum_over_batch_size

    def step(x: torch.Tensor) -> torch.Tensor:
        return loss_object(torch.zeros(len(x), dtype=torch.long), model(x))

    with pytest.raises(ValueError, match=r"reduction=None \('none'\) or 'sum'.*compute_average_loss"):
        strategy.run(step, args=(ds.PerReplica((torch.ones(2, 4), torch.ones(2, 4))),))


def test_a_keras_model_built_outside_the_scope_is_an_error() -> None:
    model = small_model()
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match=r"built outside MirroredStrategy.scope\(\)"):
        strategy.run(lambda x: model(x), args=(ds.PerReplica((torch.ones(1, 4), torch.ones(1, 4))),))


def test_a_keras_model_without_its_input_shape_in_the_scope_is_an_error_naming_the_fix() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(3)])  # built on its first call: inside run, too late
    with pytest.raises(ValueError, match=r"keras.Input\(shape\)"):
        strategy.run(lambda x: model(x), args=(ds.PerReplica((torch.ones(1, 4), torch.ones(1, 4))),))


def test_a_metric_read_inside_run_is_an_error() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def step(p: torch.Tensor) -> torch.Tensor:
        return accuracy(torch.zeros(len(p)), p)  # update_state, then result()

    with pytest.raises(RuntimeError, match=r"result\(\) was read inside strategy.run"):
        strategy.run(step, args=(ds.PerReplica((torch.ones(2, 3), torch.ones(2, 3))),))


def test_metrics_updated_by_every_replica_count_every_example() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        mean = keras.metrics.Mean()

    def step(p: torch.Tensor, y: torch.Tensor) -> None:
        for _ in range(50):  # many small updates from both threads at once
            accuracy.update_state(y, p)
            mean.update_state(y.float())

    logits = torch.eye(3)[[0, 1, 2, 0]]
    labels = torch.tensor([0, 1, 0, 1])
    strategy.run(step, args=(ds.PerReplica((logits[:2], logits[2:])), ds.PerReplica((labels[:2], labels[2:]))))
    assert float(accuracy.result()) == pytest.approx(0.5)
    assert float(accuracy.count.value) == 200
    assert float(mean.result()) == pytest.approx(0.5)


def test_gradients_other_than_the_variables_own_with_several_local_replicas_are_an_error() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = small_model()
        optimizer = keras.optimizers.SGD(0.1)

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        grads = [v.value.grad * 0.5 for v in model.trainable_weights]  # clipped, scaled...
        optimizer.apply(grads, model.trainable_weights)

    with pytest.raises(ValueError, match=r"not the variables' own \(v.value.grad\)"):
        strategy.run(step, args=(ds.PerReplica((torch.ones(1, 4), torch.ones(1, 4))),))


def test_keras_on_another_backend_is_an_error_naming_keras_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # only the torch backend is installed here: keras is made to say it runs on JAX
    strategy = ds.OneDeviceStrategy("cpu")
    with strategy.scope():
        metric = keras.metrics.Mean()
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match=r"'jax' backend.*KERAS_BACKEND=torch"):
        strategy.run(lambda: metric.update_state(1.0))


def _one_sgd_update(strategy: ds.Strategy | None, hand_over: str) -> list[torch.Tensor]:
    """One SGD step of a small model on 4 examples, the optimizer reached through a dict or run's arguments."""
    with strategy.scope() if strategy is not None else loop._nothing():
        keras.utils.set_random_seed(0)
        model = small_model()
        optimizer = keras.optimizers.SGD(0.5)
    holder = {"optimizer": optimizer}

    def step(x: torch.Tensor, given: Any = None) -> None:
        model.zero_grad()
        ds.compute_average_loss(model(x).pow(2).sum(1), global_batch_size=4).backward()
        chosen = given if hand_over == "argument" else holder["optimizer"]
        chosen.apply([v.value.grad for v in model.trainable_weights], model.trainable_weights)

    x = torch.arange(16.0).reshape(4, 4) / 16
    if strategy is None:
        step(x, optimizer)
    else:
        strategy.run(step, args=(ds.PerReplica((x[:2], x[2:])), optimizer if hand_over == "argument" else None))
    return [v.value.detach().clone() for v in model.trainable_weights]


@pytest.mark.parametrize("hand_over", ["dict", "argument"])
def test_a_keras_optimizer_held_in_a_dict_or_given_to_run_is_met_too(hand_over: str) -> None:
    one = _one_sgd_update(None, hand_over)
    two = _one_sgd_update(ds.MirroredStrategy(["cpu:0", "cpu:1"]), hand_over)
    assert max((a - b).abs().max().item() for a, b in zip(one, two)) <= 1e-6
