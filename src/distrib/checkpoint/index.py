"""A directory's ``checkpoint`` index: which checkpoints it holds, which is the newest.

The index is JSON, replaced atomically after the data file is in place (the commit point
of a save)::

    {"latest": "ckpt-3", "all": ["ckpt-2", "ckpt-3"],
     "timestamps": {"ckpt-2": 1700000000.0, "ckpt-3": 1700000360.0},   # checkpoints a manager manages
     "last_preserved_timestamp": 1699990000.0}                          # keep_checkpoint_every_n_hours

Every name is a plain file name inside the directory: an index naming ``../x`` or an
absolute path is refused, never followed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.fileio import TEMP_PREFIX, atomic_write
from distrib.checkpoint.sharded_objects import SUFFIX as SHARDED_SUFFIX

__all__ = [
    "INDEX",
    "read_index",
    "write_index",
    "record",
    "latest_checkpoint",
    "checkpoints_iterator",
    "data_file",
    "exists",
    "remove",
]

INDEX = "checkpoint"


def _is_plain_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )


def read_index(directory: str) -> dict[str, Any] | None:
    """The validated index of ``directory``, or None if there is none."""
    index = os.path.join(directory, INDEX)
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint index {index!r} is unreadable: {e}") from e
    not_ours = f"Checkpoint index {index!r} is not a distrib index file"
    if not isinstance(data, dict):
        raise CheckpointError(not_ours)
    names = data.setdefault("all", [])
    latest = data.get("latest")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{not_ours}: 'all' must be a list of names, got {names!r:.200}")
    if latest is not None and not isinstance(latest, str):
        raise CheckpointError(f"{not_ours}: 'latest' must be a name, got {latest!r:.200}")
    for name in names + ([latest] if latest is not None else []):
        if not _is_plain_name(name):
            raise CheckpointError(
                f"Checkpoint index {index!r} names {name!r}, which is not a file inside {directory!r} (a path that "
                "leaves the directory, an absolute path, or an empty name); distrib refuses to follow it. "
                "The index is JSON: fix or delete the entry."
            )
    stamps = data.get("timestamps", {})
    if not (isinstance(stamps, dict) and all(isinstance(v, (int, float)) for v in stamps.values())):
        raise CheckpointError(f"{not_ours}: 'timestamps' must map names to times, got {stamps!r:.200}")
    preserved = data.get("last_preserved_timestamp")
    if preserved is not None and not isinstance(preserved, (int, float)):
        raise CheckpointError(f"{not_ours}: 'last_preserved_timestamp' must be a time, got {preserved!r:.200}")
    return data


def write_index(directory: str, index: dict[str, Any]) -> None:
    """Atomically replace the index of ``directory`` (the commit point of a save)."""
    payload = json.dumps(index, indent=1).encode("utf-8")
    atomic_write(os.path.join(directory, INDEX), lambda f: f.write(payload))


def record(path: str) -> None:
    """Make ``path`` (a checkpoint just written) its directory's latest; keep it out of any manager's list."""
    directory, base = os.path.split(path)
    directory = directory or "."
    index = read_index(directory) or {}
    index["all"] = [n for n in index.get("all", []) if n != base] + [base]
    index["latest"] = base
    stamps = index.get("timestamps", {})
    stamps.pop(base, None)  # overwritten outside its manager: the manager no longer deletes it
    index["timestamps"] = stamps
    write_index(directory, index)


def _is_sharded_dir(directory: str) -> bool:
    """Whether ``directory`` is a complete sharded checkpoint (DCP is imported only when a directory is there)."""
    if not os.path.isdir(directory):
        return False
    from distrib.checkpoint.sharded import is_sharded_checkpoint

    return is_sharded_checkpoint(directory)


def data_file(path: str) -> str:
    """The data of checkpoint ``path``: the file ``path + ".pt"``, the sharded directory ``path + ".dcp"``, or
    ``path`` itself (either kind)."""
    if os.path.isfile(path + ".pt"):
        return path + ".pt"
    if _is_sharded_dir(path + SHARDED_SUFFIX):
        return path + SHARDED_SUFFIX
    if os.path.isfile(path) or _is_sharded_dir(path):
        return path
    directory = os.path.dirname(path) or "."
    raise FileNotFoundError(
        f"No checkpoint at {path!r} (looked for {path + '.pt'!r} and {path + SHARDED_SUFFIX!r}). To find the "
        f"newest checkpoint use distrib.latest_checkpoint({directory!r})."
    )


def exists(path: str) -> bool:
    """Whether checkpoint ``path`` (a prefix) has its data, in either format."""
    return os.path.isfile(path + ".pt") or _is_sharded_dir(path + SHARDED_SUFFIX)


def remove(path: str, keep: str | None = None) -> None:
    """Delete checkpoint ``path``'s data in either format (``keep``: ``".pt"`` or ``".dcp"``, the one to leave).

    A checkpoint rewritten in the other format must not leave the old one where :func:`data_file`
    would find it first. A sharded directory is first renamed aside, so that it is never half there.
    """
    if keep != ".pt":
        try:
            os.remove(path + ".pt")
        except FileNotFoundError:
            pass
    if keep != SHARDED_SUFFIX and os.path.isdir(path + SHARDED_SUFFIX):
        directory, base = os.path.split(path + SHARDED_SUFFIX)
        aside = os.path.join(directory or ".", f"{TEMP_PREFIX}removed-{base}-{os.getpid()}")
        os.rename(path + SHARDED_SUFFIX, aside)
        shutil.rmtree(aside, ignore_errors=True)


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """Path (without ``.pt`` or ``.dcp``) of the newest checkpoint in ``checkpoint_dir``, or None.

    Prefers the index's ``latest``, then the newest entry of ``all`` whose data file still
    exists, so a deleted file never makes ``restore`` fail.

    Args:
        checkpoint_dir: the directory that ``Checkpoint.save`` or a ``CheckpointManager`` writes in.

    Returns:
        The path to give ``Checkpoint.restore``; None when the directory has no index (no checkpoint saved
        there yet, or no directory) or none of the files it names exists.

    Raises:
        CheckpointError: the index is damaged or names a file outside the directory.

    Example::

        >>> import tempfile, torch, distrib as ds
        >>> d = tempfile.mkdtemp()
        >>> latest_checkpoint(d) is None
        True
        >>> path = ds.Checkpoint(w=torch.zeros(1)).save(f"{d}/ckpt")
        >>> latest_checkpoint(d) == path
        True
    """
    directory = os.fspath(checkpoint_dir)
    index = read_index(directory)
    if index is None:
        return None
    names = list(index["all"])
    if isinstance(index.get("latest"), str):
        names.append(index["latest"])
    for name in reversed(names):
        path = os.path.join(directory, name)
        if exists(path):
            return path
    return None


def _wait_for_new_checkpoint(
    checkpoint_dir: str, last_checkpoint: str | None, seconds_to_sleep: float, timeout: float | None
) -> str | None:
    """The newest checkpoint once it differs from ``last_checkpoint``; None after ``timeout`` seconds."""
    stop_time = time.time() + timeout if timeout is not None else None
    while True:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None and path != last_checkpoint:
            return path
        if stop_time is not None and time.time() + seconds_to_sleep > stop_time:
            return None
        time.sleep(seconds_to_sleep)


def checkpoints_iterator(
    checkpoint_dir: str | os.PathLike[str],
    min_interval_secs: float = 0,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
) -> Iterator[str]:
    """Yield each new checkpoint of ``checkpoint_dir`` as it appears (``tf.train.checkpoints_iterator``).

    Polls :func:`latest_checkpoint` every second. A checkpoint written while the caller is busy may be
    skipped: only the newest is yielded. The side-car evaluator of TF's tutorials::

        for path in ds.checkpoints_iterator(checkpoint_dir, timeout=600):
            ds.Checkpoint(model=model).restore(path).expect_partial()
            evaluate(model)

    Args:
        checkpoint_dir: the directory to watch.
        min_interval_secs: the least seconds between two yields.
        timeout: seconds to wait for the next checkpoint; None: for ever.
        timeout_fn: called when ``timeout`` passes without a new checkpoint: True ends the iteration, False
            waits again; None: the iteration ends.

    Yields:
        The path of each new checkpoint, for ``Checkpoint.restore``: at each poll the directory's newest,
        when it differs from the one yielded last.

    Raises:
        CheckpointError: the directory's index is damaged or names a file outside the directory.

    Example::

        >>> import tempfile
        >>> list(checkpoints_iterator(tempfile.mkdtemp(), timeout=0))
        []
    """
    directory = os.fspath(checkpoint_dir)
    path: str | None = None
    while True:
        new = _wait_for_new_checkpoint(directory, path, seconds_to_sleep=1.0, timeout=timeout)
        if new is None:
            if timeout_fn is None or timeout_fn():
                return
            continue
        start = time.time()
        path = new
        yield path
        left = start + min_interval_secs - time.time()
        if left > 0:
            time.sleep(left)
