"""``ds.function`` against the eager loops (issue 28): examples/s of the main job's step, medians of alternating rounds.

    PYTHONPATH=src python3 benchmarks/function_step.py [--device cuda|cpu] [--rounds 7] [--json out.json]

Loops at the seed's batch (64), data already on the device, fp32 (``benchmarks/gpu.py``'s builders):

* ``plain_eager``: the textbook PyTorch loop; ``plain_same_step``: the main job's step without a strategy;
* ``one_device``: the main job's ``strategy.reduce(strategy.run(train_step))`` under ``OneDeviceStrategy``, eager;
* ``one_device_function``: the same call decorated with ``@ds.function``;
* ``hand_graph``: the main job's step captured by hand (PyTorch's whole-network recipe, capturable Adam): the
  ceiling ``ds.function`` is held to (>= 0.97x). It runs in a process of its own, with ``plain_eager`` and
  ``one_device_function`` (captured before it) beside it: ``function_vs_hand_graph_same_process`` is the ratio
  of alternating rounds there. A hand-made graph captured before later captures in one process ended in an
  illegal memory access on an H100 and stopped every loop (``benchmarks/capture_probe.py``);
* ``compiled_model``: ``torch.compile`` of the model under ``one_device`` (``--compile``; minutes of compiling).

Then ``one_device`` against ``one_device_function`` at ``--large-batch`` (4096) and on a GPT-style decoder in bf16
(``--gpt``: layers, width, sequence, batch). On a CPU ``ds.function`` runs the step eagerly (it says so once), and
the figure to read is its ratio to ``one_device``. Output: a table and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# benchmarks/ is on sys.path
from gpu import Forever, Variant, compiled, device_batches, main_job, plain_eager, seeded_main_job_step
from torch import nn

import distrib as ds
from distrib import torch_patches
from distrib.app import models
from distrib.app.train import make_steps
from distrib.graphs.capturable import make_capturable

Step = Callable[[Any], None]


def function_job(
    device: torch.device, batch: int, compile_backend: str | None = None, mode: str = "auto"
) -> tuple[Step, ds.Strategy]:
    """The main job's OneDevice step under ``@ds.function`` (of a ``torch.compile`` d model with a backend)."""
    strategy = ds.OneDeviceStrategy(str(device))
    train_step = seeded_main_job_step(strategy, batch, compile_backend)
    total = torch.zeros((), device=device)

    @ds.function(mode=mode)
    def distributed_train_step(b: Any) -> torch.Tensor:
        return strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(b,)), axis=None)

    def step(b: Any) -> None:
        total.add_(distributed_train_step(b))

    step.function = distributed_train_step  # type: ignore[attr-defined]
    return step, strategy


def hand_graph(
    device: torch.device, batch: int, first: tuple[torch.Tensor, torch.Tensor], keep_alive: bool = True
) -> Step:
    """The main job's step (no strategy) captured by hand: 3 warm-up steps on a side stream, then replays (with
    cuBLAS's workspaces cleared around the capture, as ``ds.function`` does).

    The returned step holds the model, the optimizer and the metrics: the graph writes into their tensors at
    every replay, and nothing else holds them once this function returns. ``keep_alive=False`` is how this
    benchmark was until 2026-11-28 (``capture_probe.py``'s ``hand_then_hand_dropped``): their memory went back
    to the caching allocator while the graph kept writing into it, and the next capture's ``empty_cache`` handed
    it back to the driver, which made the next replay an illegal memory access (issue 28's crash)."""
    torch.manual_seed(0)
    model = models.fashion_mnist_cnn().to(device)
    opt = models.fashion_mnist_optimizer(model.parameters())
    make_capturable(opt)
    metrics = (ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean(), ds.metrics.SparseCategoricalAccuracy())
    train_step, _ = make_steps(model, opt, batch, *metrics)
    total = torch.zeros((), device=device)
    sx, sy = first[0].clone(), first[1].clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step((sx, sy))
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch_patches.clear_cublas_workspaces()  # without it, this graph's matmul workspace is freed under it by the
    with torch.cuda.graph(graph):  # next capture: an illegal memory access (benchmarks/capture_probe.py)
        loss = train_step((sx, sy)).detach()
    torch_patches.clear_cublas_workspaces()

    def step(b: Any) -> None:
        sx.copy_(b[0], non_blocking=True)
        sy.copy_(b[1], non_blocking=True)
        graph.replay()
        total.add_(loss)

    if keep_alive:
        step.keep_alive = (model, opt, metrics, train_step)  # type: ignore[attr-defined]
    return step


