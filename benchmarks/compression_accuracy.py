"""Accuracy under gradient compression: seed 001's workload on the real Fashion-MNIST, 2 workers.

    python benchmarks/compression_accuracy.py [--epochs 3] [--steps-per-epoch 70] [--seed 0] [--data-dir DIR] [--json out.json]

Issue 12's accuracy check. Two worker processes (TF_CONFIG, gloo over loopback, one torch
thread each) train seed 001's tutorial exactly as ``examples/multi_worker_ctl.py`` does
(Conv32-Flatten-Dense128-Dense10, Keras' RMSprop, 64 examples per worker, every worker its
own shard of Fashion-MNIST through ``distribute_datasets_from_function``, reshuffled per
epoch) for 3 epochs of 70 steps, once per compression: ``none`` (fp32), ``bf16``, ``fp16``
and ``powersgd`` (``ds.PowerSGD(rank=2, start_iter=10)``). Every run starts from the same
initial weights and sees the same batches in the same order, so the runs differ only by
their compression.

Printed for each: the tutorial's train accuracy of the last epoch (the running
``SparseCategoricalAccuracy`` over its 70 steps: the figure the targets use), the accuracy
of the final model on the whole training set and on the test set, and the gap to ``none``.
Targets (issue 12): bf16 within 0.01 of uncompressed, PowerSGD within 0.02.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from multi_worker import rmsprop, run_tf_config_workers, seed001_cnn  # benchmarks/ is on sys.path

HERE = os.path.abspath(__file__)
COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
TARGETS = {"bf16": 0.01, "powersgd": 0.02}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import distrib as ds
    from distrib.app.datasets import load_fashion_mnist
    from distrib.app.train import TensorBatches

    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(args.data_dir)
    x_train, x_test = x_train.squeeze(1), x_test.squeeze(1)
    settings: dict[str, Any] = {
        "none": None,
        "bf16": "bf16",
        "fp16": "fp16",
        "powersgd": ds.PowerSGD(rank=2, start_iter=10),
    }

    def build() -> nn.Module:
        torch.manual_seed(args.seed)
        return seed001_cnn()

    def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        correct = 0
        with torch.no_grad():
            for i in range(0, len(x), 1000):
                correct += int((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum())
        return correct / len(x)

    results: dict[str, dict] = {}
    strategy = None
    for name in COMPRESSIONS:
        strategy = ds.MultiWorkerMirroredStrategy(
            communication_options=ds.CommunicationOptions(compression=settings[name])
        )
        global_batch = 64 * strategy.num_workers
        datasets: list[TensorBatches] = []

        def make_dataset(ctx: ds.InputContext) -> TensorBatches:
            x = x_train[ctx.input_pipeline_id :: ctx.num_input_pipelines]
            y = y_train[ctx.input_pipeline_id :: ctx.num_input_pipelines]
            datasets.append(
                TensorBatches(
                    x,
                    y,
                    batch_size=ctx.get_per_replica_batch_size(global_batch),
                    shuffle=True,
                    seed=ctx.input_pipeline_id + 1000 * args.seed,
                )
            )
            return datasets[-1]

        with strategy.scope():
            model = build()
            optimizer = rmsprop(model.parameters())
            train_accuracy = ds.metrics.SparseCategoricalAccuracy(name="train_accuracy")
            dist_dataset = strategy.distribute_datasets_from_function(make_dataset)

        def step_fn(inputs: Any) -> Any:
            x, y = inputs
            predictions = model(x)
            loss = ds.compute_average_loss(
                F.cross_entropy(predictions, y, reduction="none"), global_batch_size=global_batch
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            train_accuracy.update_state(y, predictions)
            return loss

        epochs = []
        start = time.perf_counter()
        for epoch in range(args.epochs):
            datasets[0].set_epoch(epoch)
            iterator = iter(dist_dataset)
            for _ in range(args.steps_per_epoch):
                strategy.run(step_fn, args=(next(iterator),))
            epochs.append(float(train_accuracy.result()))
            train_accuracy.reset_states()
        seconds = time.perf_counter() - start
        results[name] = {
            "epoch_train_accuracy": epochs,
            "final_train_accuracy": epochs[-1],
            "seconds": seconds,
            "full_train_set_accuracy": accuracy(model, x_train, y_train) if strategy.is_chief else None,
            "test_accuracy": accuracy(model, x_test, y_test) if strategy.is_chief else None,
        }
        if strategy.is_chief:
            print(f"{name}: epochs {[round(a, 4) for a in epochs]}, {seconds:.1f} s", flush=True)
    assert strategy is not None
    if strategy.is_chief:
        with open(args.out, "w") as f:
            json.dump(results, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=70)
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling (0: the figures in docs)")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX files (default: distrib.app.datasets')")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "--epochs",
            str(args.epochs),
            "--seed",
            str(args.seed),
            "--steps-per-epoch",
            str(args.steps_per_epoch),
            *(["--data-dir", args.data_dir] if args.data_dir else []),
        ]
        runs = run_tf_config_workers(HERE, argv, os.path.join(tmp, "accuracy.json"))
    base = runs["none"]["final_train_accuracy"]
    for name, run in runs.items():
        run["gap_vs_none"] = run["final_train_accuracy"] - base
        if name in TARGETS:
            run["target_gap"] = TARGETS[name]
            run["meets_target"] = abs(run["gap_vs_none"]) <= TARGETS[name]
    result = {
        "workers": 2,
        "seed": args.seed,
        "epochs": args.epochs,
        "steps_per_epoch": args.steps_per_epoch,
        "load_average": os.getloadavg()[0],
        "runs": runs,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(
        f"\n{'compression':<12}{'last-epoch train acc':>21}{'gap':>8}{'target':>8}{'full train':>11}{'test':>7}{'s':>6}"
    )
    for name, run in runs.items():
        target = f"{TARGETS[name]:.2f}" if name in TARGETS else "-"
        print(
            f"{name:<12}{run['final_train_accuracy']:>21.4f}{run['gap_vs_none']:>+8.4f}{target:>8}"
            f"{run['full_train_set_accuracy']:>11.4f}{run['test_accuracy']:>7.4f}{run['seconds']:>6.0f}"
        )


if __name__ == "__main__":
    main()
