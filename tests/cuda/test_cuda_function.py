"""``ds.function`` on a GPU (issue 28): the captured step trains exactly as the eager one, and what cannot be
captured runs eagerly with a message instead of crashing or training wrong.

The correctness matrix (strategy x feature, 50 Adam steps, see ``function_cases.py``) compares every
parameter, optimizer state tensor, the accuracy and every step's loss against the same run without
``ds.function``; cuDNN is deterministic, so the graph replays the eager kernels: fp32 must agree to 1e-6.
``DISTRIB_FUNCTION_TABLE=path`` appends each case's figures there (JSON lines) for docs/performance.md.
Under ``DISTRIB_CHECK_DEVICE=cpu`` the same cases run (eagerly: no CUDA graphs on a CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from function_cases import FEATURES, STRATEGIES, largest_difference, run_case  # tests/ is on sys.path

import distrib as ds

EAGER_FEATURES = {"fp16"}  # GradScaler.step reads the inf check on the host with a non-fused optimizer
#: against the eager run as built: ds.function makes torch's foreach Adam capturable (capturable=True), which
#: computes the same update in another order of float operations; Adam amplifies those roundings where gradients
#: are near zero, so parameters drift apart by up to ~lr x steps. A fused optimizer (the main job's, fp16_fused)
#: is the same kernel either way: exact. Measured figures: docs/performance.md
AS_BUILT_LOSS_TOLERANCE = 1e-2
EXACT_AS_BUILT = {"fp16_fused", "fp16"}  # fused: one kernel either way; fp16: eager, the optimizer left as built


@pytest.fixture(autouse=True)
def deterministic() -> None:
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("feature", FEATURES)
def test_function_trains_as_eager(device: torch.device, strategy: str, feature: str) -> None:
    if device.type == "cpu" and strategy != "one_device":
        pytest.skip("the CPU dry run: one strategy is enough to prove the code (every path is eager there)")
    steps = 50 if device.type == "cuda" else 11  # the CPU dry run: every path once (the ragged batch is the 10th)
    as_built = run_case(device, strategy, feature, use_function=False, steps=steps)
    eager = run_case(
        device, strategy, feature, use_function=False, steps=steps, capturable=feature not in EAGER_FEATURES
    )
    graphed = run_case(device, strategy, feature, use_function=True, steps=steps)
    diff = largest_difference(graphed, eager)
    diff_as_built = largest_difference(graphed, as_built)
    paths = graphed["paths"]
    table = os.environ.get("DISTRIB_FUNCTION_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(
                json.dumps(
                    {
                        "device": str(device),
                        "strategy": strategy,
                        "feature": feature,
                        **diff,
                        "as_built": diff_as_built,
                        "paths": paths,
                        "scale": graphed["scale"],
                    }
                )
                + "\n"
            )
    # the same kernels replayed: exact, in every precision; the schedule holds its rate in float32 (the
    # capturable optimizer's tensor) where the eager run's hand-written float write keeps a float64
    assert max(diff.values()) <= (1e-3 if feature == "schedule" else 1e-6), (diff, paths)
    if feature in EXACT_AS_BUILT:
        assert max(diff_as_built.values()) <= 1e-6, (diff_as_built, paths)
    assert diff_as_built["losses"] <= AS_BUILT_LOSS_TOLERANCE, (diff_as_built, paths)
    captured = [p for p in paths.values() if p.startswith("cuda_graph")]
    if device.type == "cuda" and feature not in EAGER_FEATURES:
        assert captured, f"nothing was captured: {paths}"
        assert len(paths) >= (3 if feature == "accumulate" else 2), paths  # the ragged batch is its own signature
    if device.type == "cuda" and feature in EAGER_FEATURES:
        assert any("wait for the GPU" in p for p in paths.values()), paths
    if feature.startswith("fp16"):
        assert graphed["scale"] == eager["scale"] < 2.0**8  # the poisoned step halved the scale in both


def test_host_copy_inside_the_step_runs_eagerly_with_the_reason(
    device: torch.device, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.tensor(v, device='cuda') inside a step would be read from freed host memory at every replay."""
    w = torch.zeros(3, device=device)

    @ds.function
    def step(x: torch.Tensor) -> torch.Tensor:
        w.add_(x * torch.tensor(2.0, device=x.device))
        return w.sum()

    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        results = [float(step(torch.ones(3, device=device))) for _ in range(5)]
    assert results == [6.0, 12.0, 18.0, 24.0, 30.0]
    if device.type == "cuda":
        (path,) = step.paths().values()
        # found by the last warm-up call (a blocking copy waits for the GPU) or, failing that, by the capture
        assert path.startswith("eager") and ("copies a CPU tensor" in path or "wait for the GPU" in path), path
        assert any(path[len("eager: ") :] in r.getMessage() for r in caplog.records)


def test_host_sync_inside_the_step_runs_eagerly(device: torch.device) -> None:
    w = torch.zeros(3, device=device)

    @ds.function
    def step(x: torch.Tensor) -> float:
        w.add_(x)
        return float(w.sum())  # .item(): a host sync, which a graph cannot hold

    assert [step(torch.ones(3, device=device)) for _ in range(5)] == [3.0, 6.0, 9.0, 12.0, 15.0]
    if device.type == "cuda":
        assert list(step.paths().values())[0].startswith("eager: the step makes the host wait for the GPU")