class Decoder(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm causal blocks, a tied head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        h = self.blocks(h, mask=self.mask[: ids.shape[1], : ids.shape[1]], is_causal=True)
        return self.norm(h) @ self.tok.weight.T


def gpt_job(
    device: torch.device, spec: tuple[int, int, int, int], use_function: bool, compile_backend: str | None = None
) -> tuple[Step, ds.Strategy]:
    layers, width, seq, batch = spec
    strategy = ds.OneDeviceStrategy(str(device))
    torch.manual_seed(0)
    with strategy.scope():
        model = Decoder(8192, width, layers, max(1, width // 64), seq)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    forward = compiled(model, compile_backend) if compile_backend else model
    total = torch.zeros((), device=device)

    def replica(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(ids[:, :-1])
            per_token = (
                F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
                .view(ids.shape[0], -1)
                .mean(1)
            )
        loss = ds.compute_average_loss(per_token, global_batch_size=batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def dist(ids: torch.Tensor) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(replica, args=(ids,)), axis=None)

    call = ds.function(dist) if use_function else dist

    def step(b: Any) -> None:
        total.add_(call(b))

    return step, strategy


def hand_graph_apart(args: argparse.Namespace) -> dict[str, Any]:
    """``--only hand_graph`` in a process of its own (with plain_eager, whose ratio carries the hand graph's rate
    into the main table, and one_device_function, compared with it in the same rounds)."""
    import subprocess
    import tempfile

    out = tempfile.mktemp(suffix=".json")
    cmd = [
        sys.executable,
        __file__,
        "--only",
        "hand_graph",
        "--device",
        args.device,
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--large-batch",
        "0",
        "--gpt",
        "",
        "--json",
        out,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
        return {
            "examples_per_s_median": result["examples_per_s_median"],
            "failed": result["failed"],
            "exit": proc.returncode,
        }
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=300, help="timed steps per loop per round at batch 64")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--large-batch", type=int, default=4096)
    p.add_argument("--large-steps", type=int, default=20)
    p.add_argument("--gpt", default="12,768,1024,8", help="layers,width,sequence,batch of the decoder; '' to skip")
    p.add_argument("--gpt-steps", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also torch.compile of the model (slow to compile)")
    p.add_argument(
        "--only",
        default=None,
        choices=["hand_graph", "large"],
        help="run the hand-made graph (and plain_eager, its anchor) alone: the main run does so in a "
        "process of its own, since a hand-made graph replayed after later captures can end in an "
        "illegal memory access that would stop every loop (benchmarks/capture_probe.py)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/function_step.py: CUDA is not available; --device cpu runs the CPU comparison")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    started = time.perf_counter()
    data, source = device_batches(device)
    small, large = args.batch, args.large_batch
    builders: dict[str, tuple[Callable[[], tuple[Step, ds.Strategy | None]], int, int]] = {
        "plain_eager": (lambda: (plain_eager(device, "fp32", None, small), None), small, args.steps),
        "plain_same_step": (lambda: main_job("plain_same_step", device, "fp32", None, small), small, args.steps),
        "one_device": (lambda: main_job("one_device", device, "fp32", None, small), small, args.steps),
        "one_device_function": (lambda: function_job(device, small), small, args.steps),
    }
    if cuda and args.only != "hand_graph":
        if args.compile:
            builders["compiled_model"] = (
                lambda: main_job("one_device", device, "fp32", "inductor", small),
                small,
                args.steps,
            )
    if large:
        builders[f"one_device/b{large}"] = (
            lambda: main_job("one_device", device, "fp32", None, large),
            large,
            args.large_steps,
        )
        builders[f"one_device_function/b{large}"] = (lambda: function_job(device, large), large, args.large_steps)
        if cuda and args.compile and args.only != "hand_graph":
            builders[f"compiled_model/b{large}"] = (
                lambda: main_job("one_device", device, "fp32", "inductor", large),
                large,
                args.large_steps,
            )
            # both: the compiled model's kernels, launched from one graph
            builders[f"compiled_model_function/b{large}"] = (
                lambda: function_job(device, large, "inductor"),
                large,
                args.large_steps,
            )
    gpt = tuple(int(v) for v in args.gpt.split(",")) if args.gpt else None
    gpt_data: Forever | None = None
    if gpt is not None:
        assert len(gpt) == 4, "--gpt layers,width,sequence,batch"
        g = torch.Generator().manual_seed(0)
        gpt_data = Forever([torch.randint(0, 8192, (gpt[3], gpt[2] + 1), generator=g).to(device) for _ in range(4)])
        builders["gpt_bf16/one_device"] = (lambda: gpt_job(device, gpt, False), gpt[3], args.gpt_steps)
        builders["gpt_bf16/one_device_function"] = (lambda: gpt_job(device, gpt, True), gpt[3], args.gpt_steps)
        if cuda and args.compile and args.only != "hand_graph":
            builders["gpt_bf16/compiled_model"] = (
                lambda: gpt_job(device, gpt, False, "inductor"),
                gpt[3],
                args.gpt_steps,
            )
    if args.only == "large":  # the batch-`--large-batch` loops alone
        builders = {k: v for k, v in builders.items() if k.endswith(f"/b{large}")}
    if args.only == "hand_graph":  # its own process: see --only
        first = data(small).batches[0]
        builders = {  # the ds.function step captured first: that order replays clean (capture_probe.py)
            "plain_eager": builders["plain_eager"],
            "one_device_function": builders["one_device_function"],
            "hand_graph": (lambda: (hand_graph(device, small, first), None), small, args.steps),
        }
    variants: dict[str, Variant] = {}
    steps: dict[str, int] = {}
    for name, (build, batch, n) in builders.items():
        source_data = gpt_data if name.startswith("gpt") and gpt_data is not None else data(batch)
        variants[name] = Variant(name, build, source_data, batch, warmup=4)
        steps[name] = n
        print(f"ready {name} ({variants[name].warmup_s:.1f}s){' FAILED' if variants[name].error else ''}", flush=True)
    for r in range(args.rounds):
        for name, v in variants.items():
            v.measure(steps[name], device)
        print(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - started:.0f}s", flush=True)
    med = {k: statistics.median(v.rates) for k, v in variants.items() if not v.error and v.rates}
    hand: dict[str, Any] = {}
    if cuda and not args.only:
        hand = hand_graph_apart(args)
        apart = hand.get("examples_per_s_median", {})
        if "hand_graph" in apart and "plain_eager" in med:
            med["hand_graph"] = apart["hand_graph"] * med["plain_eager"] / apart["plain_eager"]

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    apart_med = hand.get("examples_per_s_median", {})
    ratios = {
        # the bar of issue 28 (>= 0.97): both in one process, alternating rounds (the hand graph's process)
        "function_vs_hand_graph_same_process": (
            apart_med["one_device_function"] / apart_med["hand_graph"]
            if "one_device_function" in apart_med and "hand_graph" in apart_med
            else None
        ),
        "function_vs_eager_loop(plain_eager)": ratio("one_device_function", "plain_eager"),
        "function_vs_one_device_eager": ratio("one_device_function", "one_device"),
        "function_vs_plain_same_step": ratio("one_device_function", "plain_same_step"),
        "function_vs_hand_graph": ratio("one_device_function", "hand_graph"),
        "function_vs_compiled_model": ratio("one_device_function", "compiled_model"),
        f"function_vs_eager_b{large}": ratio(f"one_device_function/b{large}", f"one_device/b{large}"),
        f"function_vs_compiled_model_b{large}": ratio(f"one_device_function/b{large}", f"compiled_model/b{large}"),
        f"compiled_function_vs_compiled_model_b{large}": ratio(
            f"compiled_model_function/b{large}", f"compiled_model/b{large}"
        ),
        "gpt_bf16_function_vs_eager": ratio("gpt_bf16/one_device_function", "gpt_bf16/one_device"),
        "gpt_bf16_function_vs_compiled_model": ratio("gpt_bf16/one_device_function", "gpt_bf16/compiled_model"),
    }
    paths = {
        k: v.step.function.paths()
        for k, v in variants.items()  # type: ignore[attr-defined]
        if not v.error and hasattr(v.step, "function")
    }
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "data": source,
        "rounds": args.rounds,
        "steps_per_round": steps,
        "gpt": gpt,
        "examples_per_s_median": med,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "paths": paths,
        "failed": {k: v.error for k, v in variants.items() if v.error},
        "hand_graph_process": hand,
        "examples_per_s_all": {k: v.rates for k, v in variants.items() if v.rates},
        "total_s": time.perf_counter() - started,
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(f"\n{result['device']}, torch {torch.__version__}, data: {source}, medians of {args.rounds} rounds")
    print(f"{'loop':<36}{'examples/s':>12}")
    for name, v in variants.items():
        print(f"{name:<36}{med[name]:>12.0f}" if name in med else f"{name:<36}{'FAILED':>12}  {(v.error or '')[:80]}")
    print()
    for k, v in result["ratios"].items():
        print(f"{k:<44}{v:8.3f}")


if __name__ == "__main__":
    main()
