"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), with distrib's safety.

:func:`save_sharded` has every worker write only its own shards (DCP's planner: a sharded
tensor's local shards, and each replicated value on one worker), in parallel, with no gather to
the chief. :func:`load_sharded` loads into a state dict of any sharding, resharding as DCP does:
written by N workers, read by M, or by one plain process. :func:`~distrib.checkpoint.sharded_export.consolidate`
exports one ordinary distrib checkpoint file.

The guarantees of distrib's single-file format hold here too:

* **Atomic.** Workers write into a temporary sibling, ``.<name>.partial-<host>-<pid>-<hex>``;
  once every worker's files are on disk (DCP gathers every worker's results to the chief), the
  chief writes the manifest (``sharded_format.py``) last and renames the directory into place
  (an existing checkpoint of that name is swapped out atomically on Linux, then removed). A save
  killed midway leaves the previous checkpoint as it was; its partial directory has no manifest,
  is never taken for a checkpoint, and the chief's next save in that parent removes it.
* **Checked.** Every stored item carries a CRC-32 and every file its size: a flipped bit or
  a truncated file is a :class:`CheckpointError` naming the file.
* **No code runs.** DCP's ``.metadata`` pickle is never unpickled for a distrib checkpoint (the
  manifest describes everything), tensors are read with ``torch.load(weights_only=True)``, and so
  are non-tensor values, which DCP's own planner reads with ``weights_only=False``.

