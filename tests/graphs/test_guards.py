"""``ds.function``'s guards on the CPU stand-in for CUDA graphs (``standin.py``): what the graph assumes is checked.

Each case of the table of silent wrong results: a schedule inside or outside the step, ``requires_grad`` changed,
a random choice or a tensor read on the host, tensors replaced since the capture, the shared memory pool, the
path ``paths()`` reports. Each trains under ``ds.function`` beside the same step without it, and must end with the
same parameters (the graph's result is the eager one) or run eagerly with its reason; on the code before these
guards, each of them fails. ``tests/cuda/test_cuda_function.py`` runs them again on a GPU, with CUDA graphs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import distrib as ds
from distrib.graphs import step_function

STEPS = 12


@pytest.fixture(autouse=True)
def messages_said_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each message is logged once per process: here, once per test."""
    monkeypatch.setattr(step_function, "_said", set())


def model_and_data(seed: int = 0) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A small model and 3 batches, on torch's default device (``tests/cuda`` runs these tests on a GPU)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    on = torch.get_default_device()
    data = [
        (torch.randn(6, 4, generator=g, device="cpu").to(on), torch.randn(6, 2, generator=g, device="cpu").to(on))
        for _ in range(3)
    ]
    return model, data


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def paths_of(step: Any) -> list[str]:
    return list(step.paths().values())


def train_both(
    build: Callable[[], tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]],
    steps: int = STEPS,
    seed_host: Callable[[], None] = lambda: None,
) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """Train ``build()``'s model with its step eagerly, then another with it under ``ds.function``; ``build`` returns
    (model, step, after(i): what the loop does after step i). ``seed_host`` resets host random state before each."""
    results = []
    for wrap in (False, True):
        seed_host()
        model, step, after = build()
        stepper = ds.function(step) if wrap else step
        _, data = model_and_data()
        for i in range(steps):
            stepper(*data[i % len(data)])
            after(i)
        results.append((model, stepper))
    return results[0][0], results[1][0], results[1][1]


def adam_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


# ---------------------------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
def test_a_scheduler_stepped_inside_the_step_runs_eagerly_naming_its_line(stand_in, optimizer, caplog):
    """torch's scheduler fills a capturable optimizer's rate with a Python number: captured, that is a constant and
    the schedule would stop. The step runs eagerly (its rate keeps following the schedule), and the message names
    the scheduler and the line."""

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.7**i)
        inner = adam_step(model, opt)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = inner(x, y)
            scheduler.step()
            return loss

        return model, step, lambda i: None

    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        eager, graphed, step = train_both(build)
    assert largest_difference(eager, graphed) == 0.0
    (path,) = paths_of(step)
    assert path.startswith("eager: the step calls LambdaLR.step() at ") and "test_guards.py:" in path, path
    assert sum("LambdaLR.step()" in r.getMessage() for r in caplog.records) == 1


def test_a_per_step_schedule_outside_the_step_with_sgd_runs_eagerly_naming_the_rate(stand_in, caplog):
    """SGD takes its rate as a Python number, which a graph bakes in: a LambdaLR stepped after every call would be
    a new capture at every step. After two such recaptures the signature runs eagerly, saying it is SGD's lr."""

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
        return model, adam_step(model, opt), lambda i: scheduler.step()

    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        eager, graphed, step = train_both(build)
    assert largest_difference(eager, graphed) <= 1e-6
    (path,) = paths_of(step)
    assert path.startswith("eager: SGD's lr (param group 0) changes at nearly every call"), path
    assert step.captures <= 3, step.captures  # not one per step up to max_captures
    assert not any("retracing" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("schedule", ["LambdaLR", "OneCycleLR_fixed_momentum"])
def test_a_per_step_schedule_outside_the_step_with_adam_stays_live_in_one_graph(stand_in, schedule):
    """Adam takes a tensor rate: ds.function makes it one on the device, the scheduler fills it, and one graph
    replays with the rate of each step."""

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if schedule == "LambdaLR":
            scheduler: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.8**i)
        else:
            scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS, cycle_momentum=False)
        return model, adam_step(model, opt), lambda i: scheduler.step()

    eager, graphed, step = train_both(build)
    assert paths_of(step) == ["cuda_graph (1 graph)"]
    # capturable Adam orders its float operations differently from the eager one as built
    assert largest_difference(eager, graphed) <= 1e-5


