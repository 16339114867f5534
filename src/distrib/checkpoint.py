"""Save and restore training state, mirroring ``tf.train.Checkpoint``.

A checkpoint is one ``torch.save`` file, ``<path>.pt``, holding
``{"format": "distrib-checkpoint", "version": 1, "save_counter": n,
"objects": {name: payload}}``. Every tensor in it is on the CPU, so a
checkpoint written on a GPU loads anywhere. Files are only ever read with
``torch.load(..., weights_only=True)``: restoring never runs code from a file.

Writes are atomic (temp file, fsync, ``os.replace``) and a directory's
``checkpoint`` index (JSON) is replaced only after the data file is in place,
so a crash mid-save leaves :func:`latest_checkpoint` on the previous save.
Under a multi-worker strategy only the chief writes; every worker returns the
same path and keeps the same counter.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree

from distrib import context

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointError", "latest_checkpoint"]

_FORMAT = "distrib-checkpoint"
_VERSION = 1
_INDEX = "checkpoint"
_ACCEPTED = ("torch.nn.Module, torch.optim.Optimizer, torch.Tensor, or any object "
             "with state_dict() and load_state_dict() methods")


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, unsafe, or does not match the tracked objects."""


# --------------------------------------------------------------- the strategy contract
def _strategy(objects: Mapping[str, Any]) -> "Strategy":
    """The strategy whose chief owns the files of a checkpoint of ``objects``.

    The strategy that distributes a tracked module or optimizer; else the current one if it
    is not the default; else a multi-worker strategy made in this process (``save`` is often
    called outside the scope, as in the tutorials); else the default.
    """
    for obj in objects.values():
        owner = context.owner_of(obj)
        if owner is not None:
            return owner
    if context.has_strategy():
        return context.get_strategy()
    return context.cluster_strategy() or context.get_strategy()


def _state(strategy: "Strategy", obj: Any) -> Any:
    """The whole, plain state of one tracked object, as the strategy gathers it."""
    if isinstance(obj, torch.Tensor):
        return obj
    return strategy.checkpoint_state(obj)


# --------------------------------------------------------------- file helpers
def _cpu_leaf(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    t = x.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _to_cpu(obj: Any) -> Any:
    """Every tensor of ``obj`` detached to the CPU; views become whole, compact tensors."""
    out = pytree.tree_map(_cpu_leaf, obj)
    if hasattr(obj, "_metadata"):  # a module state_dict's versions, used by load_state_dict
        out._metadata = obj._metadata
    return out


def _atomic_write(final: str, write: Callable[[Any], None]) -> None:
    """Write via ``write(fileobj)`` to a ``.tmp-`` file beside ``final``, then rename it."""
    directory = os.path.dirname(final) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX only)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_index(directory: str) -> dict[str, Any] | None:
    """The parsed ``checkpoint`` index of ``directory``, or None if there is none."""
    index = os.path.join(directory, _INDEX)
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint index {index!r} is unreadable: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("all", []), list):
        raise CheckpointError(f"Checkpoint index {index!r} is not a distrib index file")
    return data


def _write_index(directory: str, latest: str, all_names: list[str]) -> None:
    """Atomically replace the index of ``directory``; this is the commit point of a save."""
    payload = json.dumps({"latest": latest, "all": all_names}, indent=1).encode("utf-8")
    _atomic_write(os.path.join(directory, _INDEX), lambda f: f.write(payload))


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """Path (without ``.pt``) of the newest checkpoint in ``directory``, or None.

    Prefers the index's ``latest``, then the newest entry of ``all`` whose data
    file still exists, so a deleted file never makes ``restore`` fail.
    """
    directory = os.fspath(directory)
    index = _read_index(directory)
    if index is None:
        return None
    names = [n for n in index.get("all", []) if isinstance(n, str)]
    latest = index.get("latest")
    if isinstance(latest, str):
        names.append(latest)
    for name in reversed(names):
        path = os.path.join(directory, name)
        if os.path.isfile(path + ".pt"):
            return path
    return None


