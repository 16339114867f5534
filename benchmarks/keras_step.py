"""The tutorial's Fashion-MNIST CNN written in Keras 3 (torch backend): its training speed under distrib, in Keras'
own ``fit``, in a plain torch loop, against distrib's main job (``torch.nn``) and, optionally, TF running the
tutorial's own code.

    python benchmarks/keras_step.py [--rounds 5] [--steps 150] [--data-dir DIR] [--json out.json]
    python benchmarks/keras_step.py --tf-python /path/to/python-with-tensorflow     # adds TF 2.x

Same data (Fashion-MNIST if its IDX files are present, else random data of its shape), batch 64, Adam with Keras'
defaults (lr 1e-3, eps 1e-7), the loss and accuracy the tutorial computes. Training examples/s measured in
alternating rounds (every variant once per round, ``--steps`` steps after 3 warm-up steps), medians reported:

* ``main_job``: distrib's main job, a ``torch.nn`` model under ``MirroredStrategy()`` (benchmarks/single_process.py);
* ``keras_mirrored``: the tutorial's custom loop with its Keras model, loss, metric and ``keras.optimizers.Adam``
  under ``ds.MirroredStrategy()`` (one replica), the gradients as Keras' torch guide writes them;
* ``keras_mirrored_fused_adam``: the same with ``torch.optim.Adam(model.parameters(), fused=True)`` for the
  Keras optimizer (distrib takes a torch optimizer over a Keras model's parameters);
* ``keras_fit``: the same Keras model in Keras' own ``model.compile`` / ``model.fit`` (one ``fit`` per round);
* ``keras_plain``: the Keras model in a plain torch loop without distrib, as Keras' guide writes it;
* ``tf``: TF running the tutorial's own code (``tf.distribute.MirroredStrategy``, ``@tf.function``), in a
  subprocess of ``--tf-python``, one per round (its start is not timed).

Targets: keras_mirrored >= 0.97 x keras_fit and >= 0.97 x keras_plain. ``--profile`` adds a torch profiler's
table of where one variant's time goes (Keras' layer calls, its optimizer) against the main job's; ``--phases N``
times only the forward pass, the backward pass and the optimizer of each model, N steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import distrib as ds  # noqa: E402
from distrib.app.train import TensorBatches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from single_process import load_data, main_job_loop  # noqa: E402

BATCH = 64
Step = Callable[[Any], None]


def create_model() -> keras.Model:
    """The tutorial's ``create_model`` with its input shape (a Keras model needs it to be distributed)."""
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def keras_mirrored(fused_torch_adam: bool) -> tuple[Step, ds.Strategy]:
    """The tutorial's step under ``ds.MirroredStrategy()``: model, loss, metric, optimizer built in its scope."""
    strategy = ds.MirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = create_model()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        if fused_torch_adam:
            optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7, fused=True)
        else:
            optimizer = keras.optimizers.Adam()

    def train_step(inputs: Any) -> torch.Tensor:
        images, labels = inputs
        predictions = model(images, training=True)
        per_example_loss = loss_object(labels, predictions)
        loss = ds.compute_average_loss(per_example_loss, global_batch_size=BATCH)
        model.zero_grad()
        loss.backward()
        if fused_torch_adam:
            optimizer.step()
        else:
            gradients = [v.value.grad for v in model.trainable_variables]
            with torch.no_grad():
                optimizer.apply(gradients, model.trainable_variables)
        train_accuracy.update_state(labels, predictions)
        return loss

    total = [torch.zeros(())]

    def step(batch: Any) -> None:
        total[0] += strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(batch,)), axis=None)

    return step, strategy


