"""The manifest of a sharded checkpoint: distrib's JSON description of DCP's shard files, with checksums.

A sharded checkpoint is a directory that ``torch.distributed.checkpoint`` (DCP) wrote, one
``__<rank>_<n>.distcp`` file per worker, plus DCP's own ``.metadata`` (a pickle, kept so that
plain PyTorch can ``dcp.load`` the directory) and distrib's manifest ``distrib-sharded.json``,
written last, after every worker finished::

    {"format": "distrib-sharded-checkpoint", "version": 1,
     "tensors": {fqn: {"dtype": "float32", "size": [..],
                       "chunks": [{"offsets": [..], "sizes": [..], "file": f, "offset": o, "length": n,
                                   "crc": c}, ..]}},
     "objects": {fqn: {"file": f, "offset": o, "length": n, "crc": c}},      # non-tensor values
     "planner_data": {fqn: [path, ..]},                                      # DCP's flattening
     "files": {name: {"size": n, "crc": c}},                                 # every file beside it
     "checksum": crc}                                                        # of everything above

Every stored item (a tensor chunk or an object, which together cover every byte of every shard
file) has the CRC-32 of its bytes, checked when it is read; every file has its size, checked
before anything is read (a truncated file), and the ``.metadata`` pickle its CRC too. distrib
reads its checkpoints from the manifest alone and never unpickles ``.metadata``: DCP's
``FileSystemReader.read_metadata`` runs a bare ``pickle.load`` on it, so a crafted directory
would run code. A DCP directory without a manifest (written by plain PyTorch) is read with
:func:`safe_load_dcp_metadata`, an unpickler that builds only DCP's metadata classes.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.fileio import describe_os_error

__all__ = [
    "MANIFEST",
    "DCP_METADATA",
    "FORMAT",
    "VERSION",
    "Span",
    "Manifest",
    "encode_manifest",
    "read_manifest",
    "safe_load_dcp_metadata",
    "crc_of_file",
    "unflatten",
    "int_optimizer_keys",
]

MANIFEST = "distrib-sharded.json"
DCP_METADATA = ".metadata"
FORMAT = "distrib-sharded-checkpoint"
VERSION = 1


@dataclass(frozen=True)
class Span:
    """Where one stored item lies: ``length`` bytes at ``offset`` of ``file``; its CRC-32 (None: unknown)."""

    file: str
    offset: int
    length: int
    crc: int | None


@dataclass
class Manifest:
    """What a reader needs: DCP's ``Metadata`` (storage_data maps each item to its :class:`Span`) and the files."""

    metadata: Metadata
    spans: dict[MetadataIndex, Span]
    files: dict[str, dict[str, int]]  # name -> {"size": n, "crc": c (only where the whole file is checked)}
    verified: bool  # False for a plain DCP directory: nothing to check its bytes against


