"""Callbacks for ``ds.fit``, with Keras' names and hooks (``ds.callbacks``).

The base class and what a callback sees of the loop (``self.loop``, ``self.model``,
``self.optimizer``, ``self.learning_rate``) are in :mod:`distrib.keras.callback_base`;
TensorBoard is in :mod:`distrib.keras.tensorboard`, ModelCheckpoint and BackupAndRestore in
:mod:`distrib.keras.checkpoint_callbacks`. Under several workers every worker
runs every callback, and they all see the same epoch logs (metrics are global; batch logs
are this worker's running values); only the chief writes files.
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import os
import time
from collections.abc import Callable
from typing import IO, Any

import torch

from distrib.keras.callback_base import (
    Callback,
    CallbackList,
    History,
    Logs,
    as_learning_rate,
    first_learning_rate,
    set_learning_rate,
)
from distrib.keras.checkpoint_callbacks import BackupAndRestore, ModelCheckpoint, better_than
from distrib.keras.tensorboard import TensorBoard

__all__ = [
    "Callback",
    "CallbackList",
    "History",
    "ModelCheckpoint",
    "BackupAndRestore",
    "EarlyStopping",
    "TensorBoard",
    "JsonlLogger",
    "LearningRateScheduler",
    "TerminateOnNaN",
    "CSVLogger",
]


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Args:
        monitor: the log to watch (``"val_loss"``); epochs whose logs lack it (or hold NaN) are skipped.
        min_delta: the smallest change that counts as an improvement.
        patience: how many epochs without improvement to allow before stopping.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracies, else min).
        baseline: a value to improve on from the start (default: the first epoch's).
        restore_best_weights: when stopping, load back the model's weights of the best epoch.

    Raises:
        ValueError: ``mode`` is not one of the three.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
    ) -> None:
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.baseline, self.restore_best_weights = baseline, restore_best_weights
        self._better = better_than(mode, monitor)
        self._sign = -1.0 if self._better(0.0, 1.0) else 1.0  # min: -1, max: +1
        self.wait, self.stopped_epoch = 0, 0
        self.best: float | None = None
        self._best_state: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.wait, self.best, self.stopped_epoch = 0, self.baseline, 0

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        value = (logs or {}).get(self.monitor)
        if value is None or math.isnan(value):
            return
        if self.best is None or self._better(value - self._sign * self.min_delta, self.best):
            self.best, self.wait = value, 0
            if self.restore_best_weights:
                self._best_state = {k: v.detach().clone() for k, v in self.loop.model.state_dict().items()}
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.loop.stop_training = True
            if self._best_state is not None:
                self.loop.model.load_state_dict(self._best_state)


class JsonlLogger(Callback):
    """Append one JSON line per epoch to ``path`` and, with ``log_every=N``, one per N training steps; chief only.

    Epoch lines: ``{"epoch": 1, "loss": ..., "val_loss": ..., "seconds": ..., "steps": 938}``
    (``steps``: training steps done when the epoch ended). Step lines carry a ``"step"`` key,
    which epoch lines never have: ``{"step": 50, "epoch": 1, "loss": ..., "seconds": ...}``
    (``epoch``: the epoch in progress, from 1; values are this worker's running means over the
    epoch so far, as the progress bar shows them). Readers keep the epoch lines with
    ``"step" not in row``. Every N-th step gets its line, with whatever logs the loop gave
    (a custom loop need compute its logs only on the steps that are written).

    Examples:
        >>> import json, os, tempfile, torch
        >>> import distrib as ds
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = ds.fit(model, [(torch.ones(2, 2), torch.zeros(2, 1))] * 4, optimizer=torch.optim.SGD(model.parameters(), 0.1),
        ...            loss="mse", epochs=2, verbose=0, callbacks=[JsonlLogger(path, log_every=2)])
        >>> [("step" if "step" in r else "epoch", r.get("step", r["epoch"])) for r in map(json.loads, open(path))]
        [('step', 2), ('step', 4), ('epoch', 1), ('step', 6), ('step', 8), ('epoch', 2)]

    Args:
        path: the file to append to (its folder is made); the chief alone writes.
        log_every: also write a line every this many training steps; 0: epoch lines only.

    Raises:
        ValueError: ``log_every`` is negative.
    """

    def __init__(self, path: str, log_every: int = 0) -> None:
        if log_every < 0:
            raise ValueError(f"JsonlLogger(log_every={log_every}): give 0 (epoch lines only) or a number of steps")
        self.path, self.log_every = path, log_every
        self._start = time.time()
        self._step = 0
        self._epoch = 0

    def _write(self, row: Logs) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._step += 1
        if self.log_every and self._step % self.log_every == 0 and self.loop.is_chief:
            self._write(
                {
                    "step": self._step,
                    "epoch": self._epoch + 1,
                    **(logs or {}),
                    "seconds": round(time.time() - self._start, 3),
                }
            )

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.loop.is_chief:
            return
        row: Logs = {"epoch": epoch + 1, **(logs or {}), "seconds": round(time.time() - self._start, 3)}
        if self._step:
            row["steps"] = self._step
        self._write(row)


def _positional_arity(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` takes (many with ``*args``; 2 when it cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


class LearningRateScheduler(Callback):
    """Set every parameter group's learning rate when each epoch begins: ``lr = schedule(epoch, lr)``.

    ``schedule(epoch)`` (one argument) works too, as in Keras. The rate passed in is the
    first group's; the rate at each epoch's end is added to the logs as ``lr`` (History
    records it). Every worker sets the same rate; under parameter servers the new rate
    reaches the ps tasks with the next steps.

    Example::

        >>> import distrib as ds, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> halve = ds.callbacks.LearningRateScheduler(lambda epoch, lr: lr if epoch == 0 else lr / 2)
        >>> history = ds.fit(model, [(torch.ones(2, 2), torch.zeros(2, 1))], optimizer=optimizer, loss="mse",
        ...                  epochs=3, callbacks=[halve], verbose=0)
        >>> history.history["lr"]
        [0.1, 0.05, 0.025]

    Args:
        schedule: ``schedule(epoch, lr) -> lr`` or ``schedule(epoch) -> lr``; epochs count from 0.
        verbose: 1: print the rate each epoch gets.

    Raises:
        TypeError: ``schedule`` is not callable.
    """

    def __init__(self, schedule: Callable[..., Any], verbose: int = 0) -> None:
        if not callable(schedule):
            raise TypeError(f"schedule must be a function schedule(epoch, lr) -> float, got {schedule!r}")
        self.schedule, self.verbose = schedule, verbose
        self._with_lr = _positional_arity(schedule) >= 2

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Set every parameter group's rate to ``schedule(epoch, lr)``.

        Args:
            epoch: the epoch's index, from 0.
            logs: ``{}``.

        Raises:
            ValueError: the schedule returned something that is not a finite float, or the optimizer has no ``lr``.
        """
        current = first_learning_rate(self.loop.optimizer, "LearningRateScheduler")
        output = self.schedule(epoch, current) if self._with_lr else self.schedule(epoch)
        lr = as_learning_rate(output)
        if lr is None:
            raise ValueError(
                f"The output of the schedule function should be a finite float: schedule returned "
                f"{output!r} for epoch {epoch}"
            )
        set_learning_rate(self.loop.optimizer, lr, "LearningRateScheduler")
        if self.verbose > 0 and self.loop.is_chief:
            print(f"\nEpoch {epoch + 1:05d}: LearningRateScheduler setting learning rate to {lr}.", flush=True)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["lr"] = first_learning_rate(self.loop.optimizer, "LearningRateScheduler")