def test_one_cycle_rewriting_adams_betas_runs_eagerly_naming_the_betas(stand_in):
    """OneCycleLR (cycle_momentum=True, its default) writes Adam's betas at every step; torch's capturable Adam
    reads tensor betas on the host, so betas stay baked in: the signature goes eager naming them and the fix."""

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
        return model, adam_step(model, opt), lambda i: scheduler.step()

    eager, graphed, step = train_both(build)
    (path,) = paths_of(step)
    assert path.startswith("eager: Adam's betas (param group 0) changes at nearly every call"), path
    assert "cycle_momentum=False" in path
    assert largest_difference(eager, graphed) <= 1e-5


# ------------------------------------------------------------------------------------------------------ requires_grad
def test_freezing_and_unfreezing_layers_is_part_of_the_guard(stand_in, caplog):
    """requires_grad_(False) on the first layer after 4 steps, back on after 8: the graph captured with it
    trainable must not replay (it would go on updating the frozen layer); one message says what changed."""

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)

        def after(i: int) -> None:
            if i in (3, 7):
                model[0].requires_grad_(i == 7)

        return model, adam_step(model, opt), after

    with caplog.at_level(logging.INFO, logger="distrib.function"):
        eager, graphed, step = train_both(build)
    assert largest_difference(eager, graphed) <= 1e-5
    assert paths_of(step) == ["cuda_graph (2 graphs)"]  # trainable and frozen: the first one replays again
    said = [r.getMessage() for r in caplog.records if "requires_grad of" in r.getMessage()]
    assert len(said) == 1 and "Linear.weight" in said[0], said


# ---------------------------------------------------------------------------------------------- host decisions
HOST_DECISIONS: dict[str, Callable[[torch.Tensor], bool]] = {
    "python_random": lambda x: random.random() < 0.5,
    "numpy_random": lambda x: bool(np.random.rand() < 0.5),
    "cpu_torch_rand_item": lambda x: torch.rand(()).item() < 0.5,
    "bool_of_a_tensor": lambda x: bool(x[0, 0] > 0),  # the batches' signs differ: so do the decisions
    "float_of_a_tensor": lambda x: float(x.mean()) > -0.1,
}


@pytest.mark.parametrize("decision", sorted(HOST_DECISIONS))
def test_a_decision_on_the_host_inside_the_step_runs_eagerly_naming_the_line(stand_in, decision, caplog):
    """LayerDrop-style: the host decides at each call whether a layer runs. Captured, the capture's decision would
    be replayed forever; the step runs eagerly, with the line that decided."""
    choose = HOST_DECISIONS[decision]

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            hidden = model[1](model[0](x))
            out = model[2](hidden if choose(x) else hidden * 0.0)  # the decision's line
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return model, step, lambda i: None

    def seed_host() -> None:
        random.seed(3)
        np.random.seed(3)
        torch.manual_seed(3)

    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        eager, graphed, step = train_both(build, seed_host=seed_host)
    assert largest_difference(eager, graphed) == 0.0
    (path,) = paths_of(step)
    assert path.startswith("eager: the step "), path
    assert "on the host" in path or "random" in path or "wait for the GPU" in path, path  # a GPU tensor: a sync
    if decision != "numpy_random":  # numpy's generators are compiled: seen by their state, without a line
        assert "test_guards.py:" in path, path


# ---------------------------------------------------------------------------------------------- replaced tensors
class EmaModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        self.ema = self.ema * 0.9 + out.detach().mean(0) * 0.1  # out of place: a new tensor at each call
        return out


def test_out_of_place_buffer_update_inside_the_step_runs_eagerly_naming_it(stand_in):
    """``self.ema = self.ema * m + x``: captured, every replay would start from the capture's ema again."""
    models = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = EmaModel()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        step = adam_step(model, opt)
        step = ds.function(step) if wrap else step
        _, data = model_and_data()
        for i in range(STEPS):
            step(*data[i % 3])
        models.append((model, step))
    (eager, _), (graphed, step) = models
    assert torch.equal(eager.ema, graphed.ema) and largest_difference(eager, graphed) == 0.0
    (path,) = paths_of(step)
    assert path.startswith("eager: the step itself replaces ") and "ema" in path, path


