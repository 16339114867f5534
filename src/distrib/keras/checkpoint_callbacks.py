"""The callbacks that write checkpoints during ``ds.fit`` (``ds.callbacks``): Keras' ``ModelCheckpoint`` (files
to keep) and ``BackupAndRestore`` (the one backup a restarted ``fit`` resumes from).

Both write through ``ds.Checkpoint`` (the chief writes; every worker takes part in a sharded write).
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

from distrib.checkpoint import Checkpoint, CheckpointManager
from distrib.keras.callback_base import Callback, Logs

__all__ = ["BackupAndRestore", "ModelCheckpoint", "better_than"]


def better_than(mode: str, monitor: str) -> Any:
    """``(a, b) -> bool``: whether ``a`` improves on ``b`` for ``monitor`` (Keras' ``mode``: auto, min, max)."""
    if mode == "auto":
        mode = "max" if "acc" in monitor else "min"
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    return (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)


class ModelCheckpoint(Callback):
    """Save the model (and optimizer) every epoch, or every ``save_freq`` batches, as Keras does.

    Each save writes the distrib checkpoint ``<filepath>.pt`` (a trailing ``.pt`` in
    ``filepath`` is not doubled) and makes it its directory's latest, so
    ``ds.latest_checkpoint(directory)`` finds it and ``ds.Checkpoint(model=m).restore(path)``
    loads it. ``filepath`` may hold ``{epoch}``, ``{batch}`` (with an integer ``save_freq``)
    and log names (``"ckpt-{epoch:02d}-{val_loss:.2f}"``).

    - ``save_weights_only=True``: the model only (``Checkpoint(model=...)``); False (Keras'
      default): the model and the optimizer (``Checkpoint(model=..., optimizer=...)``).
    - ``save_best_only``: save only when ``monitor`` improves on the best so far (``mode``:
      ``"min"``, ``"max"``, or ``"auto"``: max for accuracies, else min), starting from
      ``initial_value_threshold`` when given. A missing ``monitor`` skips the save with a warning.
    - ``verbose=1``: a line per decision, on the chief. Under several workers every worker
      calls the callback and only the chief writes; with ``save_best_only`` and an integer
      ``save_freq`` (per-batch logs are worker-local) the chief's decision is shared.

    Example::

        >>> import tempfile, torch, distrib as ds
        >>> model = torch.nn.Linear(2, 1)
        >>> d = tempfile.mkdtemp()
        >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 2
        >>> save = ds.callbacks.ModelCheckpoint(d + "/weights-{epoch}", save_weights_only=True)
        >>> _ = ds.fit(model, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss="mse",
        ...            epochs=2, verbose=0, callbacks=[save])
        >>> ds.latest_checkpoint(d) == d + "/weights-2"
        True

    Args:
        filepath: where to save, without or with ``.pt``; may hold ``{epoch}``, ``{batch}`` and log names.
        monitor: the log that ``save_best_only`` compares (``"val_loss"``).
        verbose: 1: a line per decision, on the chief.
        save_best_only: save only when ``monitor`` improves on the best so far.
        save_weights_only: save the model only, not the optimizer.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracies, else min): which way is better.
        save_freq: ``"epoch"``, or save every this many training batches.
        initial_value_threshold: the best value to beat at first (default: none).

    Raises:
        ValueError: ``save_freq`` is neither ``"epoch"`` nor a positive int, ``filepath`` is a directory,
            or ``mode`` is not one of the three.
    """

    def __init__(
        self,
        filepath: str | os.PathLike[str],
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
    ) -> None:
        if save_freq != "epoch" and not (
            isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
        ):
            raise ValueError(
                f"ModelCheckpoint(save_freq={save_freq!r}): expected 'epoch' or a positive number of batches"
            )
        self.filepath = os.fspath(filepath)
        if os.path.isdir(self.filepath):  # Keras 2 wrote a SavedModel into it; a distrib checkpoint is one file
            raise ValueError(
                f"ModelCheckpoint(filepath={self.filepath!r}): that is a directory, and a checkpoint is "
                f"a file <filepath>.pt: give a file name in it, e.g. "
                f"{os.path.join(self.filepath, 'ckpt-{epoch}')!r}"
            )
        self.monitor, self.verbose, self.save_freq = monitor, verbose, save_freq
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self._better = better_than(mode, monitor)
        minimize = self._better(0.0, 1.0)
        if initial_value_threshold is not None:
            self.best: float = float(initial_value_threshold)
        else:
            self.best = math.inf if minimize else -math.inf
        self._steps = 0
        self._current_epoch = 0

    def _say(self, message: str) -> None:
        if self.verbose and self.loop.is_chief:
            print(message, flush=True)

    def _path(self, epoch: int, batch: int | None, logs: Logs) -> str:
        values = dict(logs)
        values.setdefault("epoch", epoch + 1)
        if batch is not None:
            values.setdefault("batch", batch + 1)
        try:
            path = self.filepath.format(**values)
        except (KeyError, IndexError, ValueError) as e:
            raise KeyError(
                f"ModelCheckpoint could not format filepath {self.filepath!r} with epoch, batch and the "
                f"logs {sorted(logs)}: {type(e).__name__}: {e}"
            ) from e
        return path[:-3] if path.endswith(".pt") else path

    def _verdict(self, logs: Logs) -> tuple[bool, float] | None:
        """(improved?, current value) of ``monitor``; None (with a warning) when the logs lack it."""
        current = logs.get(self.monitor)
        if current is None:
            import warnings

            warnings.warn(
                f"ModelCheckpoint can save the best model only with {self.monitor!r} available; the "
                f"logs hold {sorted(logs)}: skipping. Pass monitor= one of them (validation metrics "
                "need validation_data).",
                UserWarning,
                stacklevel=4,
            )
            return None
        return bool(self._better(float(current), self.best)), float(current)

    def _save(self, epoch: int, batch: int | None, logs: Logs) -> None:
        if self.save_best_only:
            strategy = self.loop.strategy
            if batch is not None and strategy.num_workers > 1:  # per-batch logs differ between workers
                verdict = strategy.communicator.broadcast_object(self._verdict(logs) if strategy.is_chief else None)
            else:
                verdict = self._verdict(logs)
            if verdict is None:
                return
            improved, current = verdict
            if not improved:
                self._say(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {self.best:.5f}")
                return
            path = self._path(epoch, batch, logs)
            self._say(
                f"\nEpoch {epoch + 1}: {self.monitor} improved from {self.best:.5f} to {current:.5f}, "
                f"saving model to {path}"
            )
            self.best = current
        else:
            path = self._path(epoch, batch, logs)
            self._say(f"\nEpoch {epoch + 1}: saving model to {path}")
        objects: dict[str, Any] = {"model": self.loop.model}
        if not self.save_weights_only and self.loop.optimizer is not None:
            objects["optimizer"] = self.loop.optimizer
        Checkpoint(**objects).write(path, update_latest=True)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._current_epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._steps += 1
        if isinstance(self.save_freq, int) and self._steps % self.save_freq == 0:
            self._save(self._current_epoch, batch, logs or {})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, None, logs or {})


class BackupAndRestore(Callback):
    """Back up the training state so that an interrupted ``fit`` resumes at the exact step.

    The backup holds the model, the optimizer, the epoch and the step in the epoch; it
    is written every epoch (``save_freq="epoch"``) or every ``save_freq`` steps. When
    ``fit`` starts and a backup exists, it is restored and training continues from that
    step with the same data (``fit`` replays the data position). A finished ``fit``
    deletes the backup unless ``delete_checkpoint=False``.

    ``save_before_preemption=True`` (Keras' argument, off by default as there): a
    termination notice (SIGTERM) to any worker makes every worker save the backup before
    the same batch and exit with 42, which ``distrib launch`` restarts; the restarted
    ``fit`` resumes at that batch (:class:`distrib.experimental.PreemptionCheckpointHandler`,
    checked before every batch: nothing is communicated until a notice comes).
    ``termination_config`` (distrib's) configures it (signal, exit code, grace period).

    Args:
        backup_dir: the folder that holds the backup (one per training job; not shared between jobs).
        save_freq: ``"epoch"``, or back up every this many training steps.
        delete_checkpoint: delete the backup when ``fit`` finishes.
        save_before_preemption: on a termination notice, save on every worker before the same batch and exit.
        termination_config: a ``ds.experimental.TerminationConfig`` for that (signal, exit code, grace period).

    Raises:
        ValueError: ``save_freq`` is neither ``"epoch"`` nor a positive int, or ``termination_config`` is given
            without ``save_before_preemption=True``.
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
        *,
        termination_config: Any = None,
    ) -> None:
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq must be 'epoch' or a positive number of steps, got {save_freq!r}")
        if termination_config is not None and not save_before_preemption:
            raise ValueError(
                "BackupAndRestore(termination_config=...) configures save_before_preemption=True; pass that too"
            )
        self.backup_dir, self.save_freq, self.delete_checkpoint = backup_dir, save_freq, delete_checkpoint
        self.save_before_preemption, self.termination_config = save_before_preemption, termination_config
        self._manager: CheckpointManager | None = None
        self._handler: Any = None
        self._steps = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Restore the backup if there is one (``fit`` then resumes at its step), and start watching for a termination notice.

        Args:
            logs: ``{}``.

        Raises:
            ValueError: ``save_before_preemption=True`` under ``ParameterServerStrategy`` (its steps finish on the
                workers, out of the loop's sight).
        """
        loop = self.loop
        checkpoint = Checkpoint(
            model=loop.model, optimizer=loop.optimizer, epoch=loop.epoch, step_in_epoch=loop.step_in_epoch
        )
        self._manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=1)
        if not self.save_before_preemption:
            self._manager.restore_or_initialize()
            return
        if loop.scheduled:
            raise ValueError(
                "BackupAndRestore(save_before_preemption=True) under ParameterServerStrategy: fit's "
                "steps run on the workers and finish out of the loop's sight; use a custom loop with "
                "ds.experimental.PreemptionCheckpointHandler.run around coordinator.schedule instead"
            )
        from distrib.preemption import PreemptionCheckpointHandler

        # restores the backup (and the count of batches it was saved at) as restore_or_initialize would
        self._handler = PreemptionCheckpointHandler(
            loop.strategy.cluster_resolver, self._manager, termination_config=self.termination_config
        )

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        if self._handler is not None:  # before the batch: a save here resumes at this batch, never past an epoch
            self._handler.save_checkpoint_if_preempted()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._steps += 1
        if isinstance(self.save_freq, int) and self._steps % self.save_freq == 0 and self._manager is not None:
            self._manager.save()  # the loop already counted this step: a restore resumes after it

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._manager is not None:
            self._manager.save()  # the loop already moved to (epoch + 1, step 0)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._handler is not None:
            self._handler.close()
            self._handler = None
        if self.delete_checkpoint and self.loop.is_chief:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