The directory must be on storage that every worker sees (as for DCP's ``FileSystemWriter``);
:func:`save_sharded` checks that every worker sees the chief's temporary directory.

Example (one process; under several, every worker calls the same)::

    >>> import tempfile, torch
    >>> model = torch.nn.Linear(3, 2)
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> _ = save_sharded(d, {"model": model.state_dict()})
    >>> other = torch.nn.Linear(3, 2)
    >>> state = {"model": other.state_dict()}
    >>> load_sharded(d, state)
    >>> bool(torch.equal(other.weight, model.weight))
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import shutil
import socket
import uuid
import warnings
import zlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, WriteResult
from torch.futures import Future

from distrib.checkpoint import sharded_format as sf
from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.fileio import describe_os_error

__all__ = ["save_sharded", "load_sharded", "is_sharded_checkpoint", "read_item", "load_object", "manifest_of"]

_PARTIAL = ".partial-"
_REPLACED = ".replaced-"


# --------------------------------------------------------------- reading one item safely
def read_item(directory: str, span: sf.Span, what: str) -> bytes:
    """The bytes of one stored item, checked against its CRC-32; CheckpointError naming the file otherwise."""
    path = os.path.join(directory, span.file)
    try:
        with open(path, "rb") as f:
            f.seek(span.offset)
            data = f.read(span.length)
    except OSError as e:
        raise CheckpointError(f"Sharded checkpoint file {path!r} cannot be read: {describe_os_error(e)}") from e
    if len(data) != span.length:
        raise CheckpointError(
            f"Sharded checkpoint file {path!r} is truncated: {what} needs bytes "
            f"{span.offset}..{span.offset + span.length}, the file ends before"
        )
    if span.crc is not None:
        crc = zlib.crc32(data)
        if crc != span.crc:
            raise CheckpointError(
                f"Sharded checkpoint file {path!r} is damaged: {what} (bytes {span.offset}.."
                f"{span.offset + span.length}) fails its CRC-32 checksum (stored {span.crc:#010x}, "
                f"computed {crc:#010x}). Restore an earlier checkpoint."
            )
    return data


def load_object(data: bytes, path: str, what: str) -> Any:
    """``torch.load(weights_only=True)`` of one item: tensors and plain values only, never code."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        hint = (
            ("; a value of your own type must be registered with torch.serialization.add_safe_globals before loading")
            if "global" in str(e).lower()
            else ""
        )
        raise CheckpointError(
            f"Sharded checkpoint file {path!r}: {what} was refused or is unreadable "
            f"({type(e).__name__}: {first}){hint}. distrib never unpickles arbitrary objects."
        ) from e


# --------------------------------------------------------------- DCP plug-ins
class _Writer(FileSystemWriter):
    """DCP's file writer, plus: the CRC-32 of every item written, and the chief's commit (manifest, rename)."""

    def __init__(self, temp: str, final: str) -> None:
        super().__init__(temp, single_file_per_rank=True, sync_files=True, overwrite=True)
        self._temp, self._final = temp, final

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # DCP's file writer completes synchronously
        checked = []
        for r in results:
            info = r.storage_data
            crc = sf.crc_of_file(os.path.join(self._temp, info.relative_path), info.offset, info.length)
            checked.append(WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=(info, crc)))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(checked)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        spans: dict[MetadataIndex, sf.Span] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                info, crc = r.storage_data
                spans[r.index] = sf.Span(info.relative_path, info.offset, info.length, crc)
                plain[-1].append(WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=info))
        super().finish(metadata, plain)  # DCP's .metadata, for plain PyTorch readers
        files: dict[str, dict[str, int]] = {}
        for span in spans.values():
            files.setdefault(span.file, {"size": os.path.getsize(os.path.join(self._temp, span.file))})
        meta_path = os.path.join(self._temp, sf.DCP_METADATA)
        files[sf.DCP_METADATA] = {"size": os.path.getsize(meta_path), "crc": sf.crc_of_file(meta_path)}
        covered: dict[str, int] = {}
        for span in spans.values():
            covered[span.file] = covered.get(span.file, 0) + span.length
        for name, n in covered.items():  # the items cover every byte, so a flipped bit anywhere is found
            if n != files[name]["size"]:
                raise CheckpointError(
                    f"Sharded checkpoint file {os.path.join(self._temp, name)!r} holds "
                    f"{files[name]['size']} bytes but its items cover {n}"
                )
        _write_durably(os.path.join(self._temp, sf.MANIFEST), sf.encode_manifest(metadata, spans, files))
        _commit(self._temp, self._final)


class _Reader(StorageReader):
    """Reads items from the spans of a :class:`~distrib.checkpoint.sharded_format.Manifest`, each CRC-checked."""

    def __init__(self, directory: str, manifest: sf.Manifest) -> None:
        super().__init__()
        self.directory, self.manifest = directory, manifest

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP must not fall back to per-rank pickles
        self.manifest.metadata.storage_meta = StorageMeta(checkpoint_id=self.directory, load_id=uuid.uuid4().hex)
        return self.manifest.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in sorted(plan.items, key=lambda r: (self._span(r).file, self._span(r).offset)):
            span = self._span(req)
            what = f"{req.storage_index.fqn!r}" + (
                "" if req.storage_index.offset is None else f" (chunk at {list(req.storage_index.offset)})"
            )
            data = read_item(self.directory, span, what)
            path = os.path.join(self.directory, span.file)
            obj = load_object(data, path, what)
            if req.type == LoadItemType.BYTE_IO:
                safe = io.BytesIO()  # re-encoded from the safely loaded value: DCP's planner unpickles it with
                torch.save(obj, safe)  # weights_only=False, and only plain types went in
                safe.seek(0)
                planner.load_bytes(req, safe)
                continue
            tensor = obj
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"Sharded checkpoint file {path!r}: {what} is not a tensor")
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointError(
                    f"Sharded checkpoint file {path!r}: {what} has size {tuple(tensor.size())}, "
                    f"the load plan expects {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _span(self, req: ReadItem) -> sf.Span:
        return self.manifest.spans[req.storage_index]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


# --------------------------------------------------------------- directories
def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return cast(int, renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)) == 0


def _commit(temp: str, final: str) -> None:
    """Put the complete ``temp`` directory at ``final``; an old ``final`` is replaced, atomically where possible."""
    parent, base = os.path.split(final)
    _fsync_dir(temp)
    try:
        if not os.path.exists(final):
            os.rename(temp, final)
        elif _exchange(temp, final):  # temp now holds the old checkpoint
            shutil.rmtree(temp, ignore_errors=True)
        else:  # two renames: between them, the old checkpoint is at .<name>.replaced-*
            aside = os.path.join(parent, f".{base}{_REPLACED}{_tag()}")
            os.rename(final, aside)
            os.rename(temp, final)
            shutil.rmtree(aside, ignore_errors=True)
    except OSError as e:
        raise CheckpointError(
            f"Cannot put sharded checkpoint {final!r} in place (from {temp!r}): {describe_os_error(e)}"
        ) from e
    _fsync_dir(parent or ".")


def _tag() -> str:
    return f"{socket.gethostname().replace(os.sep, '_').replace('-', '_')}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _stale(name: str) -> bool:
    """Whether a ``.partial-`` / ``.replaced-`` directory was left by a save that no longer runs."""
    host, pid = (name.rsplit("-", 3) + ["", "", ""])[1:3]
    if host != socket.gethostname().replace(os.sep, "_").replace("-", "_") or not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _remove_stale(parent: str, base: str) -> None:
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith((f".{base}{_PARTIAL}", f".{base}{_REPLACED}")) and _stale(name):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def is_sharded_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a complete sharded checkpoint (distrib's manifest, or DCP's ``.metadata``).

    A save's temporary ``.<name>.partial-*`` directory never is, whatever it holds.
    """
    d = os.fspath(directory)
    if _PARTIAL in os.path.basename(os.path.normpath(d)):
        return False
    return os.path.isfile(os.path.join(d, sf.MANIFEST)) or os.path.isfile(os.path.join(d, sf.DCP_METADATA))


# --------------------------------------------------------------- collectives
def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int, bool]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return 0, 1, False
    return dist.get_rank(group), dist.get_world_size(group), True


