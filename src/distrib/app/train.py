"""``distrib train``: the tutorials' workload, a Fashion-MNIST CNN trained with a custom loop.

This is TF's tutorial "Custom training with tf.distribute.Strategy"
written with distrib: the loss is scaled by the global batch, metrics are updated
inside ``strategy.run``, a checkpoint is written every 2 epochs, and at the end the
last checkpoint is restored into a fresh model *without* any strategy and evaluated.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import distrib as ds
from distrib.app import models
from distrib.app.datasets import load_fashion_mnist
from distrib.app.plot import PICTURE, draw_run
from distrib.keras.callbacks import Callback, JsonlLogger, TensorBoard
from distrib.keras.progress import Progbar, data_length
from distrib.keras.training import Loop, Training
from distrib.precision import Precision, backward_and_step
from distrib.strategies import registry

__all__ = ["TrainConfig", "TensorBatches", "make_steps", "make_strategy", "metrics_path", "train"]

log = logging.getLogger("distrib.app.train")

# the tutorial's line, with readable precision (the tutorial prints float32 reprs: `Loss: 0.5044084787368774`)
# (fields by name, the keys of the epoch's row: its order cannot move a value into another's place)
EPOCH_TEMPLATE = (
    "Epoch {epoch}, Loss: {loss:.4f}, Accuracy: {accuracy:.2f}, Test Loss: {test_loss:.4f}, "
    "Test Accuracy: {test_accuracy:.2f}, Examples/s: {examples_per_sec:.0f}"
)
POSTFIX_EVERY = 10  # steps between two updates of the bar's loss and accuracy (values the loop already has)


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``distrib train`` can be told; the defaults are the tutorial's."""

    strategy: str = field(default_factory=registry.default_name)  # the registry's one-process default
    epochs: int = 10
    batch_size_per_replica: int = 64
    replicas: int | None = None
    device: str | None = None
    checkpoint_dir: str = "./training_checkpoints"
    data_dir: str | None = None
    seed: int = 0
    compile: bool = False
    progress: bool | None = None  # None: when stdout is a terminal
    fit: bool = False  # run the job through ds.fit instead of the custom loop
    tensorboard: str | None = None  # write TensorBoard scalars here (chief only)
    metrics_file: str | None = None  # one JSON line per epoch; default <checkpoint_dir>/metrics.jsonl
    log_every: int = 50  # also a line (and TensorBoard scalars) every N training steps; 0: epochs only
    precision: str = "32"  # Lightning's names: "32", "bf16-mixed", "16-mixed" (see distrib.precision.Precision)
    function: bool | None = None  # each step under @ds.function (a CUDA graph); None: off, as Keras' "auto"


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
            yield tuple(t[start : start + self.batch_size] for t in data)


def make_strategy(name: str, replicas: int | None = None, device: str | None = None) -> ds.Strategy:
    """The strategy ``distrib train --strategy NAME`` uses (see :mod:`distrib.strategies.registry`)."""
    return registry.build(name, registry.StrategyRequest(replicas=replicas, device=device, workers=replicas or 2, ps=1))


def _postfix(logs: Mapping[str, float]) -> dict[str, str]:
    """The bar's postfix: ``loss=0.5082, accuracy=81.54`` (accuracy in percent, as the epoch line)."""
    return {"loss": f"{logs['loss']:.4f}", "accuracy": f"{logs['accuracy'] * 100:.2f}"}


