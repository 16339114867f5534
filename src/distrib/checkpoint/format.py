"""The data file: what it holds, its checksums, and how it is read without running code.

A data file ``<prefix>.pt`` is one ``torch.save`` of::

    {"format": "distrib-checkpoint", "version": 2, "save_counter": n,
     "objects": {name: state},                                   # plain, whole CPU tensors
     "checksums": {"algorithm": "crc32",
                   "tensors": [[key, crc], ...],                 # every tensor, in file order
                   "structure": crc}}                            # everything but the tensor bytes

``tensors`` holds the CRC-32 of each tensor's bytes under its key (``"model/0.weight"``,
``"optimizer/state/0/exp_avg"``), as TensorFlow's tensor bundles hold a CRC32C per tensor.
``structure`` covers all the rest: names, dtypes, shapes, hyperparameters, the save counter.
Loading recomputes both and refuses a file whose bytes changed, naming the tensor.
The checksum is zlib's CRC-32 (IEEE), not CRC32C: no CRC32C implementation ships with
Python, torch or numpy, and both are 32-bit CRCs that detect every single-bit error and every
error burst of up to 32 bits.

Version 1 files (no checksums) still load, with a logged note that they cannot be verified.
Files are read with ``torch.load(..., weights_only=True)``: a pickled object is refused, never run.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.fileio import describe_os_error
from distrib.tensor_bytes import byte_view

__all__ = ["FORMAT", "VERSION", "encode", "load"]

FORMAT = "distrib-checkpoint"
VERSION = 2
_READABLE = (1, 2)
_ALGORITHM = "crc32"
_log = logging.getLogger("distrib.checkpoint")
_noted_v1: set[str] = set()


# --------------------------------------------------------------- checksums
def _tensor_crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's values as bytes, in row-major order (layout and device do not matter)."""
    t = t.detach().cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    return zlib.crc32(byte_view(t))


def _tensors(obj: Any, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` with its key, depth first, in the containers' own order."""
    # walked by hand, not with pytree: the keys (``a/0/b``) are the file's CRC table, so they must not
    # move with pytree's registrations (an unregistered Mapping would be one leaf, a namedtuple keyed by field)
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{key}/{k}" if key else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{key}/{i}")


def _describe(obj: Any, out: list[str]) -> None:
    """Append a canonical description of ``obj`` with tensors as dtype and shape only."""
    # walked by hand, not with pytree: the description spells each container's kind, its keys, sets and a
    # state dict's ``_metadata``, which a map over leaves does not see
    if isinstance(obj, torch.Tensor):
        out.append(f"T{obj.dtype}{tuple(obj.shape)}{obj.layout}")
    elif isinstance(obj, Mapping):
        out.append(f"D{len(obj)}(")
        for k, v in obj.items():
            _describe(k, out)
            out.append(":")
            _describe(v, out)
        out.append(")")
        metadata = getattr(obj, "_metadata", None)  # a module state_dict's versions, read by load_state_dict
        if metadata is not None:
            out.append("M")
            _describe(metadata, out)
    elif isinstance(obj, (list, tuple)):
        out.append(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}(")
        for v in obj:
            _describe(v, out)
            out.append(",")
        out.append(")")
    elif isinstance(obj, (set, frozenset)):
        out.append(f"S{len(obj)}{sorted(repr(v) for v in obj)}")
    elif isinstance(obj, float):
        out.append(f"F{float.hex(obj) if math.isfinite(obj) else repr(obj)}")
    else:
        out.append(f"{type(obj).__name__}:{obj!r}")


def _structure_crc(data: Mapping[str, Any]) -> int:
    out: list[str] = []
    _describe({k: v for k, v in data.items() if k != "checksums"}, out)
    return zlib.crc32("".join(out).encode("utf-8", "surrogatepass"))


def encode(save_counter: int, objects: dict[str, Any]) -> dict[str, Any]:
    """The dictionary ``torch.save`` writes for ``objects`` (whole CPU tensors), with its checksums."""
    data: dict[str, Any] = {"format": FORMAT, "version": VERSION, "save_counter": save_counter, "objects": objects}
    data["checksums"] = {
        "algorithm": _ALGORITHM,
        "tensors": [[key, _tensor_crc(t)] for key, t in _tensors(objects, "")],
        "structure": _structure_crc(data),
    }
    return data


def _verify(data: Mapping[str, Any], data_file: str) -> None:
    """Recompute every checksum of a version-2 file; CheckpointError naming the first that fails."""
    damaged = f"Checkpoint file {data_file!r} is damaged"
    checks = data.get("checksums")
    if not (
        isinstance(checks, Mapping)
        and checks.get("algorithm") == _ALGORITHM
        and isinstance(checks.get("tensors"), list)
        and isinstance(checks.get("structure"), int)
    ):
        raise CheckpointError(f"{damaged}: its checksum table is missing or unreadable")
    stored = checks["tensors"]
    found = list(_tensors(data["objects"], ""))
    for i, (key, tensor) in enumerate(found):
        if i >= len(stored):
            raise CheckpointError(
                f"{damaged}: tensor {key!r} has no checksum ({len(found)} tensors, {len(stored)} checksums)"
            )
        entry = stored[i]
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == key and isinstance(entry[1], int)):
            raise CheckpointError(f"{damaged}: tensor {key!r} does not match checksum entry {i} ({entry!r:.120})")
        crc = _tensor_crc(tensor)
        if crc != entry[1]:
            raise CheckpointError(
                f"{damaged}: tensor {key!r} fails its CRC-32 checksum (stored {entry[1]:#010x}, "
                f"computed {crc:#010x}). Restore an earlier checkpoint."
            )
    if len(stored) != len(found):
        raise CheckpointError(f"{damaged}: it lists {len(stored)} tensor checksums but holds {len(found)} tensors")
    if _structure_crc(data) != checks["structure"]:
        raise CheckpointError(
            f"{damaged}: its names, shapes, dtypes or settings (not the tensor values) fail their "
            "checksum. Restore an earlier checkpoint."
        )


# --------------------------------------------------------------- reading
def load(data_file: str) -> dict[str, Any]:
    """Read and verify a data file; never executes code stored in it.

    Every failure is a :class:`CheckpointError` naming ``data_file`` and the cause.
    """
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
            "torch.load(..., weights_only=False)."
        ) from e
    except OSError as e:
        raise CheckpointError(f"{corrupt}: reading it failed: {describe_os_error(e)}") from e
    except Exception as e:  # zip errors, bad sizes, huge allocations from damaged headers
        first_line = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise CheckpointError(f"{corrupt} ({type(e).__name__}: {first_line})") from e
    if not (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("objects"), dict)
        and all(isinstance(k, str) for k in data["objects"])
    ):
        raise CheckpointError(corrupt)
    version = data.get("version")
    if type(version) is not int or version not in _READABLE:
        raise CheckpointError(
            f"Checkpoint file {data_file!r} has format version {version!r}; this distrib reads "
            f"versions {list(_READABLE)}"
        )
    counter = data.get("save_counter", 0)
    if type(counter) is not int or counter < 0:
        raise CheckpointError(f"Checkpoint file {data_file!r} is damaged: save_counter is {counter!r}")
    if version == 1:
        if data_file not in _noted_v1:
            _noted_v1.add(data_file)
            _log.warning(
                "Checkpoint file %r has format version 1, written before distrib stored checksums: its "
                "contents cannot be verified. Saving again writes version 2.",
                data_file,
            )
    else:
        _verify(data, data_file)
    return data
