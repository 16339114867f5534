"""Where does a hand-made CUDA graph of a distrib step crash? (issue 28's segmentation fault, found out)

    python3 benchmarks/capture_probe.py --scenario all [--steps 300] [--json out.json]

Two steps train the seeds' CNN (batch 64, Adam(capturable=True), data on the GPU): ``A`` a plain PyTorch step,
``B`` the same step through ``OneDeviceStrategy("cuda:0").run`` with distrib's accuracy metric. Each scenario
runs in a process of its own; ``all`` reports how each ended (exit code, signal) and the largest difference
of each model's parameters from the same steps run eagerly (cuDNN deterministic):

* ``hand``: A and B captured by hand (PyTorch's recipe: 3 warm-up steps on a side stream, ``torch.cuda.graph``),
  then replayed in turn, as the issue's benchmark alternated its loops;
* ``hand_cleared``: the same, with cuBLAS's cached workspaces dropped right before and after each capture
  (``distrib.torch_patches.clear_cublas_workspaces``, what ``ds.function`` does);
* ``function``: A and B decorated with ``@ds.function``, called in turn;
* ``hand_host_tensor``: B captured by hand with ``torch.tensor(64.0, device="cuda")`` in the step (what the
  accuracy metric did before issue 28): torch refuses the copy from pageable memory while capturing.

Then where the illegal memory access of a hand-made graph replayed after later captures comes from
(``benchmarks/function_step.py`` once replayed its hand-made graph after the batch-4096 and GPT captures):
A is captured by hand (cuBLAS workspaces cleared around it) and replayed 4 times, then a third step ``C``
(B's, at batch 4096) is captured, then A is replayed for the remaining steps:

* ``later_function``: C captured by ``@ds.function`` (called 4 times);
* ``later_hand``: C captured by hand too (no distrib in the capture at all);
* ``later_hand_gpt``: a GPT-style decoder step (bf16 autocast, AdamW(capturable=True)) captured by hand as C;
* ``hand_then_function``: ``function_step.py``'s own pair: its hand-made graph of the main job's step captured
  first, then the main job's step under ``@ds.function`` (captured at its 3rd call), then both replayed in turn
  (on the H100: an illegal memory access at the first synchronize);
* ``function_then_hand``: the same two in the other order (on the H100: clean);
* ``hand_then_hand``: two hand-made graphs of that step (two models), the second captured after the first:
  whether ``ds.function`` is needed for the fault at all;
* ``hand_then_eager_function``: the ``@ds.function`` step with ``mode="eager"`` (its warm-up and optimizer
  changes, no capture);
* ``hand_then_function_no_clear``: no cuBLAS workspace cleared anywhere (neither the hand capture nor
  ``ds.function``'s);
* ``hand_then_function_sync``: a synchronize after every call, and which call failed first;
* ``hand_then_hand_dropped`` / ``hand_then_function_dropped``: as the benchmark's hand-made graph was made
  until 2026-11-28, with nothing holding its model, optimizer and metrics once captured (their memory freed
  while the graph writes into it: the cause of the crash); the other scenarios keep them;
* ``hand_then_function_blocking`` / ``_memcheck`` (``all`` only): ``hand_then_function_dropped`` under
  ``CUDA_LAUNCH_BLOCKING=1`` and under ``compute-sanitizer --tool memcheck`` (a few steps).

``--scenario`` takes one name, ``all``, or a comma-separated list; ``--parallel N`` runs N processes at once.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import distrib as ds
from distrib import torch_patches
from distrib.app import models
from distrib.graphs.capturable import make_capturable

SCENARIOS = ("hand", "hand_cleared", "function", "hand_host_tensor", "later_function", "later_hand", "later_hand_gpt")
LATER = ("later_function", "later_hand", "later_hand_gpt")
PAIRS = (
    "hand_then_function",
    "function_then_hand",
    "hand_then_hand",
    "hand_then_eager_function",
    "hand_then_function_no_clear",
    "hand_then_function_sync",
    "hand_then_hand_dropped",
    "hand_then_function_dropped",
)
#: how ``all`` also runs ``hand_then_function``: every kernel launched synchronously (the failing launch raises),
#: and under compute-sanitizer's memcheck (the faulting kernel and address), where it is installed
WRAPPED = ("hand_then_function_blocking", "hand_then_function_memcheck")
SCENARIOS = SCENARIOS + PAIRS
OPTIMIZERS: dict[torch.nn.Module, torch.optim.Optimizer] = {}  # each step's optimizer, by its model
BATCH = 64
Step = Callable[..., Any]


def data(device: torch.device, n: int = 8, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.rand(batch, 1, 28, 28, generator=g).to(device), torch.randint(0, 10, (batch,), generator=g).to(device))
        for _ in range(n)
    ]


def gpt_step(device: torch.device) -> tuple[Step, list]:
    """A GPT-style decoder step in bf16 (the benchmark's later capture), with its batches."""
    from function_step import Decoder  # benchmarks/ is this script's folder

    torch.manual_seed(0)
    model = Decoder(8192, 256, 4, 4, 256).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, capturable=True)

    def step(ids: torch.Tensor, _: Any = None) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    g = torch.Generator().manual_seed(1)
    return step, [(torch.randint(0, 8192, (8, 257), generator=g).to(device), None) for _ in range(2)]


