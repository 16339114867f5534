"""Mixed precision under every strategy: torch.autocast and torch.amp.GradScaler used as in plain PyTorch inside run.

The reference is the same script on one device (plain PyTorch: the default strategy does not touch the optimizer).
Clean steps must give its parameters (up to float16 rounding) and exactly its scale after every step; the global
batch of step POISONED carries a NaN in its last example, which lands on the last replica of the last worker: that
step must be skipped on every replica of every worker (parameters unchanged) and the scale halved everywhere. The
scaler's scale grows every 2 clean steps, so its growth tracker is checked too.
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import pytest
import torch
from helpers import SCRIPTS, launch
from torch import nn

import distrib as ds
from distrib.app.train import make_steps

_spec = importlib.util.spec_from_file_location("amp_train", SCRIPTS / "amp_train.py")
assert _spec is not None and _spec.loader is not None
amp_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(amp_train)

ATOL = 3e-4  # float16 rounding of sums split differently; training moves parameters by ~0.16, clipping by ~0.04


@pytest.fixture(scope="module")
def reference() -> dict:
    return {clip: amp_train.train(ds.get_strategy(), clip) for clip in (False, True)}


def assert_matches(result: dict, expected: dict) -> None:
    assert result["scales"] == expected["scales"]  # exactly: one decision per step, the same as on one device
    assert expected["scales"][amp_train.POISONED] == expected["scales"][amp_train.POISONED - 1] / 2
    for before, after in zip(result["before_poisoned"], result["after_poisoned"]):
        assert torch.equal(before, after)  # the poisoned step changed nothing
    for p, q in zip(result["params"], expected["params"]):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=ATOL)


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
        lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored2", "mirrored3", "central_storage2"],
)
def test_grad_scaler_in_run_equals_one_device_and_a_poisoned_replica_skips_the_step_everywhere(make, clip, reference):
    assert_matches(amp_train.train(make(), clip), reference[clip])


@pytest.mark.parametrize(
    "strategy,clip",
    [("multi-worker", True), ("multi-worker2", False)],
    ids=["2_workers_x_1_replica_bucketed", "2_workers_x_2_replicas"],
)
def test_two_worker_processes_agree_on_every_skip_and_scale(tmp_path, reference, strategy, clip):
    out = tmp_path / "amp.pt"
    code, text, _ = launch(
        "--workers",
        "2",
        str(SCRIPTS / "amp_train.py"),
        "--out",
        str(out),
        "--strategy",
        strategy,
        *(["--clip"] if clip else []),
        timeout=120,
    )
    assert code == 0, text
    scales = {
        int(w): eval(s) for w, s in re.findall(r"\[worker (\d)\] worker \d of 2, \d replicas: scales: (\[.*\])", text)
    }
    assert scales == {0: reference[clip]["scales"], 1: reference[clip]["scales"]}, text  # the same on both workers
    assert_matches(torch.load(out), reference[clip])


def test_a_scaler_used_outside_any_strategy_is_torch_s_own():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.full((2, 4), float("inf"))).sum()).backward()
    before = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(model.weight, before) and scaler.get_scale() == 4.0


def test_replicas_using_different_scalers_are_refused():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scalers = [torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")]

    def step(x: torch.Tensor) -> None:
        scaler = scalers[ds.get_replica_context().replica_id_in_sync_group]
        scaler.scale(ds.compute_average_loss(model(x).sum(1))).backward()
        scaler.step(optimizer)

    with pytest.raises(ValueError, match="different GradScalers"):
        for x in strategy.experimental_distribute_dataset([torch.ones(4, 4)]):
            strategy.run(step, args=(x,))


# ---------------------------------------------------------------------------------------------- fit, distrib train


class Recorder(nn.Module):
    """A small classifier that records the autocast state its forward pass ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return self.net(x)


def fit_data(poison: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = amp_train.batches()  # step POISONED has a NaN; replace it unless asked for
    if not poison:
        data[amp_train.POISONED][0][-1, 0] = 0.0
    return data


@pytest.mark.parametrize("precision,dtype", [("32", None), ("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_fit_runs_the_step_and_the_validation_under_the_precision_asked_for(precision, dtype):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        model = Recorder()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from distrib.precision import Precision

    slow = Precision.parse(precision).slow_here("cpu") is not None  # this CPU's measured verdict (cached)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = ds.fit(
            model,
            fit_data(),
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            epochs=2,
            validation_data=fit_data()[:2],
            verbose=0,
            precision=precision,
        )
    named_slow = [w for w in caught if "is the faster choice here" in str(w.message)]
    assert len(named_slow) == (1 if slow else 0), [str(w.message) for w in caught]  # once, naming the faster one
    assert set(model.seen) == {dtype}  # every replica, training and validation
    losses = history.history["loss"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


def test_fit_16_mixed_skips_a_step_with_nan_gradients_where_32_is_poisoned():
    def train(precision: str) -> list[torch.Tensor]:
        strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.fit(
                model,
                fit_data(poison=True),
                optimizer=optimizer,
                loss="sparse_categorical_crossentropy",
                verbose=0,
                precision=precision,
            )
        return [p.detach() for p in model.parameters()]

    assert all(torch.isfinite(p).all() for p in train("16-mixed"))
    assert not all(torch.isfinite(p).all() for p in train("32"))


def test_an_unknown_precision_names_the_argument_and_the_choices():
    model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"precision='fp8' .*'32'.*'bf16-mixed'.*'16-mixed'"):
        ds.fit(model, fit_data(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss="mse", precision="fp8")
    with pytest.warns(UserWarning, match="use precision='bf16-mixed'"):
        ds.evaluate(model, [(torch.ones(2, 8), torch.ones(2, 4))], loss="mse", precision="bf16")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_the_main_job_s_steps_autocast_and_16_mixed_skips_a_nan_batch(precision):
    model = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean(), ds.metrics.SparseCategoricalAccuracy()
    train_step, test_step = make_steps(model, optimizer, 12, *metrics, precision=precision)
    x, y = fit_data()[0]
    train_step((x, y))
    test_step((x, y))
    assert model.seen == [torch.bfloat16 if precision == "bf16-mixed" else torch.float16] * 2
    if precision == "16-mixed":
        before = [p.detach().clone() for p in model.parameters()]
        train_step((torch.full_like(x, float("nan")), y))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_distrib_train_precision_bf16_mixed_learns_on_two_replicas(idx_dir, tmp_path, capsys):
    from distrib.app.cli import main

    code = main(
        [
            "train",
            "--strategy",
            "mirrored",
            "--replicas",
            "2",
            "--epochs",
            "2",
            "--precision",
            "bf16-mixed",
            "--batch-size-per-replica",
            "32",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Using bfloat16 Automatic Mixed Precision (AMP)" in out
    accuracy = float(re.findall(r"Test Accuracy: ([\d.]+)", out)[-1])
    assert accuracy > 50.0  # the fake data is learnable: a broken update stays near 10 %
