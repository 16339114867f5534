"""The readers every restore of a sharded checkpoint goes through: a tensor whole from its chunks, and the
saved structure from the manifest alone.

``Checkpoint.restore`` of a ``.dcp`` directory (``sharded_objects.py``) and the export to one file
(``sharded_export.consolidate``) both read with these; every item read is CRC-checked
(``sharded.read_item``) and loaded with ``weights_only`` (``sharded.load_object``): nothing is unpickled as code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from distrib.checkpoint import sharded_format as sf
from distrib.checkpoint.errors import CheckpointError
from distrib.checkpoint.sharded import load_object, read_item

__all__ = ["fill_tensor", "read_structure"]


def fill_tensor(directory: str, manifest: sf.Manifest, fqn: str, into: torch.Tensor) -> None:
    """Copy every stored chunk of tensor ``fqn`` into its region of ``into`` (the whole tensor)."""
    md = manifest.metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata)
    for i, chunk in enumerate(md.chunks):
        span = manifest.spans[MetadataIndex(fqn, chunk.offsets, i)]
        what = f"{fqn!r} (chunk at {list(chunk.offsets)})"
        piece = load_object(read_item(directory, span, what), os.path.join(directory, span.file), what)
        if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != tuple(chunk.sizes):
            raise CheckpointError(
                f"Sharded checkpoint file {os.path.join(directory, span.file)!r}: {what} is not a "
                f"tensor of shape {tuple(chunk.sizes)}"
            )
        region = into
        for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region = region.narrow(dim, start, length)
        region.copy_(piece)


def read_structure(
    directory: str, manifest: sf.Manifest, tensor_for: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The saved state dict nested again, from the checked manifest alone, and its tensors by DCP key.

    Each tensor is what ``tensor_for(fqn, size, dtype)`` makes: a fake or ``meta`` one (a shape and a dtype,
    no storage) or one filled with :func:`fill_tensor`; every other value is read (CRC-checked, never
    unpickled as code).
    """
    tensors: dict[str, torch.Tensor] = {}
    flat: dict[str, Any] = {}
    for fqn, entry in manifest.metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            flat[fqn] = tensors[fqn] = tensor_for(fqn, tuple(entry.size), entry.properties.dtype)
        else:
            span = manifest.spans[MetadataIndex(fqn)]
            flat[fqn] = load_object(
                read_item(directory, span, f"value {fqn!r}"), os.path.join(directory, span.file), f"value {fqn!r}"
            )
    return sf.unflatten(flat, manifest.metadata.planner_data or {}), tensors