# --------------------------------------------------------------- Checkpoint
class Checkpoint:
    """Groups modules, optimizers, tensors and stateful objects for save/restore.

    Tensors are restored in place (``copy_``), so references you hold see the
    restored value; modules and optimizers via strict ``load_state_dict``.
    Tracked objects are also reachable as attributes (``ckpt.epoch``).

    Example::

        >>> import tempfile, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> epoch = torch.tensor(3)
        >>> ckpt = Checkpoint(model=model, optimizer=opt, epoch=epoch)
        >>> d = tempfile.mkdtemp()
        >>> path = ckpt.save(f"{d}/ckpt")
        >>> path.endswith("ckpt-1")
        True
        >>> _ = epoch.fill_(0)
        >>> _ = ckpt.restore(latest_checkpoint(d))
        >>> int(epoch)
        3
    """

    def __init__(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if not name.isidentifier() or name.startswith("_") or hasattr(Checkpoint, name):
                raise ValueError(f"Checkpoint name {name!r} must be a valid identifier that "
                                 "does not start with '_' or shadow a Checkpoint method")
            if not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)) and not (
                    callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"Checkpoint argument {name!r} has type {type(obj).__qualname__}, "
                                f"which cannot be checkpointed; accepted: {_ACCEPTED}")
        self._objects: dict[str, Any] = dict(objects)
        self._save_counter = 0

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def objects(self) -> dict[str, Any]:
        """The tracked objects by name."""
        return dict(self._objects)

    @property
    def save_counter(self) -> int:
        """Number of successful ``save`` calls, carried through save/restore."""
        return self._save_counter

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write ``<file_prefix>-<n>`` (n = save_counter + 1), record it in the index, return it."""
        n = self._save_counter + 1
        path = f"{os.fspath(file_prefix)}-{n}"
        strategy = _strategy(self._objects)
        payload = self._payload(strategy)
        if strategy.is_chief:
            self._write_data(path, n, payload)
            directory, base = os.path.split(path)
            directory = directory or "."
            index = _read_index(directory) or {}
            kept = [x for x in index.get("all", []) if x != base] + [base]
            _write_index(directory, base, kept)
        self._save_counter = n
        strategy.barrier()
        return path

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write exactly ``<path>.pt``; neither the counter nor the index changes."""
        path = os.fspath(path)
        strategy = _strategy(self._objects)
        payload = self._payload(strategy)
        if strategy.is_chief:
            self._write_data(path, self._save_counter, payload)
        strategy.barrier()
        return path

    def _payload(self, strategy: "Strategy") -> dict[str, Any]:
        """Every tracked object's whole state, on the CPU on the chief (gathered on every worker:
        a strategy may need all of them to assemble a sharded value)."""
        states = {name: _state(strategy, obj) for name, obj in self._objects.items()}
        return {name: _to_cpu(state) for name, state in states.items()} if strategy.is_chief else states

    def _write_data(self, path: str, counter: int, payload: dict[str, Any]) -> None:
        """Atomically write the data file ``<path>.pt`` holding ``payload`` and recording ``counter``."""
        data = {"format": _FORMAT, "version": _VERSION, "save_counter": counter,
                "objects": payload}
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _atomic_write(path + ".pt", lambda f: torch.save(data, f))

    def restore(self, path: str | os.PathLike[str]) -> Checkpoint:
        """Load ``path`` (as returned by ``save``) into the tracked objects; returns self.

        Names must match exactly; everything is validated before any object changes
        except the objects' own ``load_state_dict`` checks.
        """
        if path is None:
            raise TypeError("Checkpoint.restore(None): no checkpoint given; use "
                            "CheckpointManager.restore_or_initialize() to start fresh")
        data_file = _data_file(os.fspath(path))
        data = _load(data_file)
        stored = data["objects"]
        unexpected = sorted(set(stored) - set(self._objects))
        missing = sorted(set(self._objects) - set(stored))
        if unexpected or missing:
            raise CheckpointError(
                f"Checkpoint {data_file!r} does not match the tracked objects: "
                f"in the file but not tracked: {unexpected}; tracked but not in the file: "
                f"{missing}. Pass the same names to Checkpoint(...) that were used to save.")
        for name, obj in self._objects.items():
            if isinstance(obj, torch.Tensor):
                value = stored[name]
                if not isinstance(value, torch.Tensor) or value.shape != obj.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                    raise CheckpointError(f"Checkpoint {data_file!r}: {name!r} has shape "
                                          f"{tuple(obj.shape)} but the file holds {got}")
        strategy = _strategy(self._objects)
        for name, obj in self._objects.items():
            try:
                if isinstance(obj, torch.Tensor):
                    with torch.no_grad():
                        obj.copy_(stored[name])
                else:
                    strategy.restore_checkpoint_state(obj, stored[name])
            except (RuntimeError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"Restoring {name!r} from {data_file!r} failed: {e}") from e
        self._save_counter = int(data.get("save_counter", 0))
        return self