def make_steps(
    forward: Any,
    optimizer: torch.optim.Optimizer,
    global_batch_size: int,
    train_accuracy: Any,
    test_loss: Any,
    test_accuracy: Any,
    precision: str = "32",
) -> tuple[Any, Any]:
    """The tutorial's replica functions: ``train_step(inputs) -> scaled loss`` and ``test_step(inputs)``.

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


def train(config: TrainConfig, strategy: ds.Strategy | None = None) -> dict[str, Any]:
    """Run the main job; print one line per epoch; return the history (Keras' form) and the restored accuracy.

    One path: the model, the optimizer, the checkpoint and the reporters (the tutorial's
    checkpoint schedule, metrics.jsonl, TensorBoard) are built once, then the epochs run
    either in the tutorial's custom loop or through ``ds.fit`` (``--fit``, and under parameter
    servers, whose steps are scheduled on the workers). Both fire the same callbacks and
    return the same history: ``{"loss": [...], "accuracy": [...], "val_loss": [...], ...}``,
    one value per epoch (accuracies as fractions, as Keras).
    """
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

    with strategy.scope():
        model = models.fashion_mnist_cnn()
        optimizer = models.fashion_mnist_optimizer(model.parameters())  # Keras' Adam defaults, fused kernel
        checkpoint = ds.Checkpoint(optimizer=optimizer, model=model)
    if config.compile and config.function:
        raise ValueError(
            "--compile and --function each replace the eager step: choose one (on a GPU, --function "
            "measured 6x the eager loop, torch.compile of the model 0.94x; docs/performance.md)"
        )
    forward = models.maybe_compile(model, config.compile)
    reporters = _reporters(config, strategy, checkpoint)
    if not strategy.should_use_with_coordinator:  # parameter servers: fit's steps finish out of a callback's sight
        reporters.insert(0, _PreemptionBackup(os.path.join(config.checkpoint_dir, "preemption")))
    # the seed's loop calls strategy.run itself; where steps are scheduled on workers (TF's
    # should_use_with_coordinator: parameter servers), fit drives them, as it does with --fit
    scheduled = strategy.should_use_with_coordinator
    graphs = use_function(config, strategy)
    job = _Job(
        config,
        strategy,
        model,
        forward,
        optimizer,
        reporters,
        train_split,
        test_split,
        global_batch_size,
        scheduled,
        graphs,
    )
    history = _fit(job) if config.fit or scheduled else _custom_loop(job)
    return _finish(config, chief, global_batch_size, test_split, history)


@dataclass
class _Job:
    """What both loops of :func:`train` are given: built once."""

    config: TrainConfig
    strategy: ds.Strategy
    model: torch.nn.Module
    forward: Any  # the model, or its compiled wrapper (--compile)
    optimizer: torch.optim.Optimizer
    reporters: list[Callback]
    train_split: Any
    test_split: Any
    global_batch_size: int
    scheduled: bool  # steps run on workers that read their own data (parameter servers)
    graphs: bool  # each step under @ds.function (fit: jit_compile)


def use_function(config: TrainConfig, strategy: ds.Strategy) -> bool:
    """``--function``/``--no-function``; by default off (eager), as ``fit(jit_compile="auto")`` and Keras 3 on
    torch: a captured step is the user's choice (``--function``)."""
    return bool(config.function)