def later_capture(name: str, device: torch.device) -> None:
    """Capture step C (see the module docstring) and run it a few times."""
    if name == "later_hand_gpt":
        c, big = gpt_step(device)
    else:
        c, _ = make_step(True, device)
        big = data(device, 2, 4096)
    if name == "later_function":
        fc = ds.function(c)
        for i in range(4):
            fc(*big[i % 2])
    else:
        replay_c = hand_capture(c, big, cleared=True)
        for i in range(3, 5):
            replay_c(i)


def make_step(through_run: bool, device: torch.device, host_tensor: bool = False) -> tuple[Step, torch.nn.Module]:
    """Step A (``through_run=False``: plain PyTorch) or B (through ``OneDeviceStrategy.run``, with a metric)."""
    strategy = ds.OneDeviceStrategy(str(device)) if through_run else None
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else ds.get_strategy().scope():
        model = models.fashion_mnist_cnn().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
        acc = ds.metrics.SparseCategoricalAccuracy() if through_run else None
    OPTIMIZERS[model] = opt

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = ds.compute_average_loss(F.cross_entropy(logits, y, reduction="none"), global_batch_size=BATCH)
        if host_tensor:
            loss = loss * (torch.tensor(64.0, device=x.device) / 64.0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if acc is not None:
            acc.update_state(y, logits)
        return loss

    if strategy is None:
        return replica_step, model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(replica_step, args=(x, y)), axis=None)

    return step, model


def hand_capture(step: Step, batches: list, cleared: bool) -> Callable[[int], None]:
    """PyTorch's whole-network recipe (steps 0-2 eager on a side stream, then capture); returns replay(i)."""
    sx, sy = batches[0][0].clone(), batches[0][1].clone() if batches[0][1] is not None else None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            step(*batches[i % len(batches)])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    if cleared:
        torch_patches.clear_cublas_workspaces()
    with torch.cuda.graph(g):
        step(sx, sy)
    if cleared:
        torch_patches.clear_cublas_workspaces()

    def replay(i: int) -> None:
        x, y = batches[i % len(batches)]
        sx.copy_(x)
        if sy is not None:
            sy.copy_(y)
        g.replay()

    return replay


