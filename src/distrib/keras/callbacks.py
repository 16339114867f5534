"""Callbacks for ``ds.fit``, with Keras' names and hooks.

A callback sees the training loop through ``self.loop`` (set before training starts):
``loop.model``, ``loop.optimizer``, ``loop.strategy``, ``loop.epoch`` and
``loop.step_in_epoch`` (tensors: the position training resumes from),
``loop.stop_training`` (set it to stop after the current epoch) and ``loop.is_chief``.
Under several workers every worker runs every callback, and they all see the same
logs (metrics are global); only the chief writes files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from distrib.checkpoint import Checkpoint, CheckpointManager

if TYPE_CHECKING:
    from distrib.keras.loop import Loop

__all__ = ["Callback", "CallbackList", "History", "ModelCheckpoint", "BackupAndRestore", "EarlyStopping",
           "TensorBoard", "JsonlLogger"]

Logs = dict[str, Any]


class Callback:
    """Base class: override the hooks you need. ``logs`` hold the metrics so far."""

    loop: "Loop"

    def set_loop(self, loop: "Loop") -> None:
        self.loop = loop

    @property
    def model(self) -> torch.nn.Module:
        return self.loop.model

    def on_train_begin(self, logs: Optional[Logs] = None) -> None: ...
    def on_train_end(self, logs: Optional[Logs] = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Optional[Logs] = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Optional[Logs] = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Optional[Logs] = None) -> None: ...
    def on_test_begin(self, logs: Optional[Logs] = None) -> None: ...
    def on_test_end(self, logs: Optional[Logs] = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Optional[Logs] = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Optional[Logs] = None) -> None: ...
    def on_predict_begin(self, logs: Optional[Logs] = None) -> None: ...
    def on_predict_end(self, logs: Optional[Logs] = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Optional[Logs] = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Optional[Logs] = None) -> None: ...


class CallbackList:
    """Calls a hook on every callback, in order: ``callbacks.on_epoch_end(epoch, logs)``."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def set_loop(self, loop: "Loop") -> None:
        for c in self.callbacks:
            c.set_loop(loop)

    def __getattr__(self, hook: str) -> Any:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for c in self.callbacks:
                getattr(c, hook)(*args)

        return call


class History(Callback):
    """Per-epoch logs: ``history.history["loss"]`` is the list of epoch losses; returned by ``fit``."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None:
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


def _better(mode: str, monitor: str) -> Any:
    if mode == "auto":
        mode = "max" if "acc" in monitor else "min"
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    return (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)


class ModelCheckpoint(Callback):
    """Save the model (and optimizer) to ``filepath`` every epoch, or every ``save_freq`` steps.

    ``filepath`` may hold ``{epoch}`` and metric names (``"ckpt-{epoch:02d}-{val_loss:.2f}"``);
    with ``save_best_only`` a save happens only when ``monitor`` improves.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", save_best_only: bool = False,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch") -> None:
        self.filepath, self.monitor, self.save_best_only, self.save_freq = filepath, monitor, save_best_only, save_freq
        self._better = _better(mode, monitor)
        self.best: Optional[float] = None
        self._steps = 0

    def _save(self, epoch: int, logs: Logs) -> None:
        value = logs.get(self.monitor)
        if self.save_best_only:
            if value is None or (self.best is not None and not self._better(value, self.best)):
                return
            self.best = value
        path = self.filepath.format(epoch=epoch + 1, **logs)
        Checkpoint(model=self.loop.model, optimizer=self.loop.optimizer).write(path)

    def on_train_batch_end(self, batch: int, logs: Optional[Logs] = None) -> None:
        self._steps += 1
        if isinstance(self.save_freq, int) and self._steps % self.save_freq == 0:
            self._save(int(self.loop.epoch), logs or {})

    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, logs or {})