def keras_plain() -> Step:
    """Keras' guide "Writing a training loop from scratch in PyTorch": no distrib."""
    keras.utils.set_random_seed(0)
    model = create_model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam()
    train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
    total = [torch.zeros(())]

    def step(batch: Any) -> None:
        x_batch_train, y_batch_train = batch
        logits = model(x_batch_train, training=True)
        loss = loss_fn(y_batch_train, logits)
        model.zero_grad()
        loss.backward()
        trainable_weights = [v for v in model.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            optimizer.apply(gradients, trainable_weights)
        train_acc_metric.update_state(y_batch_train, logits)
        total[0] += loss.detach()

    return step


def measure(step: Step, batches: Any, steps: int, warmup: int = 3) -> float:
    it = iter(batches)
    for _ in range(warmup):
        step(next(it))
    start = time.perf_counter()
    for _ in range(steps):
        step(next(it))
    return steps * BATCH / (time.perf_counter() - start)


class KerasFit:
    """The Keras model in Keras' own ``compile``/``fit``: ``steps`` batches of the round's order, one ``fit``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        keras.utils.set_random_seed(0)
        self.model = create_model()
        self.model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        self.images, self.labels = images, labels
        self.model.fit(images[: 3 * BATCH], labels[: 3 * BATCH], batch_size=BATCH, epochs=1, verbose=0)  # warm-up

    def measure(self, steps: int, round_index: int) -> float:
        order = np.random.default_rng(round_index).permutation(len(self.images))[: steps * BATCH]
        x, y = self.images[order], self.labels[order]
        start = time.perf_counter()
        self.model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return steps * BATCH / (time.perf_counter() - start)


TF_SCRIPT = r"""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
steps, seed, data = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with np.load(data) as f:
    train_images, train_labels = f["images"], f["labels"]
strategy = tf.distribute.MirroredStrategy()
BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(len(train_images), seed=seed).batch(GLOBAL_BATCH_SIZE)
train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
def create_model():
  model = tf.keras.Sequential([
      tf.keras.layers.Conv2D(32, 3, activation='relu'),
      tf.keras.layers.MaxPooling2D(),
      tf.keras.layers.Conv2D(64, 3, activation='relu'),
      tf.keras.layers.MaxPooling2D(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(64, activation='relu'),
      tf.keras.layers.Dense(10)
    ])
  return model
with strategy.scope():
  loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
  def compute_loss(labels, predictions):
    per_example_loss = loss_object(labels, predictions)
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
  train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name='train_accuracy')
  model = create_model()
  optimizer = tf.keras.optimizers.Adam()
def train_step(inputs):
  images, labels = inputs
  with tf.GradientTape() as tape:
    predictions = model(images, training=True)
    loss = compute_loss(labels, predictions)
  gradients = tape.gradient(loss, model.trainable_variables)
  optimizer.apply_gradients(zip(gradients, model.trainable_variables))
  train_accuracy.update_state(labels, predictions)
  return loss
@tf.function
def distributed_train_step(dataset_inputs):
  per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
it = iter(train_dist_dataset)
total_loss = 0.0
for _ in range(3):
  total_loss += distributed_train_step(next(it))
float(total_loss)
start = time.perf_counter()
for _ in range(steps):
  total_loss += distributed_train_step(next(it))
float(total_loss)
print("EXAMPLES_PER_S", steps * GLOBAL_BATCH_SIZE / (time.perf_counter() - start), tf.__version__)
"""


def tf_round(python: str, steps: int, round_index: int, data_file: str, script: str) -> tuple[float, str]:
    """One round of TF running the tutorial's step in its own process; returns (examples/s, TF's version)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1", KERAS_BACKEND="tensorflow")  # this process set "torch"
    done = subprocess.run(
        [python, script, str(steps), str(round_index), data_file], capture_output=True, text=True, timeout=900, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"--tf-python {python}: the TF step failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = done.stdout
    line = next(x for x in out.splitlines() if x.startswith("EXAMPLES_PER_S"))
    _, rate, version = line.split()
    return float(rate), version


def profile(step: Step, batches: Any, steps: int, label: str) -> str:
    """The torch profiler's top operators over ``steps`` steps of one variant (CPU time, with Python's share)."""
    it = iter(batches)
    for _ in range(3):
        step(next(it))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(next(it))
    return f"--- {label} ---\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def phases(steps: int) -> None:
    """Median milliseconds of forward, backward and optimizer: the main job's ``torch.nn`` model with its fused Adam,
    the Keras model with Keras' Adam, the Keras model with a fused torch Adam (no strategy: the step's own parts)."""
    from distrib.app import models

    g = torch.Generator().manual_seed(0)
    images = torch.rand(BATCH, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    images_last = images.permute(0, 2, 3, 1).contiguous()
    torch_model = models.fashion_mnist_cnn()
    torch_adam = models.fashion_mnist_optimizer(torch_model.parameters())
    keras_model, keras_model_fused = create_model(), create_model()
    keras_adam = keras.optimizers.Adam()
    fused_adam = torch.optim.Adam(keras_model_fused.parameters(), lr=1e-3, eps=1e-7, fused=True)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def torch_step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(torch_model(images), labels, reduction="sum") / BATCH
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch_adam.step()
        torch_adam.zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def keras_step(model: keras.Model, fused: bool) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = loss_object(labels, model(images_last, training=True)).sum() / BATCH
        t1 = time.perf_counter()
        model.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        if fused:
            fused_adam.step()
        else:
            gradients = [v.value.grad for v in model.trainable_variables]
            with torch.no_grad():
                keras_adam.apply(gradients, model.trainable_variables)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    variants: dict[str, Callable[[], tuple[float, float, float]]] = {
        "torch.nn, fused torch Adam": torch_step,
        "Keras, Keras Adam": lambda: keras_step(keras_model, False),
        "Keras, fused torch Adam": lambda: keras_step(keras_model_fused, True),
    }
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    for fn in variants.values():
        for _ in range(3):
            fn()
    for _ in range(steps):  # alternating
        for name, fn in variants.items():
            times[name].append(fn())
    print(f"\n{'phase medians, ms':<28}{'forward':>10}{'backward':>10}{'optimizer':>11}")
    for name, rows in times.items():
        f, b, o = (statistics.median(row[i] for row in rows) * 1e3 for i in range(3))
        print(f"{name:<28}{f:>10.1f}{b:>10.1f}{o:>11.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each round's timed steps")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--tf-python", default=None, help="a Python with tensorflow installed: adds TF running the seed")
    p.add_argument("--profile", action="store_true", help="print where the Keras step's time goes")
    p.add_argument("--phases", type=int, default=0, help="only time forward/backward/optimizer over this many steps")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.phases:
        phases(args.phases)
        return

    images, labels, source = load_data(args.data_dir)  # (N, 1, 28, 28): the main job's channels-first layout
    images_last = images.permute(0, 2, 3, 1).contiguous()  # (N, 28, 28, 1): Keras' channels-last layout
    data = TensorBatches(images, labels, batch_size=BATCH, shuffle=True, seed=0)
    data_last = TensorBatches(images_last, labels, batch_size=BATCH, shuffle=True, seed=0)

    main_step, main_strategy = main_job_loop(True, False)
    keras_step, keras_strategy = keras_mirrored(fused_torch_adam=False)
    fused_step, fused_strategy = keras_mirrored(fused_torch_adam=True)
    loops: dict[str, tuple[Step, Any]] = {
        "main_job": (main_step, main_strategy.experimental_distribute_dataset(data)),
        "keras_mirrored": (keras_step, keras_strategy.experimental_distribute_dataset(data_last)),
        "keras_mirrored_fused_adam": (fused_step, fused_strategy.experimental_distribute_dataset(data_last)),
        "keras_plain": (keras_plain(), data_last),
    }
    fit = KerasFit(images_last.numpy(), labels.numpy())
    names = [*loops, "keras_fit"] + (["tf"] if args.tf_python else [])
    rates: dict[str, list[float]] = {k: [] for k in names}
    tf_version = None
    with tempfile.TemporaryDirectory() as tmp:
        data_file, script = os.path.join(tmp, "data.npz"), os.path.join(tmp, "tf_step.py")
        if args.tf_python:
            np.savez(data_file, images=images_last.numpy(), labels=labels.numpy())
            Path(script).write_text(TF_SCRIPT)
        load_before = os.getloadavg()[0]
        for r in range(args.rounds):
            data.set_epoch(r)
            data_last.set_epoch(r)
            for name, (step, batches) in loops.items():
                rates[name].append(measure(step, batches, args.steps, args.warmup))
            rates["keras_fit"].append(fit.measure(args.steps, r))
            if args.tf_python:
                rate, tf_version = tf_round(args.tf_python, args.steps, r, data_file, script)
                rates["tf"].append(rate)
        load_after = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in rates.items()}

    def per_round(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    ratios = {
        "keras_mirrored_vs_keras_fit": per_round("keras_mirrored", "keras_fit"),
        "keras_mirrored_vs_keras_plain": per_round("keras_mirrored", "keras_plain"),
        "keras_mirrored_fused_adam_vs_keras_fit": per_round("keras_mirrored_fused_adam", "keras_fit"),
        "keras_mirrored_fused_adam_vs_keras_plain": per_round("keras_mirrored_fused_adam", "keras_plain"),
        "keras_mirrored_vs_main_job": per_round("keras_mirrored", "main_job"),
        "keras_mirrored_fused_adam_vs_main_job": per_round("keras_mirrored_fused_adam", "main_job"),
    }
    if args.tf_python:
        ratios |= {f"{k}_vs_tf": per_round(k, "tf") for k in names if k != "tf"}
    result = {
        "data": source,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "batch": BATCH,
        "keras": keras.__version__,
        "torch": torch.__version__,
        "tensorflow": tf_version,
        "examples_per_s_median": med,
        "ratios_per_round_median": ratios,
        "examples_per_s_all": rates,
        "loadavg_1min_before_after": [load_before, load_after],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{'variant':<28}{'examples/s':>12}{'vs main_job':>13}")
    for name in names:
        print(f"{name:<28}{med[name]:>12.0f}{per_round(name, 'main_job'):>13.3f}")
    print(
        f"\nkeras_mirrored / keras_fit = {ratios['keras_mirrored_vs_keras_fit']:.3f}, "
        f"/ keras_plain = {ratios['keras_mirrored_vs_keras_plain']:.3f} (targets >= 0.97; per-round ratios, median)"
    )
    if args.profile:
        for name in ("main_job", "keras_mirrored", "keras_mirrored_fused_adam"):
            step, batches = loops[name]
            print(profile(step, batches, min(args.steps, 30), name))


if __name__ == "__main__":
    main()
