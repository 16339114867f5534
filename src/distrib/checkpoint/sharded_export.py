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
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from distrib.checkpoint import format as fmt
from distrib.checkpoint import sharded_format as sf
from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.fileio import TEMP_PREFIX, describe_os_error
from distrib.checkpoint.sharded import load_object, manifest_of, read_item
from distrib.tensor_bytes import byte_view
from distrib.torch_patches import fake_tensor_mode

__all__ = ["consolidate"]


def _fill(directory: str, manifest: sf.Manifest, fqn: str, into: torch.Tensor) -> None:
    """Copy every stored chunk of tensor ``fqn`` into its region of ``into`` (the whole tensor)."""
    md = manifest.metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata)
    for i, chunk in enumerate(md.chunks):
        span = manifest.spans[MetadataIndex(fqn, chunk.offsets, i)]
        what = f"{fqn!r} (chunk at {list(chunk.offsets)})"
        piece = load_object(read_item(directory, span, what), os.path.join(directory, span.file), what)
        if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"Sharded checkpoint file {os.path.join(directory, span.file)!r}: {what} is not a "
                                  f"tensor of shape {tuple(chunk.sizes)}")
        region = into
        for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region = region.narrow(dim, start, length)
        region.copy_(piece)


def _record_offsets(path: str, order: list[str], flat: dict[str, Any]) -> dict[str, int]:
    """Where in the skeleton file ``path`` each tensor's bytes go, by fqn (``order``: the file's tensor order).

    ``torch.save`` stores storage ``i`` (in the order the pickle meets them) as the zip record
    ``<archive>/data/<i>``, uncompressed. The offsets come from the zip directory; the pairing is
    then checked against torch's own reading of the file (``torch.load(mmap=True)`` maps every
    storage at the file offset of its record; no page is touched), so a change in torch's layout
    is an error, never a file with tensors in each other's places.
    """
    records: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            head, _, key = info.filename.rpartition("/")
            if head.endswith("/data") or head == "data":
                f.seek(info.header_offset)
                local = f.read(30)
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                records[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    mapped = torch.load(path, mmap=True, weights_only=True)
    pointers = [t.untyped_storage().data_ptr() for _, t in fmt._tensors(mapped["objects"], "")]
    offsets: dict[str, int] = {}
    bases = set()
    for i, fqn in enumerate(order):
        offset, size = records.get(str(i), (-1, -1))
        nbytes = flat[fqn].numel() * flat[fqn].element_size()
        if size != nbytes:
            raise CheckpointError(f"Cannot consolidate: torch.save laid out {path!r} unlike what distrib expects "
                                  f"(record {i} for {fqn!r}: {size} bytes, the tensor has {nbytes})")
        offsets[fqn] = offset
        if nbytes:
            bases.add(pointers[i] - offset)
    if len(bases) > 1:
        raise CheckpointError(f"Cannot consolidate: torch.save's records in {path!r} are not in the order distrib "
                              "expects (a torch version it does not know)")
    del mapped
    return offsets


def consolidate(directory: "str | os.PathLike[str]", out_file: "str | os.PathLike[str]", *,
                save_counter: int = 0) -> str:
    """Write the sharded checkpoint ``directory`` as one distrib checkpoint file ``out_file``; return it.

    ``out_file`` is the data file itself (``<prefix>.pt``; ``Checkpoint.restore(<prefix>)`` reads
    it, its ``objects`` being the saved state dict's top-level entries). ``save_counter`` is
    stored for ``Checkpoint.restore``. Peak memory: the largest tensor, plus one chunk (a 50M-parameter model with Adam:
    +66 MB). Every
    chunk is CRC-checked as it is read; a damaged directory is a :class:`CheckpointError` naming
    the file, and ``out_file`` is then left as it was.
    """
    src = os.path.abspath(os.fspath(directory))
    out = os.path.abspath(os.fspath(out_file))
    manifest = manifest_of(src)
    md = manifest.metadata
    flat: dict[str, Any] = {}
    with fake_tensor_mode():
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                flat[fqn] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            span = manifest.spans[MetadataIndex(fqn)]
            flat[fqn] = load_object(read_item(src, span, f"value {fqn!r}"), os.path.join(src, span.file),
                                    f"value {fqn!r}")
    objects = sf.unflatten(flat, md.planner_data or {})
    fqn_of = {id(t): fqn for fqn, t in flat.items() if isinstance(t, torch.Tensor)}
    crcs: dict[str, int] = {}
    for fqn in fqn_of.values():  # pass one: checksums, one whole tensor at a time
        whole = torch.empty(tuple(flat[fqn].shape), dtype=flat[fqn].dtype)
        _fill(src, manifest, fqn, whole)
        crcs[fqn] = fmt._tensor_crc(whole)
        del whole
    keys = [(key, fqn_of[id(t)]) for key, t in fmt._tensors(objects, "")]
    data: dict[str, Any] = {"format": fmt.FORMAT, "version": fmt.VERSION, "save_counter": save_counter,
                            "objects": objects}
    data["checksums"] = {"algorithm": "crc32", "tensors": [[key, crcs[fqn]] for key, fqn in keys],
                         "structure": fmt._structure_crc(data)}
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
        offsets = _record_offsets(tmp, [fqn for _, fqn in keys], flat)
        with open(tmp, "r+b") as f:
            for _, fqn in keys:  # ... then written in place, one whole tensor at a time
                whole = torch.empty(tuple(flat[fqn].shape), dtype=flat[fqn].dtype)
                _fill(src, manifest, fqn, whole)
                if whole.numel():
                    os.pwrite(f.fileno(), byte_view(whole), offsets[fqn])
                del whole
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"Writing {out!r} failed: {describe_os_error(e)}") from e
        raise
    return out
