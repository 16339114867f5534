"""Single-process benchmark: the `distrib train` loop against a plain hand-written PyTorch loop.

    python benchmarks/single_process.py [--rounds 7] [--steps 150] [--data-dir DIR] [--json out.json]

Same data (Fashion-MNIST if its IDX files are present, else random data of its shape), same
batch (64), same optimizer (Adam, Keras' eps), training examples/s measured in interleaved
rounds, medians reported. Loops:

* ``plain_eager``: the plain PyTorch loop anyone would write: nn.MaxPool2d model,
  ``loss.backward(); opt.step(); opt.zero_grad()``;
* ``plain_fast_model``: the same plain loop on distrib's model formulation (same math);
* ``main_job_without_distrib``: the main job's replica function called directly
  (same model, loss scaling, accuracy metric, loss accumulation), no strategy;
* ``main_job_default_adam``: the main job's loop with PyTorch's default (single-tensor) Adam;
* ``main_job``: the main job's loop: ``strategy.run`` + ``strategy.reduce`` under
  ``MirroredStrategy()`` (one CPU replica), exactly as `distrib train` runs it, with its
  optimizer (``models.fashion_mnist_optimizer``: the same Adam, fused).

Ratios: main_job / main_job_without_distrib is the cost of the strategy layer (target >= 0.97);
main_job / plain_eager is the main job's speed against plain eager PyTorch (target >= 1.8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import distrib as ds
from distrib.app import models
from distrib.app.train import TensorBatches, make_steps

BATCH = 64


def load_data(data_dir: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        from distrib.app.datasets import load_fashion_mnist

        train, _ = load_fashion_mnist(data_dir)
        return train.images, train.labels, "fashion-mnist"
    except FileNotFoundError:
        g = torch.Generator().manual_seed(0)
        return torch.rand(60000, 1, 28, 28, generator=g), torch.randint(0, 10, (60000,), generator=g), "random"


def plain_loop(model_fn: Callable[[], torch.nn.Module]) -> Callable[[Any], None]:
    torch.manual_seed(0)
    model = model_fn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)

    def step(batch: Any) -> None:
        x, y = batch
        loss = F.cross_entropy(model(x), y, reduction="sum") / BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def main_job_loop(
    with_strategy: bool, compile_model: bool, fused_adam: bool = True
) -> tuple[Callable[[Any], None], Any]:
    strategy = ds.MirroredStrategy() if with_strategy else ds.get_strategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = models.fashion_mnist_cnn()
        if fused_adam:  # the main job's optimizer (models.fashion_mnist_optimizer)
            opt = models.fashion_mnist_optimizer(model.parameters())
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
        acc, loss_metric, test_acc = (
            ds.metrics.SparseCategoricalAccuracy(),
            ds.metrics.Mean(),
            ds.metrics.SparseCategoricalAccuracy(),
        )
    forward = models.maybe_compile(model, compile_model)
    train_step, _ = make_steps(forward, opt, BATCH * strategy.num_replicas_in_sync, acc, loss_metric, test_acc)
    total = [torch.zeros(())]

    if with_strategy:

        def step(batch: Any) -> None:
            total[0] += strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(batch,)), axis=None).cpu()
    else:

        def step(batch: Any) -> None:
            total[0] += train_step(batch).detach()

    return step, strategy


def measure(step: Callable[[Any], None], batches: Any, steps: int) -> float:
    it = iter(batches)
    for _ in range(3):
        step(next(it))
    start = time.perf_counter()
    for _ in range(steps):
        step(next(it))
    return steps * BATCH / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--compile", action="store_true", help="also torch.compile the main job's model")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    images, labels, source = load_data(args.data_dir)
    data = TensorBatches(images, labels, batch_size=BATCH, shuffle=True, seed=0)
    strategy_main, strategy = main_job_loop(True, args.compile)
    default_adam_main, default_adam_strategy = main_job_loop(True, args.compile, fused_adam=False)
    loops = {
        "plain_eager": plain_loop(models.plain_fashion_mnist_cnn),
        "plain_fast_model": plain_loop(models.fashion_mnist_cnn),
        "main_job_without_distrib": main_job_loop(False, args.compile)[0],
        "main_job_default_adam": default_adam_main,
        "main_job": strategy_main,
    }
    dist_data = {
        "main_job": strategy.experimental_distribute_dataset(data),
        "main_job_default_adam": default_adam_strategy.experimental_distribute_dataset(data),
    }
    rates: dict[str, list[float]] = {k: [] for k in loops}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        data.set_epoch(r)
        for name, step in loops.items():
            rates[name].append(measure(step, dist_data.get(name, data), args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "data": source,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "examples_per_s_median": med,
        "strategy_layer_ratio": med["main_job"] / med["main_job_without_distrib"],
        "main_job_vs_plain_eager": med["main_job"] / med["plain_eager"],
        # the ratio within each round, median over rounds: robust to load that comes and goes between rounds
        "main_job_vs_plain_eager_per_round_median": statistics.median(
            m / p for m, p in zip(rates["main_job"], rates["plain_eager"])
        ),
        "examples_per_s_all": rates,
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\n{'loop':<28}{'examples/s':>12}{'vs plain eager':>16}")
    for name in loops:
        print(f"{name:<28}{med[name]:>12.0f}{med[name] / med['plain_eager']:>16.3f}")
    print(
        f"\nstrategy layer: main_job / main_job_without_distrib = {result['strategy_layer_ratio']:.3f} (target >= 0.97)"
    )
    print(
        f"main job / plain eager = {result['main_job_vs_plain_eager']:.3f} (target >= 1.8); within each round, "
        f"median over rounds: {result['main_job_vs_plain_eager_per_round_median']:.3f}"
    )


if __name__ == "__main__":
    main()