def _custom_loop(job: _Job) -> dict[str, list[float]]:
    """The tutorial's loop: ``strategy.run`` on each distributed batch, metrics in the replica function, its epoch line."""
    config, strategy = job.config, job.strategy
    chief = strategy.is_chief
    train_batches = TensorBatches(*job.train_split, batch_size=job.global_batch_size, shuffle=True, seed=config.seed)
    test_batches = TensorBatches(*job.test_split, batch_size=job.global_batch_size)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_batches)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_batches)
    with strategy.scope():
        test_loss = ds.metrics.Mean(name="test_loss")
        train_accuracy = ds.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = ds.metrics.SparseCategoricalAccuracy(name="test_accuracy")
    train_step, test_step = make_steps(
        job.forward, job.optimizer, job.global_batch_size, train_accuracy, test_loss, test_accuracy, config.precision
    )

    def distributed_train_step(x: Any) -> torch.Tensor:  # the seed's @tf.function, as @ds.function with --function
        return strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(x,)), axis=None)

    def distributed_test_step(x: Any) -> None:
        strategy.run(test_step, args=(x,))

    if job.graphs:
        distributed_train_step = ds.function(distributed_train_step)
        distributed_test_step = ds.function(distributed_test_step)
    run = Training(Loop(job.model, job.optimizer, strategy), job.reporters)  # fit's bookkeeping, fit's callbacks
    global_step = 0

    # the chief's progress alone (its epoch lines cover every worker): a tqdm bar on a terminal, a line every
    # DISTRIB_PROGRESS_INTERVAL seconds on a pipe (a log file, a worker of distrib launch), none with --no-progress
    # (verbosity 2: this loop prints its own epoch line)
    bar_verbosity = 1 if _verbosity(config, chief) == 1 else 0
    run.begin()  # a preemption backup, if there is one, sets the epoch and batch to resume at
    for epoch in run.epochs(config.epochs):
        train_batches.set_epoch(epoch)
        total_loss: Any = 0.0  # a tensor on the step's device after the first step: read only when shown
        num_batches = 0
        start = time.perf_counter()
        bar = Progbar(
            data_length(train_dist_dataset),
            bar_verbosity,
            style="tqdm",
            desc=f"epoch {epoch + 1}/{config.epochs}",
            postfix=_postfix,
        )
        skip = run.resume_at  # resumed mid-epoch: these batches were trained before the preemption
        for index, x in enumerate(train_dist_dataset):
            if index < skip:
                continue
            run.batch_begin(index)
            total_loss = total_loss + distributed_train_step(x)  # no .cpu() per step: the GPU runs ahead
            num_batches += 1
            global_step += 1
            logged = chief and config.log_every > 0 and global_step % config.log_every == 0
            step_logs: dict[str, float] = {}
            if logged or (bar_verbosity and num_batches % POSTFIX_EVERY == 0):
                # running means over the epoch so far: the loss the loop already summed, this worker's accuracy;
                # computed on the steps the reporters write (every --log-every) and the bar shows, not on every step
                step_logs = {"loss": float(total_loss) / num_batches, "accuracy": float(train_accuracy.local_result())}
            bar.update(num_batches, step_logs)
            run.batch_end(step_logs)
        bar.update(num_batches, finalize=True)
        seconds = time.perf_counter() - start
        train_loss = float(total_loss) / num_batches
        with torch.no_grad():
            for x in test_dist_dataset:
                distributed_test_step(x)
        row = {
            "epoch": epoch + 1,
            "loss": float(train_loss),
            "accuracy": float(train_accuracy.result() * 100),
            "test_loss": float(test_loss.result()),
            "test_accuracy": float(test_accuracy.result() * 100),
            "examples_per_sec": len(job.train_split.labels) / seconds,
        }
        if config.compile and epoch == 0:  # every worker says whether its model runs compiled
            compiled = getattr(job.forward, "compiled", False)
            print(
                f"torch.compile: {'compiled' if compiled else 'fell back to eager'} on worker {strategy.worker_index}",
                flush=True,
            )
        if chief:
            print(EPOCH_TEMPLATE.format(**row), flush=True)
        run.end_epoch(
            epoch,
            {
                "loss": row["loss"],
                "accuracy": row["accuracy"] / 100,
                "val_loss": row["test_loss"],
                "val_accuracy": row["test_accuracy"] / 100,
                "examples_per_sec": row["examples_per_sec"],
            },
        )
        test_loss.reset_states()
        train_accuracy.reset_states()
        test_accuracy.reset_states()
    return run.end().history


def metrics_path(config: TrainConfig) -> str:
    """Where the run's metrics go: ``--metrics-file``, or ``CHECKPOINT_DIR/metrics.jsonl``."""
    return config.metrics_file or os.path.join(config.checkpoint_dir, "metrics.jsonl")


def _verbosity(config: TrainConfig, is_chief: bool) -> int:
    """Keras' verbosity of ``distrib train``'s progress, in both loops: 1 (a bar on a terminal, bar lines on a
    pipe), 2 (a line per epoch) with --no-progress; ``ds.fit`` is given it as its ``verbose`` (which it resolves
    as Keras does: keras/loop.py's ``_verbosity``), and the custom loop, which prints its own epoch line, draws
    its bar at 1 only.

    ``distrib train`` shows the chief's progress alone (its epoch lines already cover every worker), so the
    other workers get 0: ``fit`` itself prints on every worker, as Keras.
    """
    if not is_chief:
        return 0
    return 2 if config.progress is False else 1


def _reporters(config: TrainConfig, strategy: ds.Strategy, checkpoint: ds.Checkpoint) -> list[Callback]:
    """The callbacks both loops fire: the tutorial's checkpoints, the metrics.jsonl writer and, if asked, TensorBoard."""
    path = metrics_path(config)
    if strategy.is_chief:  # one file per run, and no picture of an earlier run
        for stale in (path, os.path.join(os.path.dirname(os.path.abspath(path)), PICTURE)):
            if os.path.exists(stale):
                os.remove(stale)
    callbacks: list[Callback] = [
        _SeedCheckpoints(checkpoint, os.path.join(config.checkpoint_dir, "ckpt")),
        JsonlLogger(path, log_every=config.log_every),
    ]
    if config.tensorboard:
        # scalars only: tracing the graph would slow the first logged step (and, with --compile, recompile)
        callbacks.append(TensorBoard(config.tensorboard, update_freq=config.log_every or "epoch", write_graph=False))
    return callbacks