def test_outputs_are_copies_and_side_effects_run_at_capture(device: torch.device) -> None:
    w = torch.zeros((), device=device)
    printed: list[int] = []

    @ds.function
    def step(x: torch.Tensor) -> torch.Tensor:
        printed.append(1)  # a Python side effect: warm-up calls and the capture only
        w.add_(x.sum())
        return w * 1

    outs = [step(torch.ones(2, device=device)) for _ in range(6)]
    assert [float(o) for o in outs] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]  # each call's own value, kept
    if device.type == "cuda":
        assert len(printed) == 3  # 2 warm-up calls + the capture, then replays
        assert list(step.paths().values()) == ["cuda_graph (1 graph)"]


def test_eval_mode_is_another_graph(device: torch.device) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).to(device)

    @ds.function
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.ones(2, 4, device=device)
    for _ in range(4):
        forward(x)
    model.eval()
    assert torch.equal(forward(x), model[0](x).detach())  # dropout off: not the training graph replayed


def test_a_graph_keeps_alive_the_memory_it_replays_into(device: torch.device) -> None:
    """The cause of issue 28's crash, made harmless: the step reaches its model, optimizer and a running total
    through a dict that is emptied after the capture, so nothing of the user's holds them; the graph still writes
    into their tensors at every replay. It must hold them (else their memory is freed, handed back to the driver
    by the next ``empty_cache``, and the replay is an illegal memory access, or writes into another tensor), and
    go on replaying (the optimizer it steps is the one it was captured with, as a tf.function's variables)."""
    if device.type != "cuda":
        pytest.skip("a CUDA graph's memory: on the CPU the step runs eagerly and needs the objects it reads")
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(device)
    holder = {
        "model": model,
        "opt": torch.optim.Adam(model.parameters(), lr=0.1, capturable=True),
        "total": torch.zeros((), device=device),
    }
    del model

    @ds.function
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = holder["model"](x).square().mean()
        loss.backward()
        holder["opt"].step()
        holder["opt"].zero_grad()
        holder["total"].add_(loss.detach())
        return loss.detach()

    x = torch.randn(16, 8, device=device)
    losses = [float(step(x)) for _ in range(3)]  # 2 warm-up calls, then the capture
    assert list(step.paths().values()) == ["cuda_graph (1 graph)"]
    total = weakref.ref(holder["total"])  # held by nothing but the graph once the dict is emptied
    state = weakref.ref(holder["opt"].state[holder["model"].weight]["exp_avg"])
    holder.clear()
    gc.collect()
    torch.cuda.empty_cache()
    assert total() is not None and state() is not None, "memory the graph writes into was freed"
    junk = [torch.full((1 << 18,), float("nan"), device=device) for _ in range(16)]  # what would reuse freed memory
    losses += [float(step(x)) for _ in range(20)]
    torch.cuda.synchronize()
    del junk
    assert list(step.paths().values()) == ["cuda_graph (1 graph)"]  # replayed: no new capture (it would fail)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] / 2, losses  # still training
    running = total()
    assert running is not None and float(running) == pytest.approx(sum(losses), rel=1e-5)  # every call added