def crc_of_file(path: str, offset: int = 0, length: int | None = None, chunk: int = 1 << 22) -> int:
    """CRC-32 of ``length`` bytes of ``path`` from ``offset`` (to its end when None), read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            block = f.read(chunk if left is None else min(chunk, left))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            if left is not None:
                left -= len(block)
    return crc


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any, where: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return value


def encode_manifest(metadata: Metadata, spans: dict[MetadataIndex, Span], files: dict[str, dict[str, int]]) -> bytes:
    """The manifest's bytes for DCP's global ``metadata`` and the :class:`Span` of every stored item."""
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            chunks = []
            for chunk in md.chunks:
                span = spans[MetadataIndex(fqn, chunk.offsets)]
                chunks.append(
                    {
                        "offsets": list(chunk.offsets),
                        "sizes": list(chunk.sizes),
                        "file": span.file,
                        "offset": span.offset,
                        "length": span.length,
                        "crc": span.crc,
                    }
                )
            tensors[fqn] = {"dtype": _dtype_name(md.properties.dtype), "size": list(md.size), "chunks": chunks}
        else:
            span = spans[MetadataIndex(fqn)]
            objects[fqn] = {"file": span.file, "offset": span.offset, "length": span.length, "crc": span.crc}
    planner_data = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    body = {
        "format": FORMAT,
        "version": VERSION,
        "tensors": tensors,
        "objects": objects,
        "planner_data": planner_data,
        "files": files,
    }
    body["checksum"] = zlib.crc32(_canonical(body))
    return json.dumps(body, indent=0, sort_keys=True).encode()


def _ints(value: Any, where: str) -> list[int]:
    if not (isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)):
        raise CheckpointError(f"{where}: expected a list of non-negative integers, found {value!r:.80}")
    return value


def _span(entry: Any, files: dict[str, Any], where: str) -> Span:
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and entry["file"] in files):
        raise CheckpointError(f"{where}: its file is missing from the manifest's file list")
    offset, length = _ints([entry.get("offset"), entry.get("length")], where)
    crc = entry.get("crc")
    if type(crc) is not int:
        raise CheckpointError(f"{where}: no CRC-32")
    if offset + length > files[entry["file"]]["size"]:
        raise CheckpointError(f"{where}: bytes {offset}..{offset + length} lie past the end of {entry['file']!r}")
    return Span(entry["file"], offset, length, crc)


def read_manifest(directory: str) -> Manifest:
    """Read and check ``directory``'s manifest and the sizes of its files (and the ``.metadata`` CRC).

    Every failure is a :class:`CheckpointError` naming the file: a manifest that is missing,
    damaged or of another version, a file that is missing or has another size (truncated).
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"Sharded checkpoint manifest {path!r} cannot be read: {describe_os_error(e)}") from e
    damaged = f"Sharded checkpoint manifest {path!r} is damaged"
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{damaged}: not JSON ({e})") from e
    if not (isinstance(body, dict) and body.get("format") == FORMAT):
        raise CheckpointError(f"{damaged}: it is not a {FORMAT} manifest")
    if body.get("version") != VERSION:
        raise CheckpointError(f"{path!r} has format version {body.get('version')!r}; this distrib reads {VERSION}")
    stored = body.pop("checksum", None)
    if stored != zlib.crc32(_canonical(body)):
        raise CheckpointError(f"{damaged}: it fails its CRC-32 checksum. Restore an earlier checkpoint.")
    files = body.get("files")
    if not (
        isinstance(files, dict) and all(isinstance(v, dict) and type(v.get("size")) is int for v in files.values())
    ):
        raise CheckpointError(f"{damaged}: its file list is unreadable")
    for name, entry in files.items():
        file = os.path.join(directory, name)
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointError(f"{damaged}: file name {name!r} is not a plain name in the checkpoint directory")
        try:
            size = os.path.getsize(file)
        except OSError as e:
            raise CheckpointError(
                f"Sharded checkpoint file {file!r} is missing or unreadable: {describe_os_error(e)}"
            ) from e
        if size != entry["size"]:
            raise CheckpointError(
                f"Sharded checkpoint file {file!r} is truncated or was changed: it has {size} "
                f"bytes, the manifest says {entry['size']}. Restore an earlier checkpoint."
            )
        if "crc" in entry and crc_of_file(file) != entry["crc"]:
            raise CheckpointError(
                f"Sharded checkpoint file {file!r} fails its CRC-32 checksum (it was changed "
                "after the save). Restore an earlier checkpoint."
            )
    state: dict[str, Any] = {}
    spans: dict[MetadataIndex, Span] = {}
    for fqn, t in (body.get("tensors") or {}).items():
        where = f"{damaged}: tensor {fqn!r}"
        if not (isinstance(t, dict) and isinstance(t.get("chunks"), list)):
            raise CheckpointError(where)
        chunks = []
        for i, c in enumerate(t["chunks"]):
            if not isinstance(c, dict):
                raise CheckpointError(where)
            offsets, sizes = torch.Size(_ints(c.get("offsets"), where)), torch.Size(_ints(c.get("sizes"), where))
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            spans[MetadataIndex(fqn, offsets, i)] = _span(c, files, f"{where}, chunk {i}")
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=_dtype(t.get("dtype"), where)), torch.Size(_ints(t.get("size"), where)), chunks
        )
    for fqn, entry in (body.get("objects") or {}).items():
        state[fqn] = BytesStorageMetadata()
        spans[MetadataIndex(fqn)] = _span(entry, files, f"{damaged}: object {fqn!r}")
    planner_data = body.get("planner_data") or {}
    if not (
        isinstance(planner_data, dict)
        and all(isinstance(p, list) and all(type(k) in (str, int) for k in p) for p in planner_data.values())
    ):
        raise CheckpointError(f"{damaged}: its planner_data is unreadable")
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data={k: tuple(v) for k, v in planner_data.items()},
        storage_data=spans,
        storage_meta=StorageMeta(checkpoint_id=directory),
    )
    return Manifest(metadata, spans, files, verified=True)


