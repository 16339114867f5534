"""Mixed-precision benchmark: the `distrib train` loop in float32 against bfloat16 autocast (`--precision bf16-mixed`).

    python benchmarks/mixed_precision.py [--rounds 7] [--steps 150] [--fp16] [--accuracy-epochs 3] [--json out.json]

Speed: the main job's loop exactly as `distrib train` runs it (``strategy.run`` + ``strategy.reduce``
under ``MirroredStrategy()``, one CPU replica, batch 64, Adam), built by ``make_steps`` with each
precision; training examples/s measured in interleaved rounds (every precision once per round, on
the same batches), medians reported, as ``benchmarks/single_process.py`` does. ``--fp16`` adds
``16-mixed`` (float16 autocast with a GradScaler), which every CPU measured so far runs slowly
(0.01-0.09 of fp32, even with ``avx512_fp16``: docs/performance.md).

Accuracy (``--accuracy-epochs N``): ``distrib train --epochs N`` with and without
``--precision bf16-mixed`` on the real Fashion-MNIST, each in its own process, one after the other;
the test accuracy of the last epoch line (the test pass runs under the same autocast) and the
accuracy of the restored checkpoint evaluated in float32 without a strategy.

bfloat16 speeds up matrix products where oneDNN has bfloat16 kernels for the CPU (``avx512_bf16``,
AMX) and slows the step 7-12x where it has none (AVX2 only); the script prints whether ``lscpu``
lists those flags, and ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` emulate a CPU with fewer
(docs/performance.md, "bf16 and fp16 on three kinds of CPU").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from single_process import load_data, measure  # the same data as the fp32 benchmark (benchmarks/ is on sys.path)

import distrib as ds
from distrib.app import models
from distrib.app.train import TensorBatches, make_steps

BATCH = 64


def main_job_loop(precision: str) -> tuple[Callable[[Any], None], ds.Strategy]:
    """One step of the main job's loop at ``precision``, as `distrib train` runs it."""
    strategy = ds.MirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = models.fashion_mnist_cnn()
        opt = models.fashion_mnist_optimizer(model.parameters())  # as distrib train
        acc, loss_metric, test_acc = (
            ds.metrics.SparseCategoricalAccuracy(),
            ds.metrics.Mean(),
            ds.metrics.SparseCategoricalAccuracy(),
        )
    train_step, _ = make_steps(model, opt, BATCH, acc, loss_metric, test_acc, precision=precision)
    total = [torch.zeros(())]

    def step(batch: Any) -> None:
        total[0] += strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(batch,)), axis=None).cpu()

    return step, strategy


def cpu_flags() -> dict[str, bool]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    return {flag: flag in text.split() or f" {flag} " in text for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16")}


def train_accuracy(precision: str, epochs: int, data_dir: Any) -> dict[str, float]:
    """`distrib train --epochs N --precision P` in its own process: last epoch's figures and the restored accuracy."""
    with tempfile.TemporaryDirectory() as ckpt:
        argv = [
            sys.executable,
            "-m",
            "distrib",
            "train",
            "--epochs",
            str(epochs),
            "--precision",
            precision,
            "--checkpoint-dir",
            ckpt,
            "--no-progress",
        ] + (["--data-dir", data_dir] if data_dir else [])
        start = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=3600, env={**os.environ, "TF_CONFIG": ""})
        seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stdout}\n{out.stderr}")
    lines = re.findall(
        r"Epoch (\d+), Loss: ([\d.]+), Accuracy: ([\d.]+), Test Loss: ([\d.]+), "
        r"Test Accuracy: ([\d.]+), Examples/s: (\d+)",
        out.stdout,
    )
    restored = re.search(r"restoring the saved model without strategy: ([\d.]+)", out.stdout)
    assert lines and restored, out.stdout
    last = lines[-1]
    return {
        "epochs": int(last[0]),
        "train_accuracy": float(last[2]),
        "test_loss": float(last[3]),
        "test_accuracy": float(last[4]),
        "restored_fp32_accuracy": float(restored.group(1)),
        "examples_per_s_by_epoch": [int(line[5]) for line in lines],
        "wall_s": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--fp16", action="store_true", help="also measure 16-mixed (float16 autocast + GradScaler)")
    p.add_argument("--accuracy-epochs", type=int, default=0, help="also run distrib train for N epochs per precision")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    images, labels, source = load_data(args.data_dir)
    data = TensorBatches(images, labels, batch_size=BATCH, shuffle=True, seed=0)
    precisions = ["32", "bf16-mixed"] + (["16-mixed"] if args.fp16 else [])
    loops = {name: main_job_loop(name) for name in precisions}
    dist_data = {name: strategy.experimental_distribute_dataset(data) for name, (_, strategy) in loops.items()}
    rates: dict[str, list[float]] = {k: [] for k in loops}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        data.set_epoch(r)
        for name, (step, _) in loops.items():
            rates[name].append(measure(step, dist_data[name], args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result: dict[str, Any] = {
        "data": source,
        "threads": torch.get_num_threads(),
        "cpu_flags": cpu_flags(),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
        "examples_per_s_median": med,
        "bf16_vs_fp32": med["bf16-mixed"] / med["32"],
        # the ratio within each round (both precisions measured seconds apart), median over rounds: robust to load
        "bf16_vs_fp32_per_round_median": statistics.median(b / f for b, f in zip(rates["bf16-mixed"], rates["32"])),
        "examples_per_s_all": rates,
    }
    if args.fp16:
        result["fp16_vs_fp32"] = med["16-mixed"] / med["32"]
    if args.accuracy_epochs:
        result["accuracy"] = {
            name: train_accuracy(name, args.accuracy_epochs, args.data_dir) for name in ("32", "bf16-mixed")
        }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\nbf16 / fp32 within each round, median over rounds: {result['bf16_vs_fp32_per_round_median']:.3f}")
    print(f"\n{'precision':<14}{'examples/s':>12}{'vs fp32':>10}")
    for name in loops:
        print(f"{name:<14}{med[name]:>12.0f}{med[name] / med['32']:>10.3f}")
    for name, acc in result.get("accuracy", {}).items():
        print(
            f"distrib train --epochs {acc['epochs']} --precision {name}: test accuracy {acc['test_accuracy']:.2f} %, "
            f"restored (fp32) {acc['restored_fp32_accuracy']:.2f} %"
        )


if __name__ == "__main__":
    main()