def _share_errors(error: str | None, group: dist.ProcessGroup | None, distributed: bool, world: int) -> None:
    """Every worker learns whether any failed; all raise the first failure (no worker waits in vain)."""
    errors = [error] * world
    if distributed and world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(failed[0][1] if world == 1 else f"worker {failed[0][0]}: {failed[0][1]}")


@contextlib.contextmanager
def _quiet(distributed: bool) -> Iterator[None]:
    """Without a group, silence DCP's warning that it assumes one process: that is what was asked."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _unwrap(e: BaseException) -> CheckpointError:
    """A CheckpointError from DCP's ``CheckpointException`` (every rank's failures), naming the first."""
    failures = e.failures if isinstance(e, CheckpointException) else {}
    if not failures:
        return CheckpointError(f"{type(e).__name__}: {e}")
    rank = min(failures)
    cause = failures[rank][0]
    if isinstance(cause, CheckpointError):
        return CheckpointError(str(cause))
    return CheckpointError(f"Sharded checkpoint failed on worker {rank}: {type(cause).__name__}: {cause}")


# --------------------------------------------------------------- the API
def save_sharded(
    directory: str | os.PathLike[str], state_dict: dict[str, Any], *, process_group: dist.ProcessGroup | None = None
) -> str:
    """Write ``state_dict`` as the sharded checkpoint ``directory``; every worker of the group calls it.

    ``state_dict`` holds tensors (DTensors of ``fully_shard``, plain tensors), nested dicts and
    plain values, e.g. ``{"model": get_model_state_dict(model), "optimizer":
    get_optimizer_state_dict(model, optimizer)}``. Each worker writes only its own shards. The
    call returns on every worker once the checkpoint is complete and in place; any failure is a
    :class:`CheckpointError` on every worker, and ``directory`` is then as it was before.
    ``process_group``: the group of the workers (default: torch's default group; none: one process).
    """
    final = os.path.abspath(os.fspath(directory))
    parent, base = os.path.split(final)
    rank, world, distributed = _group_info(process_group)
    temp, error = None, None
    if rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            _remove_stale(parent, base)
            temp = os.path.join(parent, f".{base}{_PARTIAL}{_tag()}")
            os.mkdir(temp)
        except OSError as e:
            error = f"Cannot write sharded checkpoint {final!r}: creating its directory failed: {describe_os_error(e)}"
    if distributed and world > 1:
        box = [temp, error]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group
        )
        temp, error = box
    if error is None and not os.path.isdir(str(temp)):
        error = (
            f"Cannot write sharded checkpoint {final!r}: the chief's directory {temp!r} is not visible here. "
            "Every worker must see the checkpoint directory (shared storage)."
        )
    _share_errors(error, process_group, distributed, world)
    try:
        with _quiet(distributed):
            dcp.save(
                state_dict,
                storage_writer=_Writer(str(temp), final),
                process_group=process_group,
                no_dist=not distributed,
            )
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        if rank == 0:  # every worker has stopped writing: DCP reports a failure to all of them
            shutil.rmtree(str(temp), ignore_errors=True)
        if isinstance(e, CheckpointError):
            raise
        raise _unwrap(e) from e
    return final


def manifest_of(directory: str) -> sf.Manifest:
    """The checked manifest of a complete checkpoint (or a plain DCP directory's safely read metadata)."""
    if os.path.isfile(os.path.join(directory, sf.MANIFEST)):
        return sf.read_manifest(directory)
    if _PARTIAL in os.path.basename(directory):
        raise CheckpointError(
            f"{directory!r} is an incomplete sharded checkpoint (a save that did not finish); "
            "load the checkpoint it was to become, or an earlier one"
        )
    if os.path.isfile(os.path.join(directory, sf.DCP_METADATA)):
        return sf.safe_load_dcp_metadata(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"Sharded checkpoint {directory!r} does not exist")
    raise CheckpointError(
        f"{directory!r} is not a sharded checkpoint: it has neither {sf.MANIFEST!r} nor DCP's "
        f"{sf.DCP_METADATA!r} (an interrupted save leaves no manifest)"
    )


def _blank(obj: Any) -> Any:
    """``obj`` with every tensor replaced by an uninitialised one of the same kind (a DTensor keeps its sharding)."""
    return pytree.tree_map_only(torch.Tensor, torch.empty_like, obj, is_leaf=sf.stored_whole)


def _move(loaded: Any, into: Any) -> Any:
    """Copy ``loaded``'s values into ``into``'s tensors in place, and return what replaces ``into``."""
    # walked by hand, not with pytree: it writes into ``into``'s own containers (a module's state dict
    # keeps its identity) and takes ``loaded``'s value wherever the two structures differ
    if isinstance(into, torch.Tensor) and isinstance(loaded, torch.Tensor):
        with torch.no_grad():
            into.copy_(loaded)
        return into
    if isinstance(into, dict) and isinstance(loaded, dict):
        for k in loaded:
            into[k] = _move(loaded[k], into[k]) if k in into else loaded[k]
        return into
    if isinstance(into, list) and isinstance(loaded, list) and len(into) == len(loaded):
        into[:] = [_move(a, b) for a, b in zip(loaded, into)]
        return into
    return loaded


def load_sharded(
    directory: str | os.PathLike[str],
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    all_or_nothing: bool = True,
) -> None:
    """Load the sharded checkpoint ``directory`` into ``state_dict`` in place; every worker calls it.

    ``state_dict`` is shaped like the saved one, its tensors sharded any way (DTensors of any
    number of workers) or whole: each worker reads only the parts of the files its shards need.
    Tensors are overwritten in place (so a state dict whose tensors are the parameters loads
    straight into the model); non-tensor values are replaced in the dict. Then hand it to
    ``set_model_state_dict`` / ``set_optimizer_state_dict`` (or ``load_state_dict``). A missing
    key, a damaged, truncated or hostile file is a :class:`CheckpointError` on every worker,
    naming the file.

    ``all_or_nothing`` (default): read into a scratch copy and change ``state_dict`` only once
    every worker read everything, so a failure leaves it untouched; this holds a second copy of
    this worker's shards meanwhile. ``False`` reads straight into ``state_dict`` (no copy; a
    failure midway leaves it partly loaded).
    """
    path = os.path.abspath(os.fspath(directory))
    rank, world, distributed = _group_info(process_group)
    manifest, error = None, None
    try:
        manifest = manifest_of(path)
    except CheckpointError as e:
        error = str(e)
    _share_errors(error, process_group, distributed, world)
    assert manifest is not None
    if not manifest.verified and rank == 0:
        import logging

        logging.getLogger("distrib.checkpoint").warning(
            "Sharded checkpoint %r has no distrib manifest (plain DCP): its bytes cannot be verified", path
        )
    target = _blank(state_dict) if all_or_nothing else state_dict
    try:
        with _quiet(distributed):
            dcp.load(
                target, storage_reader=_Reader(path, manifest), process_group=process_group, no_dist=not distributed
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        raise _unwrap(e) from e
    if all_or_nothing:  # DCP's last step reports every worker's failure to all: none failed
        _move(target, state_dict)
