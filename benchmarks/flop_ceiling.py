"""How close the main job's fp32 step is to this CPU's arithmetic ceiling (issue 12, item 3).

    python benchmarks/flop_ceiling.py [--rounds 7] [--steps 60] [--data-dir DIR] [--json out.json]

Counts the floating-point operations of one main-job training step (batch 64) with torch's
``FlopCounterMode``, measures the CPU's float32 matrix-multiply peak on all torch threads
(``torch.mm`` of 2048 x 2048 matrices, median of 7, before and after the loops), and times the main job's loop and the plain
eager loop of ``benchmarks/single_process.py`` on the same batches in alternating rounds. From
these: the GFLOP/s each loop reaches, the fastest step the same math could take at the matrix
peak (its FLOPs / peak), and the largest "main job / plain eager" ratio that ceiling allows.
A torch.profiler pass over the main job splits its step into the convolution and matrix kernels
(with their own GFLOP/s) and everything else (pooling, ReLU, layout copies, Adam, Python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from single_process import BATCH, load_data, main_job_loop, measure, plain_loop  # benchmarks/ is on sys.path
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from distrib.app import models
from distrib.app.train import TensorBatches

KERNELS = {  # profiler op -> FlopCounterMode op
    "aten::mkldnn_convolution": "convolution",
    "aten::convolution_backward": "convolution_backward",
    "aten::mm": "mm",
    "aten::addmm": "addmm",
}


def step_flops() -> dict[str, float]:
    """FLOPs of one main-job training step (forward and backward), by aten op."""
    model = models.fashion_mnist_cnn()
    x, y = torch.rand(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    with FlopCounterMode(display=False) as counter:
        (F.cross_entropy(model(x), y, reduction="sum") / BATCH).backward()
    return {str(op).split(".")[-1]: float(n) for op, n in counter.get_flop_counts()["Global"].items()}


def matmul_peak(n: int = 2048, repeats: int = 7) -> float:
    """The float32 ``torch.mm`` rate on all torch threads, GFLOP/s (median of ``repeats``)."""
    a, b, c = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)
    torch.mm(a, b, out=c)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def kernel_times(step: Any, batches: Any, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step of the main job's kernels, and of everything else."""
    it = iter(batches)
    for _ in range(3):
        step(next(it))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(next(it))
    per_step = {name: 0.0 for name in KERNELS}
    total = 0.0
    for event in prof.key_averages():
        total += event.self_cpu_time_total
        if event.key in per_step:
            per_step[event.key] += event.self_cpu_time_total
    out = {name: us / steps / 1e3 for name, us in per_step.items()}
    out["everything else"] = (total - sum(per_step.values())) / steps / 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    flops = step_flops()
    total_flops = sum(flops.values())
    images, labels, source = load_data(args.data_dir)
    data = TensorBatches(images, labels, batch_size=BATCH, shuffle=True, seed=0)
    main_step, strategy = main_job_loop(True, False)
    loops = {
        "plain_eager": (plain_loop(models.plain_fashion_mnist_cnn), data),
        "main_job": (main_step, strategy.experimental_distribute_dataset(data)),
    }
    rates: dict[str, list[float]] = {name: [] for name in loops}
    peaks: list[float] = []
    load_before = os.getloadavg()[0]
    peaks.append(matmul_peak())
    for r in range(args.rounds):
        data.set_epoch(r)
        for name, (step, batches) in loops.items() if r % 2 == 0 else reversed(loops.items()):
            rates[name].append(measure(step, batches, args.steps))
    peaks.append(matmul_peak())  # before and after the loops: the machine's load may change in between
    kernels = kernel_times(main_step, strategy.experimental_distribute_dataset(data), args.steps)
    peak = statistics.median(peaks)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ceiling_rate = peak * 1e9 / total_flops * BATCH  # examples/s if every FLOP ran at the matmul peak
    kernel_ms = sum(v for k, v in kernels.items() if k in KERNELS)
    result: dict[str, Any] = {
        "data": source,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "step_mflop": total_flops / 1e6,
        "mflop_by_op": {k: v / 1e6 for k, v in flops.items()},
        "matmul_peak_gflops": peak,
        "matmul_peak_gflops_all": peaks,
        "examples_per_s_median": med,
        "gflops_reached": {k: v / BATCH * total_flops / 1e9 for k, v in med.items()},
        "ceiling_examples_per_s": ceiling_rate,
        "main_job_share_of_ceiling": med["main_job"] / ceiling_rate,
        "main_job_vs_plain_eager": med["main_job"] / med["plain_eager"],
        "largest_ratio_at_the_ceiling": ceiling_rate / med["plain_eager"],
        "main_job_kernel_ms_per_step": kernels,
        "main_job_kernels_gflops": total_flops / 1e9 / (kernel_ms / 1e3),
        "examples_per_s_all": rates,
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(
        f"\none step: {total_flops / 1e6:.0f} MFLOP; float32 matmul peak {peak:.0f} GFLOP/s "
        f"({torch.get_num_threads()} threads) -> ceiling {ceiling_rate:.0f} examples/s"
    )
    print(f"{'loop':<14}{'examples/s':>12}{'GFLOP/s':>10}{'of peak':>9}")
    for name in loops:
        gf = result["gflops_reached"][name]
        print(f"{name:<14}{med[name]:>12.0f}{gf:>10.1f}{gf / peak:>9.2f}")
    print(
        f"main job / plain eager = {result['main_job_vs_plain_eager']:.2f}; at the ceiling it could be at most "
        f"{result['largest_ratio_at_the_ceiling']:.2f} (target 1.8)"
    )
    print(
        f"main job per step: convolution and matrix kernels {kernel_ms:.2f} ms "
        f"({result['main_job_kernels_gflops']:.0f} GFLOP/s), everything else {kernels['everything else']:.2f} ms"
    )


if __name__ == "__main__":
    main()