# --------------------------------------------------------------- plain DCP directories
#: the only globals a DCP ``.metadata`` pickle may name (torch 2.13 writes exactly these, and dtypes)
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch sizes and dtypes, and nothing else (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def safe_load_dcp_metadata(directory: str) -> Manifest:
    """DCP's ``.metadata`` of a plain DCP directory (no distrib manifest), unpickled without running code.

    A pickle naming any other global (``os.system``, ``builtins.eval``, a class of the
    sender's) is refused with a :class:`CheckpointError` naming the file and the global. The
    bytes of such a directory cannot be verified: no checksums were written.
    """
    path = os.path.join(directory, DCP_METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"Checkpoint metadata {path!r} was refused: {e}. Unpickling it could run arbitrary "
            "code; distrib reads only DCP's own metadata classes from it. Load it with "
            "torch.distributed.checkpoint yourself only if you trust where it came from."
        ) from e
    except OSError as e:
        raise CheckpointError(f"Checkpoint metadata {path!r} cannot be read: {describe_os_error(e)}") from e
    except Exception as e:  # truncated or damaged pickles: EOFError, ValueError, ...
        raise CheckpointError(f"Checkpoint metadata {path!r} is damaged ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"Checkpoint metadata {path!r} does not hold DCP metadata")
    spans: dict[MetadataIndex, Span] = {}
    files: dict[str, dict[str, int]] = {}
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"Checkpoint {directory!r} was written with DCP stream extensions "
                f"{info.transform_descriptors}, which distrib does not read"
            )
        if not (isinstance(index, MetadataIndex) and isinstance(name, str) and os.path.basename(name) == name):
            raise CheckpointError(f"Checkpoint metadata {path!r} is damaged: bad storage entry {index!r:.80}")
        spans[index] = Span(name, int(info.offset), int(info.length), None)
        try:
            files[name] = {"size": os.path.getsize(os.path.join(directory, name))}
        except OSError as e:
            raise CheckpointError(
                f"Checkpoint file {os.path.join(directory, name)!r} is missing: {describe_os_error(e)}"
            ) from e
    metadata.storage_data = spans
    return Manifest(metadata, spans, files, verified=False)


def stored_whole(x: Any) -> bool:
    """Whether DCP saves ``x`` as one pickled object rather than walking into it: a tuple (its traversal,
    ``torch.distributed.checkpoint._traverse``, enters mappings and lists only). A load replaces such
    an object whole, so the tensors inside it are no load targets: an ``is_leaf`` for pytree."""
    return isinstance(x, tuple)


def unflatten(flat: dict[str, Any], planner_data: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Nest DCP's flat ``{fqn: value}`` again along ``planner_data``'s paths (an int is a list index)."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = planner_data.get(fqn, (fqn,))
        node: Any = root
        for key, nxt in zip(path[:-1], path[1:]):
            child = (
                node[key]
                if (isinstance(node, list) and key < len(node)) or (isinstance(node, dict) and key in node)
                else None
            )
            if child is None:
                child = [] if isinstance(nxt, int) else {}
                if isinstance(node, list):
                    node.extend([None] * (key + 1 - len(node)))
                node[key] = child
            node = child
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


def int_optimizer_keys(state: Any) -> Any:
    """``state`` with an optimizer state dict's ``state`` keyed by int parameter ids again (DCP stores every
    dict key as a string; torch's ``Optimizer.load_state_dict`` would file ``"0"`` apart from parameter 0)."""
    if isinstance(state, dict) and isinstance(state.get("state"), dict) and isinstance(state.get("param_groups"), list):
        state["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state["state"].items()}
    return state
