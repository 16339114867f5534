"""``distrib train``: the tutorials' workload, a Fashion-MNIST CNN trained with a custom loop.

This is seed 000 of the project (TF's "Custom training with tf.distribute.Strategy")
written with distrib: the loss is scaled by the global batch, metrics are updated
inside ``strategy.run``, a checkpoint is written every 2 epochs, and at the end the
last checkpoint is restored into a fresh model *without* any strategy and evaluated.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

import distrib as ds
from distrib.app import models
from distrib.app.datasets import load_fashion_mnist
from distrib.keras.callbacks import Callback, CallbackList, JsonlLogger, TensorBoard
from distrib.keras.loop import Loop
from distrib.strategies import registry
from distrib.strategies.amp import Precision

__all__ = ["TrainConfig", "TensorBatches", "make_steps", "make_strategy", "train"]

log = logging.getLogger("distrib.app.train")

EPOCH_TEMPLATE = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}, Examples/s: {:.0f}"


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``distrib train`` can be told; the defaults are seed 000's."""

    strategy: str = "mirrored"
    epochs: int = 10
    batch_size_per_replica: int = 64
    replicas: Optional[int] = None
    device: Optional[str] = None
    checkpoint_dir: str = "./training_checkpoints"
    data_dir: Optional[str] = None
    seed: int = 0
    compile: bool = False
    progress: Optional[bool] = None  # None: when stdout is a terminal
    fit: bool = False  # run the job through ds.fit instead of the custom loop
    tensorboard: Optional[str] = None  # write TensorBoard scalars here (chief only)
    metrics_file: Optional[str] = None  # one JSON line per epoch; default <checkpoint_dir>/metrics.jsonl
    precision: str = "32"  # Lightning's names: "32", "bf16-mixed", "16-mixed" (see distrib.strategies.amp.Precision)


class TensorBatches:
    """Batches sliced from in-memory tensors, reshuffled every epoch as a function of (seed, epoch).

    Slicing whole batches avoids a per-example ``Dataset.__getitem__`` and collate,
    which on two cores costs more than the CNN's step itself.
    """

    def __init__(self, *tensors: torch.Tensor, batch_size: int, shuffle: bool = False, seed: int = 0) -> None:
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise ValueError("TensorBatches needs tensors of equal length along dim 0")
        self.tensors, self.batch_size, self.shuffle, self.seed = tensors, batch_size, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.tensors[0]) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        n = len(self.tensors[0])
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(n, generator=g)
            data = tuple(t[order] for t in self.tensors)
        else:
            data = self.tensors
        for start in range(0, n, self.batch_size):
            yield tuple(t[start:start + self.batch_size] for t in data)


def make_strategy(name: str, replicas: Optional[int] = None, device: Optional[str] = None) -> ds.Strategy:
    """The strategy ``distrib train --strategy NAME`` uses (see :mod:`distrib.strategies.registry`)."""
    return registry.build(name, registry.StrategyRequest(replicas=replicas, device=device,
                                                         workers=replicas or 2, ps=1))


def _progress(iterable: Any, enabled: bool, desc: str) -> Any:
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, leave=False, unit="batch", dynamic_ncols=True)


def make_steps(forward: Any, optimizer: torch.optim.Optimizer, global_batch_size: int, train_accuracy: Any,
               test_loss: Any, test_accuracy: Any, precision: str = "32") -> tuple[Any, Any]:
    """Seed 000's replica functions: ``train_step(inputs) -> scaled loss`` and ``test_step(inputs)``.

    ``precision`` ``"bf16-mixed"`` / ``"16-mixed"``: the forward pass and the loss run under
    ``torch.autocast``; float16 also scales the loss with a ``torch.amp.GradScaler``, used as in
    plain PyTorch (the strategy makes it agree over replicas and workers).
    """
    mixed = Precision.parse(precision, "--precision")
    scaler = None

    def compute_loss(labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(predictions, labels, reduction="none")
        return ds.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)

    def train_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal scaler
        images, labels = inputs
        if not mixed.mixed:
            predictions = forward(images)
            loss = compute_loss(labels, predictions)
            loss.backward()
            optimizer.step()
        else:
            with mixed.autocast(images.device.type):
                predictions = forward(images)
                loss = compute_loss(labels, predictions)
            if scaler is None:
                scaler = mixed.grad_scaler(images.device.type)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
        optimizer.zero_grad()
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, labels = inputs
        with mixed.autocast(images.device.type):
            predictions = forward(images)
            per_example = F.cross_entropy(predictions, labels, reduction="none")
        test_loss.update_state(per_example)
        test_accuracy.update_state(labels, predictions)

    return train_step, test_step