class TerminateOnNaN(Callback):
    """Stop training after the first batch whose loss is NaN or infinite, as Keras does.

    Under several workers the workers first agree (a one-number all-reduce per batch),
    so that every worker stops after the same batch and no collective is left waiting
    (a batch's logs hold each worker's own running loss).

    Example::

        >>> import distrib as ds, torch
        >>> model = torch.nn.Linear(1, 1)
        >>> bad = [(torch.tensor([[float("nan")]]), torch.zeros(1, 1))] * 4
        >>> history = ds.fit(model, bad, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss="mse",
        ...                  epochs=5, callbacks=[ds.callbacks.TerminateOnNaN()], verbose=0)
        Batch 0: Invalid loss, terminating training
        >>> history.epoch  # stopped in the first epoch, after its first batch
        [0]
    """

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss = (logs or {}).get("loss")
        invalid = loss is not None and not math.isfinite(float(loss))
        strategy = self.loop.strategy
        if strategy.num_workers > 1:
            device = strategy.local_devices[0]
            flag = torch.tensor([1.0 if invalid else 0.0], device=device if device is not None else "cpu")
            strategy.communicator.all_reduce([flag])
            invalid = bool(flag.item() > 0)
        if invalid:
            if self.loop.is_chief:
                print(f"Batch {batch}: Invalid loss, terminating training", flush=True)
            self.loop.stop_training = True


class CSVLogger(Callback):
    """Write one row per epoch to a CSV file: ``epoch`` (from 0), then the logs' keys in sorted order.

    As Keras: ``append=True`` continues an existing file (its header is kept), the last
    epoch of a stopped run fills missing keys with ``NA``. The chief alone writes.

    Example::

        >>> import distrib as ds, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> model = torch.nn.Linear(2, 1)
        >>> history = ds.fit(model, [(torch.ones(2, 2), torch.zeros(2, 1))], loss="mse", epochs=2, verbose=0,
        ...                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...                  callbacks=[ds.callbacks.CSVLogger(path)])
        >>> open(path).read().splitlines()[0]
        'epoch,loss'

    Args:
        filename: the CSV file.
        separator: the field separator.
        append: continue an existing file instead of overwriting it.
    """

    def __init__(self, filename: str, separator: str = ",", append: bool = False) -> None:
        self.filename, self.sep, self.append = os.fspath(filename), separator, append
        self.keys: list[str] | None = None
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter | None = None
        self._header = True

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if not self.loop.is_chief:
            return
        self._header = True
        if self.append and os.path.exists(self.filename):
            with open(self.filename) as f:
                self._header = not f.readline()
        directory = os.path.dirname(os.path.abspath(self.filename))
        os.makedirs(directory, exist_ok=True)
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._writer, self.keys = None, None

    @staticmethod
    def _value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        if isinstance(v, (list, tuple)):
            return f'"[{", ".join(map(str, v))}]"'
        return v

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._file is None:
            return
        logs = dict(logs or {})
        if self.keys is None:
            self.keys = sorted(logs)
        if self.loop.stop_training:  # keys missing in a stopped run's last epoch: NA, so CSV readers do not fail
            logs = {k: logs.get(k, "NA") for k in self.keys}
        if self._writer is None:
            self._writer = csv.DictWriter(
                self._file, fieldnames=["epoch", *self.keys], delimiter=self.sep, extrasaction="ignore"
            )
            if self._header:
                self._writer.writeheader()
        self._writer.writerow({"epoch": epoch, **{k: self._value(logs.get(k, "NA")) for k in self.keys}})
        self._file.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer = None, None
