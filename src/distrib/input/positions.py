"""Global data positions: the ``(x, y, global_batch_size)`` elements ``fit`` takes, from a position.

Which steps are counted, how passes follow each other, ``set_epoch``: one definition, here, so that the
input package needs nothing from the strategies (the executors, ``strategies/execution.py`` and the
parameter-server one, import it from here, never the reverse).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["numbered_batches", "split_xy"]


def split_xy(batch: Any) -> tuple[Any, Any]:
    """``(x, y)`` of a batch ``x``, ``(x,)`` or ``(x, y, ...)`` (``y`` is None when absent)."""
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return batch, None


def numbered_batches(data: Iterable[Any], start: int = 0, cycle: bool = False) -> Iterator[tuple[Any, Any, int]]:
    """``(x, y, global_batch_size)`` for the batches of ``data`` from position ``start``.

    Position p is the p-th batch since the start; with ``cycle`` the data is read
    again when it ends, calling its ``set_epoch(pass)`` when it has one, so a resumed
    run replays the same batches from the same place.

    Example::

        >>> import torch
        >>> [(x.tolist(), n) for x, _, n in numbered_batches([torch.ones(2), torch.zeros(3)], start=1)]
        [([0.0, 0.0, 0.0], 3)]
    """
    skip = start
    passes: Iterable[int | None] = itertools.count() if cycle else [None]
    for n_pass in passes:
        if n_pass is not None and hasattr(data, "set_epoch"):
            data.set_epoch(n_pass)
        empty = True
        for batch in data:
            empty = False
            if skip > 0:
                skip -= 1
                continue
            x, y = split_xy(batch)
            yield x, y, len(x)
        if empty:
            return