def largest(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def pair(name: str, steps: int) -> dict[str, Any]:
    """The ``hand_then_*`` / ``function_then_hand`` scenarios: how the benchmark's two graphs end, in each order."""
    from function_step import function_job, hand_graph
    from gpu import device_batches

    device = torch.device("cuda", 0)
    if name == "hand_then_function_no_clear":
        torch_patches.clear_cublas_workspaces = lambda: None  # type: ignore[assignment]  # this process only
    batches = device_batches(device)[0](BATCH).batches
    keep = not name.endswith("_dropped")  # _dropped: the model, optimizer and metrics of the first graph let go
    made: dict[str, Callable[[Any], None]] = {}  # in the order of their captures
    if name == "function_then_hand":
        made["ds.function"] = function_job(device, BATCH)[0]
        for i in range(4):  # the 3rd call captures
            made["ds.function"](batches[i % len(batches)])
        made["hand"] = hand_graph(device, BATCH, batches[0])
    elif name.startswith("hand_then_hand"):
        made["hand"] = hand_graph(device, BATCH, batches[0], keep_alive=keep)
        made["second hand"] = hand_graph(device, BATCH, batches[0])
    else:
        made["hand"] = hand_graph(device, BATCH, batches[0], keep_alive=keep)
        mode = "eager" if name == "hand_then_eager_function" else "auto"
        made["ds.function"] = function_job(device, BATCH, mode=mode)[0]
        for i in range(4):
            made["ds.function"](batches[i % len(batches)])
    torch.cuda.synchronize()
    calls = 0
    order = sorted(made, key=lambda k: k == "hand")  # the hand-made graph replayed last in each turn, as before
    for i in range(steps):
        for label in order:
            made[label](batches[i % len(batches)])
            calls += 1
            if name == "hand_then_function_sync":
                try:
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    captured = list(made).index(label) + 1
                    raise RuntimeError(f"call {calls}, a replay of {label!r} (captured {captured}.) failed: {e}") from e
    torch.cuda.synchronize()
    paths = {k: v.function.paths() for k, v in made.items() if hasattr(v, "function")}  # type: ignore[attr-defined]
    return {"scenario": name, "max_difference_to_eager": None, "calls": calls, "order": list(made), "paths": paths}


def scenario(name: str, steps: int) -> dict[str, Any]:
    if name in PAIRS:
        return pair(name, steps)
    torch.backends.cudnn.deterministic = True
    device = torch.device("cuda", 0)
    batches = data(device)
    out: dict[str, Any] = {"scenario": name}
    (a, model_a), (b, model_b) = make_step(False, device), make_step(True, device, name == "hand_host_tensor")
    if name in LATER:
        replay_a = hand_capture(a, batches, cleared=True)
        for i in range(3, 7):
            replay_a(i)
        torch.cuda.synchronize()
        later_capture(name, device)
        torch.cuda.synchronize()
        for i in range(7, steps):
            replay_a(i)
    elif name in ("hand", "hand_cleared", "hand_host_tensor"):
        replay_a = hand_capture(a, batches, name == "hand_cleared")
        replay_b = hand_capture(b, batches, name == "hand_cleared")
        for i in range(3, steps):  # in turn, as a benchmark's alternating rounds
            replay_a(i)
            replay_b(i)
    else:
        fa, fb = ds.function(a), ds.function(b)
        for i in range(steps):
            fa(*batches[i % len(batches)])
            fb(*batches[i % len(batches)])
        out["paths"] = {**fa.paths(), **fb.paths()}
    torch.cuda.synchronize()
    (ra, ref_a), (rb, ref_b) = make_step(False, device), make_step(True, device)
    for i in range(steps):
        if name == "function" and i == 2:  # ds.function's settings from its capture on (after 2 warm-up calls)
            for model in (ref_a, ref_b):
                make_capturable(OPTIMIZERS[model])
        ra(*batches[i % len(batches)])
        rb(*batches[i % len(batches)])
    torch.cuda.synchronize()
    # the later scenarios train only A (B stays as built)
    out["max_difference_to_eager"] = (
        largest(model_a, ref_a) if name in LATER else max(largest(model_a, ref_a), largest(model_b, ref_b))
    )
    return out


def run_one(name: str, steps: int) -> dict[str, Any]:
    """One scenario in a process of its own: how it ended, its JSON line, its stderr's tail where it failed."""
    import os
    import shutil

    env = dict(os.environ)
    cmd = [sys.executable, __file__, "--scenario", name, "--steps", str(steps)]
    if name == "hand_then_function_blocking":
        env["CUDA_LAUNCH_BLOCKING"] = "1"
        cmd[3] = "hand_then_function_dropped"
    elif name == "hand_then_function_memcheck":
        sanitizer = shutil.which("compute-sanitizer") or next(
            (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None
        )
        if sanitizer is None:
            return {"scenario": name, "ended": "skipped: compute-sanitizer not found"}
        cmd = [
            sanitizer,
            "--tool",
            "memcheck",
            "--print-limit",
            "8",
            *cmd[:3],
            "hand_then_function_dropped",
            "--steps",
            "3",
        ]
    t0 = time.perf_counter()
    limit = 240 if name.endswith("memcheck") else 120
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as e:
        return {"scenario": name, "ended": f"timed out ({limit} s)", "stderr_tail": str(e.stderr)[-3000:]}
    ended = f"signal {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit {p.returncode}"
    row: dict[str, Any] = {"scenario": name, "ended": ended, "seconds": round(time.perf_counter() - t0, 1)}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if lines:
        row.update(json.loads(lines[-1]))
        row["scenario"] = name
    if p.returncode != 0 or name.endswith("memcheck"):
        row["stderr_tail"] = (p.stderr + p.stdout)[-3000:] if name.endswith("memcheck") else p.stderr[-3000:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="all", help="one of " + ", ".join(("all",) + SCENARIOS + WRAPPED))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=1, help="scenarios run at once (each its own process)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = list(SCENARIOS + WRAPPED) if args.scenario == "all" else args.scenario.split(",")
    unknown = [n for n in names if n not in SCENARIOS + WRAPPED]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}: use {', '.join(('all',) + SCENARIOS + WRAPPED)}")
    if len(names) == 1 and names[0] in SCENARIOS and args.scenario != "all":
        faulthandler.enable()
        print(json.dumps(scenario(names[0], args.steps)), flush=True)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        results = list(pool.map(lambda n: run_one(n, args.steps), names))
    for row in results:
        print(f"{row['scenario']:30s} {row['ended']:16s} max diff to eager: {row.get('max_difference_to_eager', '-')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for row in results:
        if "stderr_tail" in row:
            print(f"--- {row['scenario']} stderr ---\n{row['stderr_tail']}")


if __name__ == "__main__":
    main()