def train(config: TrainConfig, strategy: Optional[ds.Strategy] = None) -> dict[str, Any]:
    """Run the main job; print one line per epoch; return the per-epoch figures and the restored accuracy."""
    mixed = Precision.parse(config.precision, "precision")
    strategy = strategy or make_strategy(config.strategy, config.replicas, config.device)
    log.info("Using %r", strategy)
    chief = strategy.is_chief  # under several workers only the chief prints and evaluates the checkpoint
    if chief:
        print(f"Number of devices: {strategy.num_replicas_in_sync}", flush=True)
        if mixed.mixed:  # as Lightning says it
            print(f"Using {str(mixed.dtype).removeprefix('torch.')} Automatic Mixed Precision (AMP)", flush=True)
    train_split, test_split = load_fashion_mnist(config.data_dir)
    torch.manual_seed(config.seed)

    global_batch_size = config.batch_size_per_replica * strategy.num_replicas_in_sync
    train_batches = TensorBatches(*train_split, batch_size=global_batch_size, shuffle=True, seed=config.seed)
    test_batches = TensorBatches(*test_split, batch_size=global_batch_size)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_batches)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_batches)
    checkpoint_prefix = os.path.join(config.checkpoint_dir, "ckpt")

    with strategy.scope():
        model = models.fashion_mnist_cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)  # Keras' Adam defaults
        checkpoint = ds.Checkpoint(optimizer=optimizer, model=model)
        test_loss = ds.metrics.Mean(name="test_loss")
        train_accuracy = ds.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = ds.metrics.SparseCategoricalAccuracy(name="test_accuracy")
    forward = models.maybe_compile(model, config.compile)
    reporters = _reporters(config, model, optimizer, strategy)
    if strategy.should_use_with_coordinator:  # steps are scheduled on workers: only fit drives them
        _train_on_parameter_servers(config, model, optimizer, checkpoint, checkpoint_prefix, reporters,
                                    len(train_split.labels), len(test_split.labels))
        return _finish(config, chief, global_batch_size, test_split, [])
    if config.fit:
        _train_with_fit(config, strategy, forward, model, optimizer, checkpoint, checkpoint_prefix,
                        train_batches, test_batches, reporters)
        return _finish(config, chief, global_batch_size, test_split, [])
    train_step, test_step = make_steps(forward, optimizer, global_batch_size, train_accuracy, test_loss, test_accuracy,
                                       config.precision)

    show = chief and (sys.stdout.isatty() if config.progress is None else config.progress)
    history: list[dict[str, float]] = []
    for epoch in range(config.epochs):
        train_batches.set_epoch(epoch)
        total_loss, num_batches = torch.zeros(()), 0
        start = time.perf_counter()
        for x in _progress(train_dist_dataset, show, f"epoch {epoch + 1}/{config.epochs}"):
            total_loss += strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(x,)), axis=None).cpu()
            num_batches += 1
        seconds = time.perf_counter() - start
        train_loss = total_loss / num_batches
        with torch.no_grad():
            for x in test_dist_dataset:
                strategy.run(test_step, args=(x,))
        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)
        row = {
            "epoch": epoch + 1, "loss": float(train_loss), "accuracy": float(train_accuracy.result() * 100),
            "test_loss": float(test_loss.result()), "test_accuracy": float(test_accuracy.result() * 100),
            "examples_per_sec": len(train_split.labels) / seconds,
        }
        history.append(row)
        if config.compile and epoch == 0:  # every worker says whether its model runs compiled
            compiled = getattr(forward, "compiled", False)
            print(f"torch.compile: {'compiled' if compiled else 'fell back to eager'} on worker "
                  f"{strategy.worker_index}", flush=True)
        if chief:
            print(EPOCH_TEMPLATE.format(*row.values()), flush=True)
        reporters.on_epoch_end(epoch, {"loss": row["loss"], "accuracy": row["accuracy"] / 100,
                                       "val_loss": row["test_loss"], "val_accuracy": row["test_accuracy"] / 100,
                                       "examples_per_sec": row["examples_per_sec"]})
        test_loss.reset_states()
        train_accuracy.reset_states()
        test_accuracy.reset_states()

    reporters.on_train_end()
    return _finish(config, chief, global_batch_size, test_split, history)


