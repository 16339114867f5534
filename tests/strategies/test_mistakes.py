"""User mistakes that would train a wrong model become errors or warnings that name the fix (issue 10, A)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, launch

import distrib as ds


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mean_loss: bool):  # type: ignore[no-untyped-def]
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = F.mse_loss(model(x), y, reduction="none").mean(1)
        loss = per_example.mean() if mean_loss else ds.compute_average_loss(per_example, global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _data(strategy: ds.Strategy) -> list:
    return list(strategy.experimental_distribute_dataset([(torch.randn(8, 3), torch.randn(8, 1))]))


def test_a_loss_averaged_per_replica_warns_once_with_the_fix():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(ds.UnscaledLossWarning, match=r"2 times too large.*compute_average_loss"):
        for batch in _data(strategy) * 2:
            strategy.run(_step(model, optimizer, mean_loss=True), args=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in _data(strategy):  # warned once: not again
            strategy.run(_step(model, optimizer, mean_loss=True), args=batch)


def test_a_scaled_loss_and_the_explicit_opt_out_do_not_warn():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in _data(strategy):
            strategy.run(_step(model, optimizer, mean_loss=False), args=batch)
            strategy.run(
                _step(model, optimizer, mean_loss=True), args=batch, options=ds.RunOptions(loss_scaled_by_hand=True)
            )
    with warnings.catch_warnings():  # one replica: a mean is the same as sum / global batch
        warnings.simplefilter("error")
        one = ds.OneDeviceStrategy("cpu")
        with one.scope():
            m = torch.nn.Linear(3, 1)
            o = torch.optim.SGD(m.parameters(), lr=0.1)
        for batch in _data(one):
            one.run(_step(m, o, mean_loss=True), args=batch)


@pytest.mark.parametrize("model_inside", [True, False])
def test_an_optimizer_built_outside_the_scope_is_an_error_inside_run(model_inside):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    if model_inside:
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
    else:
        model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"built outside the strategy's scope.*Build the model and the optimizer"):
        for batch in _data(strategy):
            strategy.run(_step(model, optimizer, mean_loss=False), args=batch)
    assert torch.equal(model.weight.detach(), before)  # refused before any update


def test_len_of_a_per_replica_value_is_a_type_error_naming_values():
    value = ds.MirroredStrategy(["cpu:0", "cpu:1"]).run(lambda: torch.ones(4))
    with pytest.raises(TypeError, match=r"\.values"):
        len(value)
    assert len(value.values) == 2


def test_loss_helpers_refuse_the_cross_replica_context():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        with pytest.raises(RuntimeError, match="in cross replica context"):
            ds.compute_average_loss(torch.ones(2))
        with pytest.raises(RuntimeError, match="in cross replica context"):
            ds.scale_regularization_loss(torch.ones(2))
    with pytest.raises(ValueError, match="at least rank 1"):
        ds.compute_average_loss(torch.tensor(2.0), global_batch_size=4)


def test_mismatches_between_two_workers_are_errors_on_both():
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_mismatch.py"), timeout=120)
    assert code == 0, out
    assert "WRONG" not in out, out
    for worker in (0, 1):
        for case in (
            "reduce shapes",
            "reduce dtypes",
            "gather shapes",
            "model differs",
            "dataset ends early",
            "different global batches",
            "DistributedSampler",
        ):
            assert f"[worker {worker}] OK {case}: " in out, (case, out)
        assert f"[worker {worker}] done" in out
    assert re.search(
        r"OK reduce shapes: the value given to strategy.reduce differs between workers "
        r"\(worker 0: float32\[3\]; worker 1: float32\[4\]\)",
        out,
    )
    assert "OK model differs: the Linear built in strategy.scope() differs between workers (entry 0: " in out
    assert "ended after 2 global batches" in out
    assert "OK uneven reduce [1.0, 1.0, 1.0] gather 3 rows" in out
