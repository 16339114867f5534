"""``ds.ShardedStrategy``: real worker processes (distrib launch, gloo over loopback) against one process.

tests/scripts/sharded_train.py trains a small MLP for 20 Adam steps under the sharded strategy;
the parameters its chief writes (whole, through the checkpoint contract) must equal one process
trained on the global batch (fp32: 1e-5; ``mixed_precision="bf16-mixed"``: 0.05, bfloat16 compute
over 20 steps), at N = 2 and 4, ZeRO-3 and ZeRO-2, with gradient accumulation, clipping across
shards, an optimizer that took ``list(model.parameters())`` before the model was sharded, and workers
that built different initial weights (each takes its rows of the chief's, as MultiWorkerMirrored's
workers take the chief's values).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, launch

import distrib as ds

GLOBAL = 16


def _reference(
    steps: int = 20, clip: bool = False, scaler: bool = False, poison: int = -1
) -> tuple[dict[str, torch.Tensor], dict, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaler)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 1, generator=g)
        if i == poison:
            x[-1, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
            loss = (model(x).float() - y).pow(2).sum(1).sum() / GLOBAL
        grad_scaler.scale(loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad()
    return model.state_dict(), optimizer.state_dict(), grad_scaler.get_scale() if scaler else 0.0


CASES = {
    # name: (workers, script options, tolerance)
    "N2-zero3-listed-clip": (2, ["--listed", "--clip"], 1e-5),
    "N4-zero2-accumulate": (4, ["--zero2", "--accumulate", "--seed-by-rank"], 1e-5),  # the chief's initial values
    "N2-bf16-mixed": (2, ["--mixed", "bf16-mixed"], 5e-2),
    # float16 autocast + GradScaler; step 5's NaN is in worker 1's half only: both must skip it
    "N2-16-mixed-scaler-nan": (2, ["--scaler", "--poison", "5"], 1e-2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_training_equals_one_process_on_the_global_batch(case: str, tmp_path: Path) -> None:
    workers, options, tolerance = CASES[case]
    out = tmp_path / "final.pt"
    code, log, _ = launch(
        "--workers", str(workers), str(SCRIPTS / "sharded_train.py"), "--out", str(out), *options, timeout=240
    )
    assert code == 0, log
    local = [int(line.rsplit(",", 1)[1].split()[0]) for line in log.splitlines() if "local parameter elements" in line]
    assert len(local) == workers and sum(local) == 1377 and max(local) <= 1377 // workers + 64, local  # sharded
    got = torch.load(out, weights_only=True)
    poison = int(options[options.index("--poison") + 1]) if "--poison" in options else -1
    model, optimizer, scale = _reference(clip="--clip" in options, scaler="--scaler" in options, poison=poison)
    if "--scaler" in options:
        assert got["scale"] == scale == 512.0  # backed off once, on every worker as in one process
        assert f"worker 1: scale {scale}" in log and f"worker 0: scale {scale}" in log
    worst = max((got["model"][k] - v).abs().max().item() for k, v in model.items())
    assert worst <= tolerance, f"{case}: largest difference {worst:.3g}"
    if tolerance <= 1e-5:  # the optimizer state too, in torch's plain format (loads in plain PyTorch)
        assert got["optimizer"]["param_groups"][0]["params"] == optimizer["param_groups"][0]["params"]
        for i, state in optimizer["state"].items():
            assert torch.allclose(got["optimizer"]["state"][i]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-6)


def test_one_worker_shards_nothing_and_a_mean_loss_is_fine_with_one_replica() -> None:
    strategy = ds.ShardedStrategy(devices=["cpu"])
    assert strategy.num_workers == 1 and strategy.gradient_merge is None
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert type(model.weight) is torch.nn.Parameter and ds.context.owner_of(model) is strategy

    def step(x: torch.Tensor) -> None:
        torch.nn.functional.mse_loss(model(x), torch.zeros(4, 1)).backward()  # mean-reduced: fine with 1 replica
        optimizer.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error", ds.UnscaledLossWarning)
        strategy.run(step, args=(torch.ones(4, 3),))


def test_the_policy_names_a_missing_class_and_shards_bottom_up() -> None:
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="no module of class Block; its classes are Linear, Sequential"):
        ds.ShardingPolicy(module_classes=["Block"]).units(model)
    units = ds.ShardingPolicy(module_classes=[torch.nn.Linear, "Sequential"]).units(model)
    assert units[0] is model[0][0] and {id(u) for u in units} == {id(model[0][0]), id(model[0]), id(model[1])}
    assert [i for i, u in enumerate(units) if u is model[0]] > [0]  # the inner Linear before its Sequential
    assert ds.ShardingPolicy(min_params=20).units(model) == [model[0][0]]  # 20 parameters; the head has 10


def test_several_devices_per_process_are_refused() -> None:
    with pytest.raises(ValueError, match="one replica per worker process"):
        ds.ShardedStrategy(devices=["cpu:0", "cpu:1"])


def test_a_mixed_precision_it_does_not_take_is_an_error_listing_every_one_it_does() -> None:
    with pytest.raises(ValueError, match=r"give one of None, '32', 'bf16-mixed', '16-mixed'"):
        ds.ShardedStrategy(devices=["cpu"], mixed_precision="bf16")
    for accepted in (None, "32", "bf16-mixed", "16-mixed"):  # every value the message lists is taken
        ds.ShardedStrategy(devices=["cpu"], mixed_precision=accepted)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("how", ["dead", "hang"])
def test_a_dead_or_hung_peer_is_a_collective_error_within_the_timeout(how: str) -> None:
    """FSDP's all-gather and reduce-scatter run inside forward and backward: a peer that exits or stops answering
    there is a CollectiveError on the other worker within CommunicationOptions(timeout_seconds=5), not a hang."""
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "sharded_peer.py"), how, "5", timeout=120)
    assert code == 3, out
    line = next(line for line in out.splitlines() if "COLLECTIVE ERROR" in line)
    assert line.startswith("[worker 0]") and "a sharded step" in line, line
    assert float(line.split("after ")[1].split("s:")[0]) < 5 + 3.0, line
    # the first step's mean loss (several workers): one warning with the fix on each worker, not a silent N-fold error
    for worker in (0, 1):
        assert f"[worker {worker}] UNSCALED LOSS WARNINGS 1: " in out and "compute_average_loss" in out, out


# Checkpoints under the sharded strategy (2 -> 4 -> 1 workers, every other strategy, plain PyTorch, a crash,
# corruption, a hostile file): tests/checkpoint/test_checkpoint_matrix.py
