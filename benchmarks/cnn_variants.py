"""Training-step variants of the Fashion-MNIST CNN on CPU: same math, different speed.

Every variant trains the same architecture (Keras init, batch 64, loss = summed
cross-entropy / 64, Adam(lr=1e-3, eps=1e-7)) on synthetic data of Fashion-MNIST
shape.  Variants run interleaved, round by round, so machine noise hits them all
alike; the table quotes the median examples/s over the rounds, the ratio to the
plain eager loop, and the max abs parameter difference to the plain model after
20 steps from the same init on the same batches (median over --diff-seeds inits).
Adam amplifies float32 rounding of near-cancelling gradient sums, so a seed may
show ~1e-3, as does plain float32 vs float64 (printed for scale); the float64
column repeats the check in float64 (~1e-14 when the math is the same).

    python benchmarks/cnn_variants.py            # eager variants, 2-4 min on 2 cores
    python benchmarks/cnn_variants.py --compile  # + torch.compile'd ones, +3-4 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    from distrib.app import models
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from distrib.app import models

BATCH = 64
Step = Callable[[torch.Tensor, torch.Tensor], None]


class AmaxPoolCNN(models.FashionMNISTCNN):
    """Pool-first, channels-last, but 2x2 pooling as crop + reshape + amax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for i, layer in enumerate(self):
            if isinstance(layer, nn.MaxPool2d):
                n, c, h, w = x.shape
                x = x[:, :, : h // 2 * 2, : w // 2 * 2]
                x = x.unflatten(3, (w // 2, 2)).unflatten(2, (h // 2, 2)).amax(dim=(3, 5))
            else:
                x = layer(models.channels_last(x) if i == 0 else x)
        return x


def build(variant: str) -> tuple[nn.Module, Callable[..., nn.Module], dict]:
    """(model, forward, adam kwargs) for a variant; model is Keras-initialised."""
    base, _, opts = variant.partition("+")
    model = {
        "plain": models.plain_fashion_mnist_cnn,
        "plain_channels_last": models.plain_fashion_mnist_cnn,
        "pool_before_relu": models.fashion_mnist_cnn,
        "fast": models.fashion_mnist_cnn,
        "amax_pool": lambda: models.keras_init_(AmaxPoolCNN()),
    }[base]()
    if base == "plain_channels_last":
        model = model.to(memory_format=torch.channels_last)
        fwd = lambda x: model(x.contiguous(memory_format=torch.channels_last))  # noqa: E731
    elif base == "pool_before_relu":  # pool-first, default NCHW layout
        fwd = lambda x: nn.Sequential.forward(model, x)  # noqa: E731
    else:
        fwd = model
    adam = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(opts.replace("compile", "").strip("+"), {})
    if "compile" in opts:
        fwd = torch.compile(fwd)  # automatic dynamic shapes, as models.maybe_compile
    return model, fwd, adam


def make_step(model: nn.Module, fwd: Callable[..., torch.Tensor], adam: dict) -> Step:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7, **adam)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(fwd(x), y, reduction="sum") / BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def param_diff(
    variant: str,
    images: torch.Tensor,
    labels: torch.Tensor,
    seed: int,
    dtype: torch.dtype = torch.float32,
    ref_dtype: torch.dtype | None = None,
    steps: int = 20,
) -> float:
    """Max abs parameter difference to the plain model after ``steps`` identical steps.

    Both start from the same Keras init (``seed``); the variant runs in ``dtype``,
    the plain reference in ``ref_dtype`` (default: ``dtype``).
    """
    torch.manual_seed(seed)
    ref = models.plain_fashion_mnist_cnn().to(ref_dtype or dtype)
    model, fwd, adam = build(variant)
    model.load_state_dict(ref.state_dict())  # same layer indices in every variant
    model.to(dtype)
    for step_fn, dt in ((make_step(ref, ref, {}), ref_dtype or dtype), (make_step(model, fwd, adam), dtype)):
        for i in range(steps):
            step_fn(images[i * BATCH : (i + 1) * BATCH].to(dt), labels[i * BATCH : (i + 1) * BATCH])
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median over these)")
    p.add_argument("--steps", type=int, default=30, help="training steps per variant per round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd variants")
    p.add_argument("--variants", default=None, help="comma-separated subset (first is the baseline)")
    p.add_argument("--diff-seeds", type=int, default=3, help="initialisations for the param diff")
    p.add_argument("--json", default=None, help="also write the JSON here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    variants = [
        "plain",
        "plain+fused",
        "plain_channels_last",
        "pool_before_relu",
        "fast",
        "fast+fused",
        "fast+foreach",
        "amax_pool+fused",
    ]
    if args.compile:
        variants += ["plain+compile", "fast+fused+compile"]
    if args.variants:
        variants = args.variants.split(",")
    if any("compile" in v for v in variants):  # time cold compiles: no inductor cache from earlier runs
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cnn_variants_inductor_")

    g = torch.Generator().manual_seed(0)
    images = torch.rand(60000, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (60000,), generator=g)
    full = len(images) // BATCH

    steps: dict[str, Step] = {}
    cursor: dict[str, int] = {}
    compile_s: dict[str, dict[str, float]] = {}
    for v in variants:
        torch.manual_seed(0)
        steps[v] = make_step(*build(v))
        cursor[v] = 0
        t0 = time.perf_counter()
        steps[v](images[:BATCH], labels[:BATCH])
        t1 = time.perf_counter()
        steps[v](images[:32], labels[:32])  # the short last batch of an epoch (60000 % 64)
        t2 = time.perf_counter()
        if "compile" in v:
            compile_s[v] = {"first_step_s": t1 - t0, "first_short_batch_step_s": t2 - t1}
        for i in range(5):  # warm-up
            steps[v](images[i * BATCH : (i + 1) * BATCH], labels[i * BATCH : (i + 1) * BATCH])

    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            batches = [
                (
                    images[(k % full) * BATCH : (k % full + 1) * BATCH],
                    labels[(k % full) * BATCH : (k % full + 1) * BATCH],
                )
                for k in range(cursor[v], cursor[v] + args.steps)
            ]
            cursor[v] += args.steps
            t0 = time.perf_counter()
            for x, y in batches:
                steps[v](x, y)
            rates[v].append(args.steps * BATCH / (time.perf_counter() - t0))

    base = statistics.median(rates[variants[0]])
    results = []
    for v in variants:
        med = statistics.median(rates[v])
        seeds = range(1 if "compile" in v else args.diff_seeds)  # each compile'd seed recompiles
        diffs = [param_diff(v, images, labels, seed) for seed in seeds]
        results.append(
            {
                "variant": v,
                "examples_per_s": round(med, 1),
                "ratio": round(med / base, 3),
                "min": round(min(rates[v]), 1),
                "max": round(max(rates[v]), 1),
                "rates": [round(r, 1) for r in rates[v]],
                "max_abs_param_diff_20_steps": statistics.median(diffs),
                "param_diff_per_seed": diffs,
                "max_abs_param_diff_20_steps_fp64": param_diff(v, images, labels, 0, torch.float64),
                **compile_s.get(v, {}),
            }
        )
    fp64_vs_fp32 = [
        param_diff("plain", images, labels, seed, torch.float64, ref_dtype=torch.float32)
        for seed in range(args.diff_seeds)
    ]  # the scale of float32 rounding effects
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": BATCH,
        "repeats": args.repeats,
        "steps_per_repeat": args.steps,
        "baseline": variants[0],
        "plain_fp32_vs_fp64_param_diff_20_steps": fp64_vs_fp32,
        "results": results,
    }
    print(
        f"{'variant':22s} {'ex/s (median)':>13s} {'ratio':>6s} {'min':>6s} {'max':>6s}"
        f" {'max|dp| fp32':>12s} {'max|dp| fp64':>12s}"
    )
    for r in results:
        extra = (
            f"  compile {r['first_step_s']:.1f}s + {r['first_short_batch_step_s']:.1f}s" if "first_step_s" in r else ""
        )
        print(
            f"{r['variant']:22s} {r['examples_per_s']:13.0f} {r['ratio']:6.2f} {r['min']:6.0f} {r['max']:6.0f}"
            f" {r['max_abs_param_diff_20_steps']:12.1e} {r['max_abs_param_diff_20_steps_fp64']:12.1e}{extra}"
        )
    print(
        "plain float32 vs float64 after 20 steps, per seed:",
        " ".join(f"{d:.1e}" for d in report["plain_fp32_vs_fp64_param_diff_20_steps"]),
    )
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
