"""Variable partitioners (``tf.distribute.experimental.partitioners``).

A partitioner is called as ``partitioner(shape, dtype)`` and returns a list with
one entry per dimension: the number of shards along dim 0 first, 1 everywhere
else. ``ParameterServerStrategy(cluster_resolver, variable_partitioner=...)``
splits every parameter built in its scope along dim 0 into that many shards
(the first ``dim0 % shards`` shards one row longer, TF's "div" strategy) and places
the shards round robin on the ps tasks. The shard counts follow TF's rules exactly:

* ``FixedShardsPartitioner(n)``: ``min(n, shape[0])``;
* ``MinSizePartitioner(min_shard_bytes, max_shards)``: as many shards as keep each at
  least ``min_shard_bytes``: ``max(1, min(shape[0], max_shards, ceil(bytes / min_shard_bytes)))``;
* ``MaxSizePartitioner(max_shard_bytes, max_shards)``: as few shards as keep each at most
  ``max_shard_bytes`` (whole rows; a row larger than that gets a shard of its own):
  ``ceil(shape[0] / max(1, floor(max_shard_bytes / row_bytes)))``, capped by ``max_shards``.

Example::

    >>> import torch
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), torch.float32)
    [6, 1]
    >>> FixedShardsPartitioner(num_shards=2)((10, 3), torch.float32)
    [2, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]

ShapeLike = Sequence[int] | torch.Size


def _element_size(dtype: torch.dtype | str | None, bytes_per_string: int) -> int:
    if dtype is None:
        dtype = torch.get_default_dtype()
    if isinstance(dtype, str):  # TF's "string" dtype has no torch equivalent; priced like TF
        return bytes_per_string
    return torch.empty((), dtype=dtype).element_size()


def _dims(shape: ShapeLike) -> list[int]:
    dims = [int(d) for d in shape]
    if not dims:
        raise ValueError("cannot partition a scalar (shape ()); partitioners need a shape with at least one dimension")
    return dims


class Partitioner:
    """Base class: ``__call__(shape, dtype, axis=0)`` returns the number of shards per dimension."""

    def __call__(self, shape: ShapeLike, dtype: torch.dtype | str | None = None, axis: int = 0) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards (fewer if dim 0 has fewer rows).

    ``ParameterServerStrategy(resolver, variable_partitioner=FixedShardsPartitioner(n))`` splits every
    parameter built in its scope into ``min(n, rows)`` shards along dim 0; called as
    ``partitioner(shape, dtype)``, it returns ``[min(n, shape[0]), 1, ...]``.

    Args:
        num_shards: how many shards each parameter gets (at most one per row).

    Raises:
        ValueError: ``num_shards`` is not a positive int.

    Example::

        >>> FixedShardsPartitioner(num_shards=4)((3, 8), torch.float32)
        [3, 1]
    """

    def __init__(self, num_shards: int) -> None:
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"FixedShardsPartitioner(num_shards={num_shards!r}): num_shards must be a positive int")
        self.num_shards = num_shards

    def __call__(self, shape: ShapeLike, dtype: torch.dtype | str | None = None, axis: int = 0) -> list[int]:
        dims = _dims(shape)
        result = [1] * len(dims)
        result[axis] = min(self.num_shards, dims[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards})"


class MinSizePartitioner(Partitioner):
    """Shards of at least ``min_shard_bytes`` each, at most ``max_shards`` of them.

    As many shards as keep each at least ``min_shard_bytes``: called as ``partitioner(shape, dtype)``, it
    returns ``[max(1, min(shape[0], max_shards, ceil(bytes / min_shard_bytes))), 1, ...]`` (TF's rule). It
    keeps small parameters whole while spreading large ones over the ps tasks.

    Args:
        min_shard_bytes: the least bytes a shard holds (256 KiB by default).
        max_shards: the most shards a parameter gets (1 by default: no sharding unless raised; the number of
            ps tasks is the usual choice).
        bytes_per_string: the bytes an element of TF's ``"string"`` dtype (given as a str) is priced at.

    Raises:
        ValueError: an argument is not positive.

    Example::

        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32)
        [6, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16) -> None:
        if min_shard_bytes < 1:
            raise ValueError(f"MinSizePartitioner(min_shard_bytes={min_shard_bytes!r}): must be positive")
        if max_shards < 1:
            raise ValueError(f"MinSizePartitioner(max_shards={max_shards!r}): must be positive")
        if bytes_per_string < 1:
            raise ValueError(f"MinSizePartitioner(bytes_per_string={bytes_per_string!r}): must be positive")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape: ShapeLike, dtype: torch.dtype | str | None = None, axis: int = 0) -> list[int]:
        dims = _dims(shape)
        if axis >= len(dims):
            raise ValueError(f"cannot partition along axis {axis} a shape of rank {len(dims)}: {tuple(dims)}")
        total_bytes = math.prod(dims) * _element_size(dtype, self.bytes_per_string)
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self.max_shards, int(math.ceil(total_bytes / self.min_shard_bytes))))
        return result

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards})"


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each below ``max_shard_bytes`` (``max_shards`` takes precedence).

    Shards hold whole rows: called as ``partitioner(shape, dtype)``, it returns
    ``[ceil(shape[0] / max(1, floor(max_shard_bytes / row_bytes))), 1, ...]``, capped by ``max_shards``
    (TF's rule); a row larger than ``max_shard_bytes`` gets a shard of its own. It bounds the size of each
    message to and from a ps task.

    Args:
        max_shard_bytes: the most bytes a shard holds (exceeded only by a single row that is larger).
        max_shards: the most shards a parameter gets; None: no cap.
        bytes_per_string: the bytes an element of TF's ``"string"`` dtype (given as a str) is priced at.

    Raises:
        ValueError: ``max_shard_bytes`` or ``bytes_per_string`` is not positive, or ``max_shards`` is neither
            positive nor None.

    Example::

        >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
        [2, 1]
        >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), torch.float32)
        [1, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"MaxSizePartitioner(max_shard_bytes={max_shard_bytes!r}): must be positive")
        if max_shards is not None and max_shards < 1:
            raise ValueError(f"MaxSizePartitioner(max_shards={max_shards!r}): must be positive or None")
        if bytes_per_string < 1:
            raise ValueError(f"MaxSizePartitioner(bytes_per_string={bytes_per_string!r}): must be positive")
        self.max_shard_bytes = max_shard_bytes
        self.max_shards = max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape: ShapeLike, dtype: torch.dtype | str | None = None, axis: int = 0) -> list[int]:
        dims = _dims(shape)
        element = _element_size(dtype, self.bytes_per_string)
        result = [1] * len(dims)
        if dims[axis] == 0:
            return result
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[axis]) * element
        slices_per_shard = max(1, math.floor(self.max_shard_bytes / bytes_per_slice)) if bytes_per_slice else dims[axis]
        shards = int(math.ceil(1.0 * dims[axis] / slices_per_shard))
        if self.max_shards:
            shards = min(self.max_shards, shards)
        result[axis] = shards
        return result

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"


def shard_offsets(rows: int, num_shards: int) -> list[int]:
    """Row offsets of ``num_shards`` shards of ``rows`` rows ("div": the first ``rows % n`` get one more).

    >>> shard_offsets(10, 4)
    [0, 3, 6, 8, 10]
    """
    base, extra = divmod(rows, num_shards)
    offsets = [0]
    for i in range(num_shards):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets
