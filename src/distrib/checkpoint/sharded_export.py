"""Export a sharded checkpoint as one distrib checkpoint file, never holding the whole model at once.

``consolidate(directory, out_file)`` writes ``out_file`` in distrib's own format
(``format.py``: ``torch.save`` of plain whole tensors with a CRC-32 each, loadable by
``Checkpoint.restore`` under any strategy, and by plain PyTorch with
``torch.load(out_file, weights_only=True)["objects"]``). torch's ``dcp_to_torch_save`` loads
every tensor of the checkpoint into one state dict first; this export holds one whole tensor at
a time:

1. the skeleton (names, dtypes, shapes, plain values) is built from the manifest with fake
   tensors, which have no storage;
2. pass one assembles each tensor from its chunks (each read CRC-checked), takes its CRC-32 for
   the format's checksum table, and drops it;
3. the skeleton with the checksums is saved under ``torch.serialization.skip_data``, which
   reserves each tensor's bytes without writing them; pass two assembles each tensor again and
   writes it at its record's offset in the file (``os.pwrite``; see :func:`_record_offsets`);
4. the file is fsync'ed and renamed over ``out_file`` (atomic: the old file or the new one).

Run it in one process (any process: no group is needed), e.g. on the chief after a save.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import zipfile
from typing import Any

import torch

from distrib.checkpoint import format as fmt
from distrib.checkpoint import sharded_format as sf
from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.fileio import TEMP_PREFIX, describe_os_error
from distrib.checkpoint.sharded import manifest_of
from distrib.checkpoint.sharded_readers import fill_tensor, read_structure
from distrib.tensor_bytes import byte_view
from distrib.torch_patches import fake_tensor_mode

__all__ = ["consolidate"]


def _record_offsets(path: str, by_key: dict[str, str], flat: dict[str, Any]) -> dict[str, int]:
    """Where in the skeleton file ``path`` each tensor's bytes go, by fqn (``by_key``: format key -> fqn).

    ``torch.save`` stores each storage as an uncompressed zip record ``<archive>/data/<n>``; the
    records' data offsets come from the zip directory. Which record is which tensor is torch's own
    answer: ``torch.load(mmap=True)`` maps the file once and every storage at its record's offset
    (no page is touched), so a tensor's offset is its address minus the mapping's base. Every
    tensor must land on a record of its own size, or the export stops with an error, never
    writing tensors in each other's places.
    """
    records: dict[int, int] = {}  # data offset -> size
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if info.filename.rpartition("/")[0].endswith("data") and info.file_size:
                f.seek(info.header_offset)
                name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
                records[info.header_offset + 30 + name_len + extra_len] = info.file_size
    mapped = torch.load(path, mmap=True, weights_only=True)
    found = [
        (by_key[key], t.untyped_storage().data_ptr()) for key, t in fmt._tensors(mapped["objects"], "") if t.numel()
    ]
    del mapped
    offsets = {fqn: 0 for fqn, t in flat.items() if isinstance(t, torch.Tensor)}
    if not found:
        return offsets
    base = min(ptr for _, ptr in found) - min(records, default=0)
    for fqn, ptr in found:
        nbytes = flat[fqn].numel() * flat[fqn].element_size()
        if records.get(ptr - base) != nbytes:
            raise CheckpointError(
                f"Cannot consolidate: torch.save laid out {path!r} unlike what distrib expects "
                f"(no record of {nbytes} bytes where {fqn!r} is mapped); a torch version it "
                "does not know"
            )
        offsets[fqn] = ptr - base
    if len(set(offsets.values())) != len(offsets) and len(found) == len(offsets):
        raise CheckpointError(f"Cannot consolidate: two tensors share a record in {path!r}")
    return offsets


def consolidate(directory: str | os.PathLike[str], out_file: str | os.PathLike[str], *, save_counter: int = 0) -> str:
    """Write the sharded checkpoint ``directory`` as one distrib checkpoint file ``out_file``; return it.

    ``out_file`` is the data file itself (``<prefix>.pt``; ``Checkpoint.restore(<prefix>)`` reads
    it, its ``objects`` being the saved state dict's top-level entries, or, for a directory that
    ``ds.Checkpoint`` wrote under a sharded strategy, its objects and its save counter). ``save_counter``
    is stored for ``Checkpoint.restore``. Peak memory: the largest tensor, plus one chunk (a
    50M-parameter model with Adam: +66 MB). Every chunk is CRC-checked as it is read; a damaged directory is a :class:`CheckpointError` naming
    the file, and ``out_file`` is then left as it was.
    """
    src = os.path.abspath(os.fspath(directory))
    out = os.path.abspath(os.fspath(out_file))
    manifest = manifest_of(src)
    mode = fake_tensor_mode()

    def fake(fqn: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with mode:
            return torch.empty(size, dtype=dtype)

    objects, flat = read_structure(src, manifest, fake)
    if set(objects) == {"save_counter", "objects"} and isinstance(objects["objects"], dict):
        save_counter, objects = int(objects["save_counter"]), objects["objects"]  # ds.Checkpoint's directory
    for state in objects.values():
        sf.int_optimizer_keys(state)
    fqn_of = {id(t): fqn for fqn, t in flat.items()}
    crcs: dict[str, int] = {}
    for fqn in fqn_of.values():  # pass one: checksums, one whole tensor at a time
        whole = torch.empty(tuple(flat[fqn].shape), dtype=flat[fqn].dtype)
        fill_tensor(src, manifest, fqn, whole)
        crcs[fqn] = fmt._tensor_crc(whole)
        del whole
    keys = [(key, fqn_of[id(t)]) for key, t in fmt._tensors(objects, "")]
    data: dict[str, Any] = {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "save_counter": save_counter,
        "objects": objects,
    }
    data["checksums"] = {
        "algorithm": "crc32",
        "tensors": [[key, crcs[fqn]] for key, fqn in keys],
        "structure": fmt._structure_crc(data),
    }
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}consolidate-{os.getpid()}-", dir=parent)
        os.close(fd)
    except OSError as e:
        raise CheckpointError(f"Cannot write {out!r}: {describe_os_error(e)}") from e
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True), open(tmp, "wb") as f:
            torch.save(data, f)  # pass two: the skeleton, its tensors' bytes reserved ...
        offsets = _record_offsets(tmp, dict(keys), flat)
        with open(tmp, "r+b") as out_f:
            for _, fqn in keys:  # ... then written in place, one whole tensor at a time
                whole = torch.empty(tuple(flat[fqn].shape), dtype=flat[fqn].dtype)
                fill_tensor(src, manifest, fqn, whole)
                if whole.numel():
                    os.pwrite(out_f.fileno(), byte_view(whole), offsets[fqn])
                del whole
            os.fsync(out_f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"Writing {out!r} failed: {describe_os_error(e)}") from e
        raise
    return out