def test_two_captured_functions_replayed_in_turn_stay_exact() -> None:
    """The issue's crash: two whole-step graphs in one process (a plain step, one around OneDeviceStrategy.run)
    replayed in turn, as ``ds.function`` s, train as eager (by hand, with nothing left holding the first graph's
    model and optimizer, the next capture made its replay an illegal memory access: ``hand_then_hand_dropped``).
    ``benchmarks/capture_probe.py`` runs each scenario in its own process and reports how it ended."""
    if not torch.cuda.is_available():
        pytest.skip("the probe captures CUDA graphs")
    probe = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "capture_probe.py")
    out = subprocess.run(
        [sys.executable, probe, "--scenario", "function", "--steps", "200"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert result["max_difference_to_eager"] <= 1e-6, result
    assert all(p.startswith("cuda_graph") for p in result["paths"].values()), result


MWMS_NCCL_FUNCTION = """
import torch, torch.nn.functional as F, distrib as ds
from distrib.cluster import ClusterSpec, SimpleClusterResolver
from distrib.testing import pick_unused_port
torch.backends.cudnn.deterministic = True
resolver = SimpleClusterResolver(ClusterSpec({"worker": [f"127.0.0.1:{pick_unused_port()}"]}), "worker", 0)
options = ds.CommunicationOptions(implementation="nccl", timeout_seconds=60)
strategy = ds.MultiWorkerMirroredStrategy(resolver, options, devices=["cuda:0"])
print("blocker", strategy.graph_capture_blocker)

def build():
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)

    def replica(x, y):
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=64)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, lambda x, y: strategy.reduce("sum", strategy.run(replica, args=(x, y)), axis=None)

g = torch.Generator().manual_seed(0)
data = [(torch.randn(64, 32, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda()) for _ in range(4)]
(eager_model, eager), (graphed_model, step) = build(), build()
graphed = ds.function(step)
for i in range(30):
    a, b = eager(*data[i % 4]), graphed(*data[i % 4])
torch.cuda.synchronize()
print("paths", list(graphed.paths().values()))
print("diff", max(float((p - q).abs().max()) for p, q in zip(eager_model.parameters(), graphed_model.parameters())))
print("loss", float(a), float(b))
"""


def test_multi_worker_mirrored_over_nccl_is_captured(device, cuda_only) -> None:
    """MultiWorkerMirroredStrategy over NCCL, one worker per GPU: its all-reduce is captured with the step (one
    lent GPU holds one NCCL rank: a one-worker group, whose all-reduce NCCL still launches) and trains as eager."""
    out = subprocess.run([sys.executable, "-c", MWMS_NCCL_FUNCTION], capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, text
    assert "blocker None" in text and "paths ['cuda_graph (1 graph)']" in text, text
    diff = float(text.split("diff ")[1].split()[0])
    assert diff <= 1e-6, text


# The guards' tests of tests/graphs/test_guards.py, collected here again: on a GPU they run with real CUDA graphs
# (the fixture below replaces the CPU stand-in: the CUDA backend, and tensors made on the GPU).
from graphs.test_guards import (  # noqa: E402
    messages_said_anew,  # noqa: F401 - its autouse fixture
    test_a_decision_on_the_host_inside_the_step_runs_eagerly_naming_the_line,  # noqa: F401
    test_a_metric_reset_that_swaps_its_tensors_is_seen_and_captured_again,  # noqa: F401
    test_a_model_and_optimizer_rebuilt_and_rebound_are_the_ones_trained,  # noqa: F401
    test_a_per_step_schedule_outside_the_step_with_adam_stays_live_in_one_graph,  # noqa: F401
    test_a_per_step_schedule_outside_the_step_with_sgd_runs_eagerly_naming_the_rate,  # noqa: F401
    test_a_scheduler_stepped_inside_the_step_runs_eagerly_naming_its_line,  # noqa: F401
    test_a_storage_swapped_under_a_parameter_is_seen,  # noqa: F401
    test_freezing_and_unfreezing_layers_is_part_of_the_guard,  # noqa: F401
    test_one_cycle_rewriting_adams_betas_runs_eagerly_naming_the_betas,  # noqa: F401
    test_out_of_place_buffer_update_inside_the_step_runs_eagerly_naming_it,  # noqa: F401
    test_past_max_captures_paths_says_eager_and_the_real_reason,  # noqa: F401
)


@pytest.fixture
def stand_in(device: torch.device, cuda_only: None) -> Any:
    """No stand-in: the CUDA backend itself, with every tensor the test makes on the GPU."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield None
    finally:
        torch.set_default_device(previous)


def _graph_pool_reserved(shared: bool) -> dict[str, float]:
    """GiB the caching allocator reserves for one function's graphs: after the full batch's capture, then after the
    ragged batch's and evaluation's, with the function's shared pool or (``shared=False``) a private pool each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=True)

    def train(x: torch.Tensor, training: bool = True) -> torch.Tensor:
        if not training:  # evaluation: another signature (a Python argument), its own graph
            with torch.no_grad():
                return model(x).square().mean()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = ds.function(train)
    if not shared:
        step.pool = lambda: None  # type: ignore[method-assign]
    full = torch.randn(8192, 2048, device="cuda")
    ragged = full[:5000].clone()
    gib = 2.0**30
    for _ in range(2):
        step(full)  # warm-up calls: the eager caches exist before any graph
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved() / gib
    step(full)
    one = torch.cuda.memory_reserved() / gib - before
    for _ in range(3):
        step(ragged)
    model.eval()
    for _ in range(3):
        step(full, False)
    model.train()
    torch.cuda.synchronize()
    three = torch.cuda.memory_reserved() / gib - before
    return {"one_graph_gib": one, "three_graphs_gib": three, "paths": list(step.paths().values())}  # type: ignore[dict-item]


def test_the_graphs_of_one_function_share_a_memory_pool_on_the_gpu(device: torch.device, cuda_only: None) -> None:
    """Full batch, ragged last batch and evaluation: three graphs of one function in one pool reserve less than in
    three private pools, and not much more than one graph's (the figure goes to ``DISTRIB_FUNCTION_TABLE``)."""
    import gc

    private = _graph_pool_reserved(shared=False)
    gc.collect()  # the first run's graphs, model and optimizer go, and their memory back to the driver
    torch.cuda.empty_cache()
    shared = _graph_pool_reserved(shared=True)
    table = os.environ.get("DISTRIB_FUNCTION_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(json.dumps({"memory_pool": {"shared": shared, "private": private}}) + "\n")
    assert all(p.startswith("cuda_graph") for p in shared["paths"]), shared  # type: ignore[union-attr]
    assert shared["three_graphs_gib"] < private["three_graphs_gib"], (shared, private)
    assert shared["three_graphs_gib"] <= 1.5 * shared["one_graph_gib"] + 0.05, (shared, private)
