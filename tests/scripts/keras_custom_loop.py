"""TF's custom-loop tutorial with a Keras 3 model (torch backend) under a distrib strategy, for the equality tests.

    distrib launch --workers 2 tests/scripts/keras_custom_loop.py --strategy multi-worker --optimizer keras --out OUT

The tutorial's model (smaller), loss (reduction=None, averaged with ds.compute_average_loss), metrics
(SparseCategoricalAccuracy, Mean over the per-example losses) and optimizer (keras.optimizers.Adam or Adagrad, or torch's
Adam over model.parameters()), built in strategy.scope(); gradients as Keras' guide for custom loops on torch writes
them. STEPS seeded global batches, each split over the workers, then over each worker's replicas. The chief writes
the final trainable variables and the metrics' results to OUT; ``train`` is importable for in-process strategies.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402

import distrib as ds  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 50


def global_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable images: the label's row is bright."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(steps):
        images = torch.randn(GLOBAL_BATCH, 12, 12, 1, generator=g)
        labels = torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
        images[torch.arange(GLOBAL_BATCH), labels + 1] += 2.0
        batches.append((images, labels))
    return batches


def create_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def make_strategy(name: str) -> ds.Strategy | None:
    if name == "none":
        return None
    if name == "one-device":
        return ds.OneDeviceStrategy("cpu")
    if name == "mirrored2":
        return ds.MirroredStrategy(["cpu:0", "cpu:1"])
    if name == "multi-worker":
        return ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
    raise ValueError(name)


def train(strategy: ds.Strategy | None, optimizer_kind: str, steps: int = STEPS) -> dict[str, object]:
    scope = strategy.scope() if strategy is not None else _nothing()
    with scope:
        model = create_model()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        train_loss = keras.metrics.Mean(name="train_loss")
        if optimizer_kind == "keras":
            optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        elif optimizer_kind == "keras-adagrad":
            optimizer = keras.optimizers.Adagrad(learning_rate=5e-2)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        train_loss.update_state(per_example_loss)
        return ds.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)

    def train_step(images, labels):
        predictions = model(images)
        loss = compute_loss(labels, predictions)
        model.zero_grad()
        loss.backward()
        if optimizer_kind != "torch":
            trainable_weights = model.trainable_weights
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                optimizer.apply(gradients, trainable_weights)
        else:
            optimizer.step()
        train_accuracy.update_state(labels, predictions)
        return loss

    workers = strategy.num_workers if strategy is not None else 1
    worker = strategy.worker_index if strategy is not None else 0
    replicas = strategy.num_local_replicas if strategy is not None else 1
    for images, labels in global_batches(steps):
        rows = slice(worker * GLOBAL_BATCH // workers, (worker + 1) * GLOBAL_BATCH // workers)
        images, labels = images[rows], labels[rows]
        if strategy is None:
            train_step(images, labels)
            continue
        if replicas > 1:
            images, labels = ds.PerReplica(tuple(images.chunk(replicas))), ds.PerReplica(tuple(labels.chunk(replicas)))
        strategy.run(train_step, args=(images, labels))
    return {
        "weights": [v.value.detach().clone() for v in model.trainable_weights],
        "accuracy": float(train_accuracy.result()),
        "loss": float(train_loss.result()),
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="multi-worker")
    p.add_argument("--optimizer", choices=["keras", "keras-adagrad", "torch"], default="keras")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    strategy = make_strategy(args.strategy)
    result = train(strategy, args.optimizer, args.steps)
    if strategy is None or strategy.is_chief:
        torch.save(result, args.out)
