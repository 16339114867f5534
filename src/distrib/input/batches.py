"""Batches as structures of tensors: split along dim 0, moved to a device, emptied, described, fingerprinted."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from distrib.tensor_bytes import byte_view

__all__ = [
    "TensorSpec",
    "batch_len",
    "empty_like",
    "fingerprint",
    "part_bounds",
    "peek_spec",
    "shapes_fingerprint",
    "spec_of",
    "split_batch",
    "to_device",
]


def _as_tensor(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if hasattr(leaf, "__array__") and not isinstance(leaf, (str, bytes)):
        return torch.as_tensor(leaf)
    return leaf


def split_batch(batch: Any, num_parts: int) -> list[Any]:
    """Split every tensor of ``batch`` along dim 0 into ``num_parts`` near-equal parts.

    The first ``len % num_parts`` parts get one extra example. Non-tensor leaves are
    given to every part unchanged.
    """
    leaves, spec = pytree.tree_flatten(batch)
    leaves = [_as_tensor(x) for x in leaves]
    if num_parts > 1 and any(isinstance(x, torch.Tensor) and x.dim() == 0 for x in leaves):
        raise ValueError(
            f"a batch holds a 0-d tensor, which cannot be split across {num_parts} replicas: batch "
            "the input first (e.g. DataLoader(dataset, batch_size=...)), so that every tensor has a "
            "batch dimension"
        )
    sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"cannot split a batch whose tensors have different sizes along dim 0: {sorted(sizes)}")
    parts_per_leaf = [
        torch.tensor_split(x, num_parts) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * num_parts
        for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in parts_per_leaf], spec) for i in range(num_parts)]


def part_bounds(length: int, num_parts: int, first: int, count: int) -> tuple[int, int]:
    """Where parts ``first .. first+count-1`` of :func:`split_batch`'s ``num_parts`` parts of ``length`` examples
    lie: ``[lo, hi)`` along dim 0 (the first ``length % num_parts`` parts hold one more example).

    Example::

        >>> part_bounds(6, 4, 2, 2)  # 6 examples over 4 replicas are 2, 2, 1, 1: the last two hold [4, 6)
        (4, 6)
    """
    base, extra = divmod(length, num_parts)

    def start(part: int) -> int:
        return part * base + min(part, extra)

    return start(first), start(first + count)


def to_device(batch: Any, device: torch.device | None, pin: bool = False) -> Any:
    """``batch`` with every tensor on ``device`` (None: as it is). From pinned host memory the copy is
    ``non_blocking``; ``pin`` first pins host tensors bound for a CUDA device (TF's ``fetch_to_device``)."""
    if device is None:
        return batch
    pin = pin and device.type == "cuda"

    def move(x: Any) -> Any:
        x = _as_tensor(x)
        if isinstance(x, torch.Tensor) and x.device != device:
            if pin and x.device.type == "cpu" and not x.is_pinned():
                x = x.pin_memory()
            return x.to(device, non_blocking=x.is_pinned())
        return x

    return pytree.tree_map(move, batch)


def empty_like(batch: Any) -> Any:
    """``batch`` with every tensor cut to 0 examples along dim 0 (what a replica gets when nothing is left)."""
    return pytree.tree_map(lambda x: x[:0] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, batch)


def batch_len(batch: Any) -> int:
    """The size along dim 0 of ``batch``'s first batched tensor (0 when it has none)."""
    sizes = [x.shape[0] for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return sizes[0] if sizes else 0


def fingerprint(batch: Any) -> int:
    """A cheap checksum of a global batch: shapes and the first bytes of every tensor."""
    crc = 0
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            head = leaf.detach().reshape(-1)[:256].contiguous().cpu()
            crc = zlib.crc32(str(tuple(leaf.shape)).encode(), crc)
            crc = zlib.crc32(byte_view(head), crc)
    return crc


def shapes_fingerprint(batch: Any) -> int:
    """A checksum of ``batch``'s structure: every tensor's number of dimensions and dtype (equal on workers that
    read the same data, whatever share of a batch each holds). Not the sizes past dim 0: a ``collate_fn`` that pads
    to the longest example pads each worker's share to its own longest."""
    described = [(x.dim(), str(x.dtype)) for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    return zlib.crc32(repr(described).encode())


@dataclass(frozen=True)
class TensorSpec:
    """The shape (``None`` for the batch dimension) and dtype of a tensor (``tf.TensorSpec``).

    What a distributed dataset's or iterator's ``element_spec`` holds in place of each tensor of one replica's
    element: the structure of the input without its data, e.g. to check it before a step is traced.

    Attributes:
        shape: the tensor's shape, with None for dimension 0 (the batch dimension, whose size may vary);
            ``()`` for a scalar.
        dtype: the tensor's dtype.
    """

    shape: tuple[int | None, ...]
    dtype: torch.dtype


def spec_of(batch: Any) -> Any:
    """``batch``'s structure with every tensor replaced by its :class:`TensorSpec` (batch dimension None)."""
    return pytree.tree_map(
        lambda x: TensorSpec((None, *x.shape[1:]) if x.dim() else (), x.dtype) if isinstance(x, torch.Tensor) else x,
        batch,
    )


def peek_spec(dataset: Iterable[Any]) -> Any:
    """The spec of a re-iterable dataset's first batch (a fresh iterator: iteration is not disturbed)."""
    iterator = iter(dataset)
    if iterator is dataset:
        raise ValueError(
            "element_spec of a one-pass iterator would consume its first batch: take it from the "
            "distributed iterator instead (it = iter(dist_dataset); it.element_spec)"
        )
    first = next(iterator, None)
    if first is None:
        raise ValueError("element_spec of an empty dataset is unknown")
    return spec_of(first)