def _data_file(path: str) -> str:
    """Map a checkpoint path to its existing data file, or raise FileNotFoundError."""
    for candidate in (path + ".pt", path):
        if os.path.isfile(candidate):
            return candidate
    directory = os.path.dirname(path) or "."
    raise FileNotFoundError(
        f"No checkpoint at {path!r} (looked for {path + '.pt'!r}). To find the newest "
        f"checkpoint use distrib.checkpoint.latest_checkpoint({directory!r}).")


def _load(data_file: str) -> dict[str, Any]:
    """Safely load and validate a data file; never executes code stored in it."""
    corrupt = f"Checkpoint file {data_file!r} is truncated or not a distrib checkpoint"
    try:
        data = torch.load(data_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e)
        found = re.search(r"GLOBAL\s+([\w.]+)", msg)
        if not found and "global" not in msg.lower():  # bad opcodes: damaged, not hostile
            raise CheckpointError(f"{corrupt} (unreadable pickle data)") from e
        offending = f" (offending global: {found.group(1)})" if found else ""
        raise CheckpointError(
            f"Checkpoint file {data_file!r} contains a pickled Python object{offending}; distrib "
            "refuses to load it because unpickling it could run arbitrary code. Re-save the "
            "checkpoint with distrib, or, only if you trust the file, load it yourself with "
            "torch.load(..., weights_only=False).") from e
    except OSError:
        raise
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise CheckpointError(f"{corrupt} ({type(e).__name__}: {first_line})") from e
    if not (isinstance(data, dict) and data.get("format") == _FORMAT
            and isinstance(data.get("objects"), dict)):
        raise CheckpointError(corrupt)
    version = data.get("version")
    if not isinstance(version, int) or version > _VERSION:
        raise CheckpointError(f"Checkpoint file {data_file!r} has format version {version!r}; "
                              f"this distrib reads up to version {_VERSION}")
    return data


# --------------------------------------------------------------- CheckpointManager
class CheckpointManager:
    """Numbered saves in one directory, keeping only the newest ``max_to_keep``.

    Old data files are deleted only after the index no longer names them, so
    the index never points at a missing file. ``max_to_keep=None`` keeps all.

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

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike[str],
                 max_to_keep: int | None = 5, checkpoint_name: str = "ckpt") -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        if not checkpoint_name or os.sep in checkpoint_name or "/" in checkpoint_name:
            raise ValueError(f"checkpoint_name must be a plain file name, got {checkpoint_name!r}")
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name
        if _strategy(checkpoint.objects).is_chief:
            os.makedirs(self.directory, exist_ok=True)
        index = _read_index(self.directory) or {}
        pattern = re.compile(re.escape(checkpoint_name) + r"-\d+")
        self._kept: list[str] = [
            n for n in index.get("all", []) if isinstance(n, str) and pattern.fullmatch(n)
            and os.path.isfile(os.path.join(self.directory, n + ".pt"))]

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the kept checkpoints, oldest first."""
        return [os.path.join(self.directory, n) for n in self._kept]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest kept checkpoint, or None before the first save."""
        return os.path.join(self.directory, self._kept[-1]) if self._kept else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save ``<directory>/<name>-<n>`` (n defaults to the new save counter); return it."""
        ckpt = self.checkpoint
        counter = ckpt.save_counter + 1
        number = counter if checkpoint_number is None else int(checkpoint_number)
        base = f"{self.checkpoint_name}-{number}"
        path = os.path.join(self.directory, base)
        kept = [n for n in self._kept if n != base] + [base]
        removed: list[str] = []
        if self.max_to_keep is not None and len(kept) > self.max_to_keep:
            removed, kept = kept[:-self.max_to_keep], kept[-self.max_to_keep:]
        strategy = _strategy(ckpt.objects)
        payload = ckpt._payload(strategy)
        if strategy.is_chief:
            ckpt._write_data(path, counter, payload)
            _write_index(self.directory, base, kept)
            for name in removed:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, name + ".pt"))
        ckpt._save_counter = counter
        self._kept = kept
        strategy.barrier()
        return path

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint and return its path, or return None if there is none."""
        path = self.latest_checkpoint
        if path is None:
            return None
        self.checkpoint.restore(path)
        return path
