"""Issue 10, A: user mistakes that used to train a wrong model silently. Each scenario prints what the
mistake would do to the model (the "before" figure, measured by doing the wrong thing on purpose) and
what distrib does now.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, launch
from torch import nn

import distrib as ds


def _mnist_like(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(5)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def _train(strategy: ds.Strategy, mean_loss: bool) -> list[torch.Tensor]:
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = per_example.mean() if mean_loss else ds.compute_average_loss(per_example, global_batch_size=16)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(_mnist_like()):
        strategy.run(step, args=batch)
    return [p.detach().clone() for p in model.parameters()]


def test_a_loss_averaged_per_replica():
    right = _train(ds.get_strategy(), mean_loss=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrong = _train(ds.MirroredStrategy(["cpu:0", "cpu:1"]), mean_loss=True)
    difference = max(float((a - b).abs().max()) for a, b in zip(right, wrong))
    warned = sum(issubclass(w.category, ds.UnscaledLossWarning) for w in caught)
    print(
        f"FAULT A.1 loss averaged per replica on 2 replicas: weights off by {difference:.3f} after 5 steps "
        f"(before: 0.197 in a pytorch/examples MNIST port, no warning); now {warned} UnscaledLossWarning"
    )
    assert difference > 1e-3 and warned == 1


@pytest.mark.parametrize("model_inside", [True, False])
def test_an_optimizer_built_outside_the_scope(model_inside):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    if model_inside:
        with strategy.scope():
            model = _model()
    else:
        model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()

    with pytest.raises(RuntimeError, match="built outside the strategy's scope") as raised:
        for batch in strategy.experimental_distribute_dataset(_mnist_like()):
            strategy.run(step, args=batch)
    unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    print(
        f"FAULT A.2 optimizer outside the scope (model {'inside' if model_inside else 'outside'}): "
        f"RuntimeError at the first step, parameters unchanged: {unchanged} (before: drift of 0.042 after 3 "
        f"steps, silently): {str(raised.value)[:80]}"
    )
    assert unchanged


def test_len_of_a_per_replica_value_and_a_sampler_split_twice():
    value = ds.MirroredStrategy(["cpu:0", "cpu:1"]).run(lambda: torch.ones(8))
    with pytest.raises(TypeError, match=r"\.values"):
        len(value)
    print("FAULT A.4 len(PerReplica): TypeError naming .values (before: 2, the replica count, read as a batch size)")


def test_mismatches_across_workers_and_a_distributed_sampler():
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_mismatch.py"), timeout=120)
    assert code == 0, out
    cases = [
        "reduce shapes",
        "reduce dtypes",
        "gather shapes",
        "model differs",
        "dataset ends early",
        "different global batches",
        "DistributedSampler",
    ]
    errors = sum(out.count(f"] OK {case}: ") for case in cases)
    print(
        f"FAULT A.3/A.7 mismatches between 2 workers: {len(cases)} cases x 2 workers, {errors} errors naming the "
        "mismatch, 0 aborts, 0 hangs (before: gloo abort, exit 134, or garbage on the other worker; "
        "a DistributedSampler trained on half the data)"
    )
    assert errors == 2 * len(cases) and "WRONG" not in out