class Mean:
    """A metric whose reset() swaps in new tensors (as torchmetrics' does)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = torch.zeros(())
        self.count = torch.zeros(())

    def update(self, value: torch.Tensor) -> None:
        self.total.add_(value)
        self.count.add_(1)


def test_a_metric_reset_that_swaps_its_tensors_is_seen_and_captured_again(stand_in, caplog):
    """After reset() the graph would add into the old tensors: the new ones would stay 0. The check before the
    replay sees them replaced, warns once and captures again; the metric counts every step after the reset."""
    model, data = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    metric = Mean()
    inner = adam_step(model, opt)

    @ds.function
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = inner(x, y)
        metric.update(loss)
        return loss

    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        for i in range(6):
            step(*data[i % 3])
        metric.reset()
        losses = [float(step(*data[i % 3])) for i in range(6)]
    assert float(metric.count) == 6 and float(metric.total) == pytest.approx(sum(losses), rel=1e-6)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "metric.total" in said[0] and "captured again" in said[0], said
    assert paths_of(step) == ["cuda_graph (1 graph)"]


class Trainer:
    def __init__(self) -> None:
        self.build()

    def build(self) -> None:
        self.model, _ = model_and_data(seed=len(getattr(self, "built", [])))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.built = [*getattr(self, "built", []), self.model]

    @ds.function
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def test_a_model_and_optimizer_rebuilt_and_rebound_are_the_ones_trained(stand_in, caplog):
    """``self.model = new model``: the graph holds the old one; the new must train, not the old."""
    trainer = Trainer()
    _, data = model_and_data()
    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        for i in range(5):
            trainer.step(*data[i % 3])
        first = [p.detach().clone() for p in trainer.built[0].parameters()]
        trainer.build()
        fresh = [p.detach().clone() for p in trainer.model.parameters()]
        for i in range(5):
            trainer.step(*data[i % 3])
    assert all(torch.equal(a, b) for a, b in zip(first, trainer.built[0].parameters()))  # the old one rests
    assert not any(torch.equal(a, b) for a, b in zip(fresh, trainer.model.parameters()))  # the new one trains
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "Trainer.model" in said[0], said


@pytest.mark.parametrize("change", ["p.data", "module.to"])
def test_a_storage_swapped_under_a_parameter_is_seen(stand_in, change, caplog):
    """``p.data = ...`` and ``module.to(dtype)`` keep the Parameter objects and give them new storage: the graph
    would write into the old (freed, on a GPU). The storage check sees it, and training goes on as eager."""

    def build() -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int], None]]:
        model, _ = model_and_data()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)

        def after(i: int) -> None:
            if i == 5:
                if change == "p.data":
                    model[0].weight.data = model[0].weight.data.clone()
                else:
                    model.to(torch.float64).to(torch.float32)

        return model, adam_step(model, opt), after

    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        eager, graphed, step = train_both(build)
    assert largest_difference(eager, graphed) <= 1e-5
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "another storage" in said[0], said
    assert paths_of(step) == ["cuda_graph (1 graph)"]


# ------------------------------------------------------------------------------------------------ pool and paths
def test_the_graphs_of_one_function_share_one_memory_pool(stand_in):
    """The full batch's, the ragged batch's and evaluation's graphs get the same pool (torch's graph_pool_handle);
    a graph that leaves new .grad tensors behind (the first call of an accumulation) gets a private one. On the CPU
    only the pools handed to the captures can be checked; the memory figure is the GPU check's."""
    model, data = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    step = ds.function(adam_step(model, opt))
    ragged = (data[0][0][:4], data[0][1][:4])
    for batch in [data[0]] * 3 + [ragged] * 3:
        step(*batch)
    model.eval()
    for _ in range(3):
        step(*data[1])
    model.train()
    assert len(stand_in.pools) == 3 and stand_in.pools[0] is not None
    assert all(pool is stand_in.pools[0] for pool in stand_in.pools), stand_in.pools

    @ds.function
    def accumulate(x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x), y).backward()

    for _ in range(2):
        opt.zero_grad()
        for _ in range(2):
            accumulate(*data[0])
    opt.zero_grad()
    accumulate(*data[0])
    first_micro_batch = stand_in.pools[3]  # captured where .grad was None: it leaves new gradients
    assert first_micro_batch is None, stand_in.pools


def test_past_max_captures_paths_says_eager_and_the_real_reason(stand_in, caplog):
    """One graph allowed: eval mode then needs another, which runs eagerly; ``paths()`` must say so (not
    ``cuda_graph (1 graph)``) and the warning must name the change, not shapes or Python arguments."""
    model, data = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)

    @ds.function(max_captures=1)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x).detach()

    for _ in range(4):
        forward(data[0][0])
    assert paths_of(forward) == ["cuda_graph (1 graph)"]
    model.eval()
    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        out = forward(data[0][0])
    assert torch.equal(out, model(data[0][0]).detach())
    (path,) = paths_of(forward)
    assert path.startswith("eager: ") and "max_captures=1" in path and "train()/eval() mode" in path, path
    assert not any("retracing" in r.getMessage() for r in caplog.records)
    model.train()
    forward(data[0][0])
    assert paths_of(forward) == ["cuda_graph (1 graph)"]  # the graph of that state replays again
    del opt
