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
from distrib.app.plot import PICTURE, draw_run
from distrib.keras.callbacks import Callback, CallbackList, JsonlLogger, TensorBoard
from distrib.keras.loop import Loop
from distrib.keras.progress import line_interval
from distrib.strategies import registry
from distrib.strategies.amp import Precision, backward_and_step

__all__ = ["TrainConfig", "TensorBatches", "EpochProgress", "make_steps", "make_strategy", "metrics_path",
           "progress_mode", "train"]

log = logging.getLogger("distrib.app.train")

# seed 000's line, with readable precision (the seed prints float32 reprs: `Loss: 0.5044084787368774`)
EPOCH_TEMPLATE = "Epoch {}, Loss: {:.4f}, Accuracy: {:.2f}, Test Loss: {:.4f}, Test Accuracy: {:.2f}, Examples/s: {:.0f}"
POSTFIX_EVERY = 10  # steps between two updates of the bar's loss and accuracy (values the loop already has)


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
    log_every: int = 50  # also a line (and TensorBoard scalars) every N training steps; 0: epochs only
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


class _NullStream:
    def write(self, text: str) -> None: ...

    def flush(self) -> None: ...


class EpochProgress:
    """The custom loop's progress over one epoch: ``mode`` ``"bar"``, ``"lines"`` or ``"off"``.

    ``"bar"`` (a terminal): a tqdm bar redrawn in place with the running loss and accuracy.
    ``"lines"`` (a pipe: a log file, or a worker of ``distrib launch``, whose lines reach the
    terminal prefixed by its task): the same meter written as a new line every
    :func:`~distrib.keras.progress.line_interval` seconds (10, or ``DISTRIB_PROGRESS_INTERVAL``),
    so a long epoch is never silent.
    :meth:`show` takes values the loop has already computed: it adds no collective.
    """

    def __init__(self, mode: str, total: Optional[int], desc: str, interval: Optional[float] = None) -> None:
        self.mode = mode
        self.line_interval = line_interval() if interval is None else interval
        self._bar: Any = None
        self._last_line = time.monotonic()
        if mode != "off":
            from tqdm import tqdm

            if mode == "bar":
                self._bar = tqdm(total=total, desc=desc, leave=False, unit="batch", dynamic_ncols=True)
            else:
                self._bar = tqdm(total=total, desc=desc, unit="batch", file=_NullStream(), ascii=True, ncols=100,
                                 mininterval=self.line_interval)

    def step(self) -> None:
        """One more batch done."""
        if self._bar is None:
            return
        self._bar.update(1)
        if self.mode == "lines" and time.monotonic() - self._last_line >= self.line_interval:
            self._last_line = time.monotonic()
            print(str(self._bar), flush=True)

    def show(self, logs: dict[str, float]) -> None:
        """Put ``loss`` and ``accuracy`` (percent, as the epoch line) beside the bar."""
        if self._bar is not None:
            self._bar.set_postfix({"loss": f"{logs['loss']:.4f}", "accuracy": f"{logs['accuracy'] * 100:.2f}"},
                                  refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_mode(progress: Optional[bool], chief: bool) -> str:
    """``"bar"`` on a terminal, ``"lines"`` on a pipe, ``"off"`` with ``--no-progress`` or on a non-chief worker."""
    if not chief or progress is False:
        return "off"
    return "bar" if sys.stdout.isatty() else "lines"


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
            backward_and_step(loss, optimizer, scaler)
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
            devices = [d for d in strategy.local_devices if d is not None]
            note = mixed.slow_here(devices[0].type if devices else "cpu")
            if note:
                print(f"Note: {note}", flush=True)
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
        optimizer = models.fashion_mnist_optimizer(model.parameters())  # Keras' Adam defaults, fused kernel
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
    global_step = 0

    mode = progress_mode(config.progress, chief)
    history: list[dict[str, float]] = []
    reporters.on_train_begin()
    for epoch in range(config.epochs):
        train_batches.set_epoch(epoch)
        reporters.on_epoch_begin(epoch)
        total_loss, num_batches = torch.zeros(()), 0
        start = time.perf_counter()
        bar = EpochProgress(mode, _length(train_dist_dataset), f"epoch {epoch + 1}/{config.epochs}")
        for x in train_dist_dataset:
            total_loss += strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(x,)), axis=None).cpu()
            num_batches += 1
            global_step += 1
            logged = chief and config.log_every > 0 and global_step % config.log_every == 0
            step_logs = None
            if logged or (mode != "off" and num_batches % POSTFIX_EVERY == 0):
                # running means over the epoch so far: the loss the loop already summed, this worker's accuracy
                step_logs = {"loss": float(total_loss) / num_batches, "accuracy": float(train_accuracy.local_result())}
                bar.show(step_logs)
            bar.step()
            reporters.on_train_batch_end(num_batches - 1, step_logs if logged else None)
        bar.close()
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


def _length(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:
        return None


def metrics_path(config: TrainConfig) -> str:
    """Where the run's metrics go: ``--metrics-file``, or ``CHECKPOINT_DIR/metrics.jsonl``."""
    return config.metrics_file or os.path.join(config.checkpoint_dir, "metrics.jsonl")


def _verbose(config: TrainConfig) -> int:
    """``fit``'s verbosity: 1 (a bar on a terminal, bar lines on a pipe), 2 (a line per epoch) with --no-progress.

    ``distrib train`` shows the chief's progress alone (its epoch lines already cover every worker), so the
    other workers pass 0: ``fit`` itself prints on every worker, as Keras.
    """
    return 2 if config.progress is False else 1


def _reporters(config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               strategy: ds.Strategy) -> Any:
    """The metrics.jsonl writer and, if asked, TensorBoard: callbacks shared by both loops."""
    path = metrics_path(config)
    if strategy.is_chief:  # one file per run, and no picture of an earlier run
        for stale in (path, os.path.join(os.path.dirname(os.path.abspath(path)), PICTURE)):
            if os.path.exists(stale):
                os.remove(stale)
    callbacks: list[Any] = [JsonlLogger(path, log_every=config.log_every)]
    if config.tensorboard:
        # scalars only: tracing the graph would slow the first logged step (and, with --compile, recompile)
        callbacks.append(TensorBoard(config.tensorboard, update_freq=config.log_every or "epoch", write_graph=False))
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
           metrics=["accuracy"], validation_data=test_batches, verbose=_verbose(config) if strategy.is_chief else 0,
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
           validation_steps=-(-n_test // batch), verbose=_verbose(config),
           callbacks=[_SeedCheckpoints(checkpoint, checkpoint_prefix), *reporters.callbacks],
           precision=config.precision)


def _finish(config: TrainConfig, chief: bool, global_batch_size: int, test_split: Any,
            history: list[dict[str, float]]) -> dict[str, Any]:
    restored = None
    if chief:
        restored = evaluate_restored(config, global_batch_size, test_split)
        print(f"Accuracy after restoring the saved model without strategy: {restored:.2f}", flush=True)
        print(draw_run(metrics_path(config)), flush=True)
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