class _PreemptionBackup(Callback):
    """A termination notice (SIGTERM) saves model, optimizer and data position before the next batch every worker
    agrees on, then exits with 42 (``distrib launch`` restarts the job); the next start resumes at that batch.

    ``BackupAndRestore(save_before_preemption=True)`` without its backup at every epoch's end (the tutorial's
    checkpoint schedule stays as it is): written only on a notice, removed when training ends.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._handler: ds.experimental.PreemptionCheckpointHandler | None = None

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        loop = self.loop
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            log.info("train() runs outside the main thread: no preemption handling")
            return
        checkpoint = ds.Checkpoint(
            model=loop.model, optimizer=loop.optimizer, epoch=loop.epoch, step_in_epoch=loop.step_in_epoch
        )
        self._handler = ds.experimental.PreemptionCheckpointHandler(
            loop.strategy.cluster_resolver, checkpoint, self.directory
        )
        if int(loop.epoch) or int(loop.step_in_epoch):
            log.warning(
                "resuming after a preemption at epoch %d, batch %d", int(loop.epoch) + 1, int(loop.step_in_epoch)
            )

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self._handler is not None:
            self._handler.save_checkpoint_if_preempted()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self._handler is not None:
            self._handler.close()
        if self.loop.is_chief:
            shutil.rmtree(self.directory, ignore_errors=True)  # a finished job resumes nothing


class _SeedCheckpoints(Callback):
    """The tutorial's schedule: a checkpoint after epochs 1, 3, 5, ... (``epoch % 2 == 0``)."""

    def __init__(self, checkpoint: ds.Checkpoint, prefix: str) -> None:
        self.checkpoint, self.prefix = checkpoint, prefix

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if epoch % 2 == 0:
            self.checkpoint.save(self.prefix)


def _fit(job: _Job) -> dict[str, list[float]]:
    """The same job through ``ds.fit``: Keras-style progress, the same callbacks; returns fit's history.

    Where steps run here, fit reads the in-memory batches; where they are scheduled on workers
    (parameter servers), each worker reads the IDX files itself (:class:`FashionMnistBatches`)
    and an epoch is a number of steps, as in TF.
    """
    config, strategy = job.config, job.strategy
    if job.scheduled:
        batch = config.batch_size_per_replica
        model: torch.nn.Module = job.model  # sent to the workers as it is (a compiled wrapper is not)
        train_data: Any = FashionMnistBatches(config.data_dir, "train", batch, config.seed)
        test_data: Any = FashionMnistBatches(config.data_dir, "test", batch, config.seed)
        steps: int | None = -(-len(job.train_split.labels) // batch)
        validation_steps: int | None = -(-len(job.test_split.labels) // batch)
    else:
        model = job.forward
        train_data = TensorBatches(*job.train_split, batch_size=job.global_batch_size, shuffle=True, seed=config.seed)
        test_data = TensorBatches(*job.test_split, batch_size=job.global_batch_size)
        steps = validation_steps = None
    history = ds.fit(
        model,
        train_data,
        optimizer=job.optimizer,
        loss="cross_entropy",
        epochs=config.epochs,
        steps_per_epoch=steps,
        metrics=["accuracy"],
        validation_data=test_data,
        validation_steps=validation_steps,
        verbose=_verbosity(config, strategy.is_chief),
        callbacks=job.reporters,
        precision=config.precision,
        jit_compile=job.graphs,
    )
    return history.history


class FashionMnistBatches:
    """A per-worker dataset function: each worker reads the IDX files itself and cycles through its batches.

    Picklable by reference (a class of this module), so a parameter-server worker gets a few
    bytes instead of the whole dataset.
    """

    def __init__(self, data_dir: str | None, split: str, batch_size: int, seed: int) -> None:
        self.data_dir, self.split, self.batch_size, self.seed = data_dir, split, batch_size, seed

    def __call__(self, input_context: Any) -> Iterator[tuple[torch.Tensor, ...]]:
        train, test = load_fashion_mnist(self.data_dir)
        split = train if self.split == "train" else test
        batches = TensorBatches(
            *split,
            batch_size=self.batch_size,
            shuffle=self.split == "train",
            seed=self.seed + 1000 * input_context.input_pipeline_id,
        )
        for epoch in itertools.count():
            batches.set_epoch(epoch)
            yield from batches


def _finish(
    config: TrainConfig, chief: bool, global_batch_size: int, test_split: Any, history: dict[str, list[float]]
) -> dict[str, Any]:
    restored = None
    log.info("History: %s", {name: [round(v, 4) for v in values] for name, values in history.items()})  # distrib -v
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
