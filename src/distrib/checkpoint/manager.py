"""``CheckpointManager``: numbered saves in one directory, keeping the newest (``tf.train.CheckpointManager``)."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from distrib.checkpoint import index as idx
from distrib.checkpoint.core import Checkpoint, _strategy
from distrib.checkpoint.errors import checkpoint_timeout

__all__ = ["CheckpointManager"]

_log = logging.getLogger("distrib.checkpoint")


class CheckpointManager:
    """Numbered saves ``<directory>/<checkpoint_name>-<n>``, keeping only the newest ``max_to_keep``.

    As in TF: ``save()`` writes the next numbered checkpoint and deletes the oldest beyond
    ``max_to_keep``; ``restore_or_initialize()`` restores the newest checkpoint or calls
    ``init_fn``. A new manager in the same directory continues the previous one's
    list. Old files are deleted only after the index no longer names them, and only those
    named ``<checkpoint_name>-<n>`` that a manager saved. Made on every worker: the chief writes
    (see :meth:`save`).

    Args:
        checkpoint: the :class:`Checkpoint` to save and restore.
        directory: where the checkpoints go (made by the chief if missing).
        max_to_keep: how many of the newest checkpoints to keep; None: all.
        keep_checkpoint_every_n_hours: a checkpoint leaving the kept set is preserved on disk (not deleted,
            no longer listed) when it is that many hours newer than the last one preserved; None: none is.
        checkpoint_name: the file name's prefix (``ckpt`` -> ``ckpt-1``, ``ckpt-2``, ...).
        step_counter: the training step (a tensor or an int-convertible object read at each ``save()``);
            needed with ``checkpoint_interval``.
        checkpoint_interval: ``save()`` writes only every this many steps of ``step_counter`` (and returns
            None otherwise); None: every call writes.
        init_fn: what ``restore_or_initialize()`` calls when there is no checkpoint yet; None: nothing.
        last_checkpoint_step: the step of the last checkpoint, for the interval (None: the first ``save``
            writes).
        timeout: seconds the other workers wait for the chief to write; None: ``$DISTRIB_CHECKPOINT_TIMEOUT``,
            else 1800.

    Raises:
        ValueError: ``max_to_keep`` is not a positive int or None, ``checkpoint_name`` is not a plain file
            name, ``checkpoint_interval`` is given without ``step_counter``, ``keep_checkpoint_every_n_hours``
            is not positive, or ``timeout`` (or ``$DISTRIB_CHECKPOINT_TIMEOUT``) is not a positive number.

    Example::

        >>> import tempfile, torch
        >>> step = torch.tensor(0)
        >>> manager = CheckpointManager(Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
        >>> manager.restore_or_initialize() is None
        True
        >>> for _ in range(3):
        ...     _ = step.add_(1)
        ...     _ = manager.save()
        >>> [p.rsplit("/", 1)[-1] for p in manager.checkpoints]
        ['ckpt-2', 'ckpt-3']
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        last_checkpoint_step: int | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        if not checkpoint_name or os.sep in checkpoint_name or "/" in checkpoint_name:
            raise ValueError(f"checkpoint_name must be a plain file name, got {checkpoint_name!r}")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                f"checkpoint_interval={checkpoint_interval!r} needs a step_counter (e.g. a tensor you "
                "increment every step) to count the steps between checkpoints"
            )
        if keep_checkpoint_every_n_hours is not None and not keep_checkpoint_every_n_hours > 0:
            raise ValueError(
                f"keep_checkpoint_every_n_hours must be positive or None, got {keep_checkpoint_every_n_hours!r}"
            )
        checkpoint_timeout(timeout)
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self.checkpoint_name = checkpoint_name
        self.timeout = timeout
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step = last_checkpoint_step
        self._init_fn = init_fn
        if _strategy(checkpoint.objects).is_chief:
            os.makedirs(self.directory, exist_ok=True)
        index = idx.read_index(self.directory)
        now = time.time()
        self._latest = idx.latest_checkpoint(self.directory) if index is not None else None
        self._last_preserved = now - 1.0
        self._managed: dict[str, float] = {}  # name -> timestamp, oldest first
        if index is None:
            return
        preserved = index.get("last_preserved_timestamp")
        self._last_preserved = float(preserved) if preserved is not None else 0.0
        if now < self._last_preserved:
            _log.warning(
                "time.time() returned a value %f seconds behind the last preserved checkpoint timestamp.",
                self._last_preserved - now,
            )
            self._last_preserved = now
        legacy = "timestamps" not in index  # an index of distrib < 0.2: what the pattern names was managed
        stamps = index.get("timestamps", {})
        pattern = re.compile(re.escape(checkpoint_name) + r"-\d+")
        for name in index["all"]:
            if not pattern.fullmatch(name) or not idx.exists(os.path.join(self.directory, name)):
                continue
            if legacy:
                self._managed[name] = now
            elif name in stamps and min(float(stamps[name]), now) > self._last_preserved:
                self._managed[name] = min(float(stamps[name]), now)

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the managed checkpoints, oldest first (preserved ones are not listed)."""
        return [os.path.join(self.directory, n) for n in self._managed]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest checkpoint in the directory, or None before the first save."""
        return self._latest

    @property
    def checkpoint_interval(self) -> int | None:
        """Least number of steps between two checkpoints, or None."""
        return self._checkpoint_interval

    def _sweep(self) -> tuple[list[str], list[str]]:
        """(deleted, preserved) names once the managed set is cut to ``max_to_keep``."""
        deleted: list[str] = []
        preserved: list[str] = []
        while self.max_to_keep is not None and len(self._managed) > self.max_to_keep:
            name = next(iter(self._managed))
            stamp = self._managed.pop(name)
            hours = self.keep_checkpoint_every_n_hours
            if hours and stamp - hours * 3600.0 >= self._last_preserved:
                self._last_preserved = stamp
                preserved.append(name)
            else:
                deleted.append(name)
        return deleted, preserved

    def save(self, checkpoint_number: Any = None, check_interval: bool = True) -> str | None:
        """Save ``<directory>/<name>-<n>`` and return it (n: ``checkpoint_number``, else the new save counter).

        With ``checkpoint_interval``, returns None without saving when fewer than
        ``checkpoint_interval`` steps passed since the last checkpoint (``check_interval=False``:
        save anyway), or when this step was already saved.

        Under several workers every worker calls it. The chief writes. A worker whose manager
        has the chief's directory writes nothing and returns the chief's checkpoint path (on
        another host, a file on the chief's disk or shared storage); a worker whose manager has
        a directory of its own (the TF tutorials' ``write_filepath`` temporary directory) writes
        and manages its own copy there, as a TF worker does, and returns that path.

        Args:
            checkpoint_number: the number ``n`` of the file (e.g. the step); None: the checkpoint's save
                counter plus one.
            check_interval: with ``checkpoint_interval``, skip the save when too few steps passed; False:
                save anyway.

        Returns:
            The path written (without ``.pt``/``.dcp``), or None when the interval skipped the save.

        Raises:
            ValueError: the manager's ``timeout`` (or ``$DISTRIB_CHECKPOINT_TIMEOUT``) is not a positive number.
            CheckpointError: the write failed, on the chief or (named so) on every other worker.
            CollectiveError: a worker that writes died or did not finish within ``timeout``.
        """
        if self._checkpoint_interval is not None:
            step = int(self._step_counter)
            if self._last_checkpoint_step is not None:
                if step == self._last_checkpoint_step:
                    return None
                if check_interval and step < self._last_checkpoint_step + self._checkpoint_interval:
                    return None
        number = self.checkpoint.save_counter + 1 if checkpoint_number is None else int(checkpoint_number)
        base = f"{self.checkpoint_name}-{number}"
        path = os.path.join(self.directory, base)
        checkpoint_timeout(self.timeout)  # a bad timeout is an error before the list changes
        managed, last_preserved = dict(self._managed), self._last_preserved
        self._managed.pop(base, None)
        self._managed[base] = time.time()
        deleted, preserved = self._sweep()

        def written() -> None:
            # where the file was written (the chief; or a worker given a directory of its own, TF's temporary
            # one, which it manages): commit the index, then delete what left the list
            self._commit(base, deleted + preserved)
            for name in deleted:  # the save is committed: a file that cannot be deleted is only noted
                try:
                    idx.remove(os.path.join(self.directory, name))
                except OSError as e:
                    _log.warning("Could not delete old checkpoint %s: %s", name, e)

        try:
            self.checkpoint.save_as(path, timeout=self.timeout, on_written=written)
        except BaseException:
            self._managed, self._last_preserved = managed, last_preserved
            raise
        self._latest = path
        if self._checkpoint_interval is not None:
            self._last_checkpoint_step = int(self._step_counter)
        return path

    def _commit(self, base: str, dropped: list[str]) -> None:
        """Write the index naming ``base`` as latest, without the dropped names (the commit point)."""
        index = idx.read_index(self.directory) or {}
        gone = set(dropped) | {base}
        index["all"] = [n for n in index.get("all", []) if n not in gone] + [base]
        index["latest"] = base
        index["timestamps"] = dict(self._managed)  # one manager per directory, as in TF: what it no longer
        # manages (preserved, or older than a clock reset) stays listed without a time and is never deleted
        index["last_preserved_timestamp"] = self._last_preserved
        idx.write_index(self.directory, index)

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint, or initialise: what a training script starts with.

        Returns:
            The path restored; None when the directory has no checkpoint (``init_fn``, if given, was called).

        Raises:
            CheckpointError: the newest checkpoint cannot be read, or does not match the checkpoint's objects.
        """
        if self._latest is not None:
            self.checkpoint.restore(self._latest)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = int(self._step_counter)
            return self._latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Nothing to wait for: saves are synchronous (TF's async-checkpoint API)."""