class BackupAndRestore(Callback):
    """Back up the training state so that an interrupted ``fit`` resumes at the exact step.

    The backup holds the model, the optimizer, the epoch and the step in the epoch; it
    is written every epoch (``save_freq="epoch"``) or every ``save_freq`` steps. When
    ``fit`` starts and a backup exists, it is restored and training continues from that
    step with the same data (``fit`` replays the data position). A finished ``fit``
    deletes the backup unless ``delete_checkpoint=False``.
    """

    def __init__(self, backup_dir: str, save_freq: Union[str, int] = "epoch", delete_checkpoint: bool = True) -> None:
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq must be 'epoch' or a positive number of steps, got {save_freq!r}")
        self.backup_dir, self.save_freq, self.delete_checkpoint = backup_dir, save_freq, delete_checkpoint
        self._manager: Optional[CheckpointManager] = None
        self._steps = 0

    def on_train_begin(self, logs: Optional[Logs] = None) -> None:
        loop = self.loop
        checkpoint = Checkpoint(model=loop.model, optimizer=loop.optimizer, epoch=loop.epoch,
                                step_in_epoch=loop.step_in_epoch)
        self._manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=1)
        self._manager.restore_or_initialize()

    def on_train_batch_end(self, batch: int, logs: Optional[Logs] = None) -> None:
        self._steps += 1
        if isinstance(self.save_freq, int) and self._steps % self.save_freq == 0 and self._manager is not None:
            self._manager.save()  # the loop already counted this step: a restore resumes after it

    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None:
        if self._manager is not None:
            self._manager.save()  # the loop already moved to (epoch + 1, step 0)

    def on_train_end(self, logs: Optional[Logs] = None) -> None:
        if self.delete_checkpoint and self.loop.is_chief:
            shutil.rmtree(self.backup_dir, ignore_errors=True)


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs."""

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, mode: str = "auto",
                 baseline: Optional[float] = None, restore_best_weights: bool = False) -> None:
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.baseline, self.restore_best_weights = baseline, restore_best_weights
        self._better = _better(mode, monitor)
        self._sign = -1.0 if self._better(0.0, 1.0) else 1.0  # min: -1, max: +1
        self.wait, self.stopped_epoch = 0, 0
        self.best: Optional[float] = None
        self._best_state: Optional[dict[str, torch.Tensor]] = None

    def on_train_begin(self, logs: Optional[Logs] = None) -> None:
        self.wait, self.best, self.stopped_epoch = 0, self.baseline, 0

    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None:
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


class TensorBoard(Callback):
    """Write the logs as TensorBoard scalars (``epoch_loss``, ``epoch_val_loss`` → ``validation/epoch_loss``, ...).

    The chief alone writes, with ``torch.utils.tensorboard`` (needs the ``tensorboard``
    package), under ``log_dir/train`` and ``log_dir/validation`` as Keras does. With
    ``update_freq=N`` the training loss is also written every N batches (``batch_loss``).
    """

    def __init__(self, log_dir: str = "logs", update_freq: Union[str, int] = "epoch") -> None:
        self.log_dir, self.update_freq = log_dir, update_freq
        self._writers: dict[str, Any] = {}
        self._step = 0

    def _writer(self, kind: str) -> Any:
        if kind not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            self._writers[kind] = SummaryWriter(os.path.join(self.log_dir, kind))
        return self._writers[kind]

    def on_train_batch_end(self, batch: int, logs: Optional[Logs] = None) -> None:
        self._step += 1
        if self.loop.is_chief and isinstance(self.update_freq, int) and self._step % self.update_freq == 0:
            for k, v in (logs or {}).items():
                self._writer("train").add_scalar(f"batch_{k}", v, self._step)

    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None:
        if not self.loop.is_chief:
            return
        for k, v in (logs or {}).items():
            kind, name = ("validation", k[4:]) if k.startswith("val_") else ("train", k)
            self._writer(kind).add_scalar(f"epoch_{name}", v, epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs: Optional[Logs] = None) -> None:
        for w in self._writers.values():
            w.close()
        self._writers = {}


class JsonlLogger(Callback):
    """Append one JSON line per epoch (``{"epoch": 1, "loss": ..., "time": ...}``) to ``path``; chief only."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._start = time.time()

    def on_epoch_end(self, epoch: int, logs: Optional[Logs] = None) -> None:
        if not self.loop.is_chief:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch + 1, **(logs or {}), "seconds": round(time.time() - self._start, 3)}) + "\n")
