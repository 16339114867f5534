"""Keras 3 models (torch backend) under MirroredStrategy: every replica computes on its own copy, each gradient is
summed once, and a module whose ``forward`` distrib cannot reach is an error instead of a silent difference."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import distrib as ds
from distrib import context

keras = pytest.importorskip("keras")

GLOBAL_BATCH = 8


def seed_cnn() -> keras.Model:
    """The tutorial's CNN, smaller (an input shape given: the replicas' copies are made when the scope closes)."""
    return keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 12, 12, 1, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)


def split(strategy: ds.Strategy, value: torch.Tensor) -> object:
    n = strategy.num_replicas_in_sync
    return ds.PerReplica(tuple(value.chunk(n))) if n > 1 else value


def first_update(devices: list[str], call_sublayers: bool = False) -> list[torch.Tensor]:
    """Each trainable variable's change after one SGD step on the same global batch from the same weights."""
    strategy = ds.MirroredStrategy(devices)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = seed_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [v.value.detach().clone() for v in model.trainable_variables]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if call_sublayers:  # the layers called one by one, as a user's step may
            logits = x
            for layer in model.layers:
                logits = layer(logits)
        else:
            logits = model(x)
        loss = ds.compute_average_loss(
            nn.functional.cross_entropy(logits, y, reduction="none"), global_batch_size=GLOBAL_BATCH
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    x, y = batch()
    strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    return [v.value.detach() - b for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("call_sublayers", [False, True], ids=["model", "sublayers"])
def test_two_replicas_first_update_equals_one_replica_s(call_sublayers: bool) -> None:
    one = first_update(["cpu:0"], call_sublayers)
    two = first_update(["cpu:0", "cpu:1"], call_sublayers)
    assert all(d.abs().max() > 1e-4 for d in one)  # every variable moved
    worst = max((a - b).abs().max().item() for a, b in zip(one, two))
    assert worst <= 1e-6, f"largest difference of the first update: {worst}"


def test_each_keras_layer_is_distributed_once_as_part_of_its_model() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = seed_cnn()
    assert all(context.owner_of(layer) is strategy for layer in model.layers)
    # a second strategy may not take a layer of this model
    other = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="already distributed by another strategy"):
        other.distribute_module(model.layers[-1])


class _CallsWithoutForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x @ self.linear.weight.T + self.linear.bias


class _CallsSuper(_CallsWithoutForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return nn.Module.__call__(self, x)


def _train_once(make: type[nn.Module], devices: list[str]) -> torch.Tensor:
    strategy = ds.MirroredStrategy(devices)
    with strategy.scope():
        torch.manual_seed(0)
        module = make()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x = torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(2))

    def step(xb: torch.Tensor) -> None:
        loss = ds.compute_average_loss(module(xb).pow(2).sum(1), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()

    strategy.run(step, args=(split(strategy, x),))
    return module.linear.weight.detach().clone()


def test_a_module_whose_call_skips_forward_is_an_error_naming_it_and_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"_CallsWithoutForward defines its own __call__.*forward\(\)"):
        _train_once(_CallsWithoutForward, ["cpu:0", "cpu:1"])
    _train_once(_CallsWithoutForward, ["cpu:0"])  # one replica computes on the module itself: nothing to refuse


def test_a_call_override_that_reaches_forward_trains_as_one_replica() -> None:
    one = _train_once(_CallsSuper, ["cpu:0"])
    two = _train_once(_CallsSuper, ["cpu:0", "cpu:1"])
    torch.testing.assert_close(one, two, rtol=0, atol=1e-6)


def test_two_modules_sharing_a_parameter_are_an_error() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="shares 1 parameter"):
        with strategy.scope():
            embedding = nn.Embedding(10, 4)
            head = nn.Linear(4, 10, bias=False)
            head.weight = embedding.weight


def test_a_model_freed_leaves_no_parameters_behind_for_the_next_one_to_share() -> None:
    """The strategy knows its parameters by identity, weakly: a model built after an earlier one was freed (a loop
    that rebuilds the model in one scope, each restore of a checkpoint) may get the freed parameters' ids, and is
    still a model of its own, with copies of its own."""
    import gc

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    seen: set[int] = set()
    reused = False
    for _ in range(20):
        with strategy.scope():
            model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        ids = {id(p) for p in model.parameters()}
        reused = reused or bool(ids & seen)
        seen |= ids
        strategy.run(lambda m: m(torch.ones(4, 3)).sum().backward(), args=(model,))
        assert all(p.grad is not None for p in model.parameters())
        del model
        gc.collect()
    assert reused, "no id was reused in 20 models: the test did not try what it is for"


def test_import_distrib_does_not_import_keras() -> None:
    code = (
        "import sys, torch, distrib as ds\n"
        "s = ds.MirroredStrategy(['cpu:0', 'cpu:1'])\n"
        "with s.scope():\n"
        "    m = torch.nn.Linear(2, 2)\n"
        "s.run(lambda: m(torch.ones(1, 2)))\n"
        "assert 'keras' not in sys.modules, 'keras was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _CopiesReordered(nn.Module):
    """A module whose deep copy registers its parts in the other order (as keras 3.3's models did)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2)

    def __deepcopy__(self, memo: dict[int, object]) -> _CopiesReordered:
        clone = _CopiesReordered()
        clone._modules = {"second": copy.deepcopy(self.second, memo), "first": copy.deepcopy(self.first, memo)}
        return clone


def test_a_copy_whose_parameters_do_not_pair_with_the_module_s_is_an_error() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="its deep copy lists its parameters in another order"):
        with strategy.scope():
            module = _CopiesReordered()
    assert module.first.weight.grad is None  # built, and refused when the scope closed


def _moving_mean_after_one_step(devices: list[str]) -> torch.Tensor:
    strategy = ds.MirroredStrategy(devices)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        loss = ds.compute_average_loss(model(x, training=True).pow(2).sum(1), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()

    x = torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(5))
    x[GLOBAL_BATCH // 2 :] += 3.0  # the two replicas' halves have different means
    strategy.run(step, args=(split(strategy, x),))
    return model.layers[-1].moving_mean.value.detach().clone()


def test_batch_normalization_s_moving_mean_is_averaged_over_the_replicas() -> None:
    # as TF's mirrored variables of aggregation MEAN: the mean of the replicas' updates, here the global batch's
    one = _moving_mean_after_one_step(["cpu:0"])
    two = _moving_mean_after_one_step(["cpu:0", "cpu:1"])
    torch.testing.assert_close(one, two, rtol=0, atol=1e-6)


def _update_with_weight_decay(devices: list[str]) -> list[torch.Tensor]:
    strategy = ds.MirroredStrategy(devices)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        loss = ds.compute_average_loss(model(x).pow(2).sum(1), global_batch_size=GLOBAL_BATCH)
        # the penalty reads the model's own variables on every replica (replica 0's parameters)
        penalty = sum(v.value.pow(2).sum() for v in model.trainable_weights)
        (loss + ds.scale_regularization_loss(0.01 * penalty)).backward()
        optimizer.step()

    x = torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(6))
    strategy.run(step, args=(split(strategy, x),))
    return [v.value.detach().clone() for v in model.trainable_weights]


def test_a_penalty_on_the_model_s_own_variables_is_summed_once_per_replica() -> None:
    one, two = _update_with_weight_decay(["cpu:0"]), _update_with_weight_decay(["cpu:0", "cpu:1"])
    assert max((a - b).abs().max().item() for a, b in zip(one, two)) <= 1e-6