def _reporters(config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               strategy: ds.Strategy) -> Any:
    """The metrics.jsonl writer and, if asked, TensorBoard: callbacks shared by both loops."""
    path = config.metrics_file or os.path.join(config.checkpoint_dir, "metrics.jsonl")
    if strategy.is_chief and os.path.exists(path):
        os.remove(path)  # one file per run
    callbacks: list[Any] = [JsonlLogger(path)]
    if config.tensorboard:
        callbacks.append(TensorBoard(config.tensorboard))
    reporters = CallbackList(callbacks)
    reporters.set_loop(Loop(model, optimizer, strategy))
    return reporters


class _SeedCheckpoints(Callback):
    """Seed 000's schedule: a checkpoint after epochs 1, 3, 5, ... (``epoch % 2 == 0``)."""

    def __init__(self, checkpoint: ds.Checkpoint, prefix: str) -> None:
        self.checkpoint, self.prefix = checkpoint, prefix

    def on_epoch_end(self, epoch: int, logs: Optional[dict[str, float]] = None) -> None:
        if epoch % 2 == 0:
            self.checkpoint.save(self.prefix)


def _train_with_fit(config: TrainConfig, strategy: ds.Strategy, forward: Any, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, checkpoint: ds.Checkpoint, checkpoint_prefix: str,
                    train_batches: TensorBatches, test_batches: TensorBatches, reporters: Any) -> None:
    """The same job through ``ds.fit``: Keras-style progress, a checkpoint every 2 epochs as the seed."""
    ds.fit(forward, train_batches, optimizer=optimizer, loss="cross_entropy", epochs=config.epochs,
           metrics=["accuracy"], validation_data=test_batches, verbose=1 if config.progress else 2,
           callbacks=[_SeedCheckpoints(checkpoint, checkpoint_prefix), *reporters.callbacks],
           precision=config.precision)


class FashionMnistBatches:
    """A per-worker dataset function: each worker reads the IDX files itself and cycles through its batches.

    Picklable by reference (a class of this module), so a parameter-server worker gets a few
    bytes instead of the whole dataset.
    """

    def __init__(self, data_dir: Optional[str], split: str, batch_size: int, seed: int) -> None:
        self.data_dir, self.split, self.batch_size, self.seed = data_dir, split, batch_size, seed

    def __call__(self, input_context: Any) -> Iterator[tuple[torch.Tensor, ...]]:
        train, test = load_fashion_mnist(self.data_dir)
        split = train if self.split == "train" else test
        batches = TensorBatches(*split, batch_size=self.batch_size, shuffle=self.split == "train",
                                seed=self.seed + 1000 * input_context.input_pipeline_id)
        for epoch in itertools.count():
            batches.set_epoch(epoch)
            yield from batches


def _train_on_parameter_servers(config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                checkpoint: ds.Checkpoint, checkpoint_prefix: str, reporters: Any,
                                n_train: int, n_test: int) -> None:
    """The job under ParameterServerStrategy: steps scheduled on the workers through ``ds.fit``."""
    batch = config.batch_size_per_replica
    ds.fit(model, FashionMnistBatches(config.data_dir, "train", batch, config.seed), optimizer=optimizer,
           loss="cross_entropy", epochs=config.epochs, steps_per_epoch=-(-n_train // batch), metrics=["accuracy"],
           validation_data=FashionMnistBatches(config.data_dir, "test", batch, config.seed),
           validation_steps=-(-n_test // batch), verbose=2, callbacks=[_SeedCheckpoints(checkpoint, checkpoint_prefix), *reporters.callbacks],
           precision=config.precision)


def _finish(config: TrainConfig, chief: bool, global_batch_size: int, test_split: Any,
            history: list[dict[str, float]]) -> dict[str, Any]:
    restored = None
    if chief:
        restored = evaluate_restored(config, global_batch_size, test_split)
        print(f"Accuracy after restoring the saved model without strategy: {restored}", flush=True)
    return {"history": history, "restored_accuracy": restored}


def evaluate_restored(config: TrainConfig, batch_size: int, test_split: Any) -> float:
    """Restore the latest checkpoint into a new model, outside every strategy, and test it."""
    eval_accuracy = ds.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = models.fashion_mnist_cnn()
    new_optimizer = torch.optim.Adam(new_model.parameters())
    checkpoint = ds.Checkpoint(optimizer=new_optimizer, model=new_model)
    latest = ds.latest_checkpoint(config.checkpoint_dir)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint was written to {config.checkpoint_dir}")
    checkpoint.restore(latest)
    with torch.no_grad():
        for images, labels in TensorBatches(*test_split, batch_size=batch_size):
            eval_accuracy(labels, new_model(images))
    return float(eval_accuracy.result() * 100)
