"""Values that live on several replicas at once, and how they are reduced.

``strategy.run`` returns a :class:`PerReplica` when the process drives more than
one replica: one value per local replica, in replica order. Reductions across
replicas (and across workers) go through :class:`ReduceOp`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["ReduceOp", "PerReplica", "parse_reduce_op", "select_replica", "regroup", "local_values"]


class ReduceOp(enum.Enum):
    """How values from several replicas are combined (``tf.distribute.ReduceOp``)."""

    SUM = "SUM"
    MEAN = "MEAN"


def parse_reduce_op(reduce_op: ReduceOp | str) -> ReduceOp:
    """``ReduceOp`` from itself or its name in any case (``"sum"``, ``"MEAN"``)."""
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    try:
        return ReduceOp(str(reduce_op).upper())
    except ValueError:
        raise ValueError(
            f"unknown reduce op {reduce_op!r}: use ds.ReduceOp.SUM or ds.ReduceOp.MEAN (or 'sum' / 'mean')"
        ) from None


class PerReplica:
    """One value per local replica, as returned by ``strategy.run``.

    ``values`` is a tuple ordered by local replica id. Pass it back to
    ``strategy.run`` and each replica receives its own element; give it to
    ``strategy.reduce`` or ``strategy.gather`` to combine the elements.

    It has no ``len()`` and is not iterable: code ported from a single device would read the number of
    replicas as a batch size; both raise ``TypeError`` naming ``.values``.

    Args:
        values: one value per local replica, in local replica order (stored as the tuple ``values``).

    Example::

        >>> import distrib as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> v = s.run(lambda: torch.tensor(float(ds.get_replica_context().replica_id_in_sync_group)))
        >>> v.values
        (tensor(0.), tensor(1.))
    """

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)

    def __len__(self) -> int:
        # ported code reads len(x) as the batch size; here it would be the replica count: refuse
        raise TypeError(
            f"a PerReplica value has no len(): it holds one value per local replica ({len(self.values)} here), "
            "not a batch. Use x.values (a tuple, one per replica), or take len() inside the replica function"
        )

    def __iter__(self) -> Any:
        raise TypeError(
            "a PerReplica value is not iterable: use .values (a tuple, one per replica), or "
            "strategy.experimental_local_results(x)"
        )

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"PerReplica:{{\n  {inner}\n}}"


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def select_replica(replica_id: int, structure: Any) -> Any:
    """Replace every :class:`PerReplica` leaf of ``structure`` by its ``replica_id`` element."""
    return pytree.tree_map(
        lambda x: x.values[replica_id] if isinstance(x, PerReplica) else x,
        structure,
        is_leaf=_is_per_replica,
    )


def regroup(per_replica_results: Sequence[Any]) -> Any:
    """Turn a list of same-shaped structures (one per replica) into one structure of PerReplica leaves.

    A single result is returned as it is: a process with one replica gets plain values.
    """
    if len(per_replica_results) == 1:
        return per_replica_results[0]
    flat, spec = zip(*(pytree.tree_flatten(r) for r in per_replica_results))
    first = spec[0]
    for i, other in enumerate(spec[1:], start=1):
        if other != first:
            raise ValueError(
                f"replica 0 and replica {i} returned values of different structure "
                f"({first} vs {other}); every replica's function must return the same structure"
            )
    leaves = [PerReplica(vals) for vals in zip(*flat)]
    return pytree.tree_unflatten(leaves, first)


def local_values(value: Any, num_local_replicas: int) -> tuple[Any, ...]:
    """The per-local-replica values of ``value``: its elements if it is PerReplica, else itself once."""
    if isinstance(value, PerReplica):
        if len(value.values) != num_local_replicas:
            raise ValueError(
                f"PerReplica holds {len(value.values)} values but this strategy has {num_local_replicas} local replicas"
            )
        return value.values
    return (value,)


def map_leaves(fn: Callable[[Any], Any], structure: Any) -> Any:
    """``fn`` applied to every leaf (PerReplica counts as a leaf)."""
    return pytree.tree_map(fn, structure, is_leaf=_is_per_replica)


def to_tensor(x: Any, device: torch.device | None = None) -> torch.Tensor:
    """A tensor for ``x`` (numbers become float tensors), on ``device`` if given."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, dtype=torch.get_default_dtype() if isinstance(x, float) else None)
    return x.to(device) if device is not None and x.device != device else x


def to_device(structure: Any, device: torch.device | None) -> Any:
    """Every tensor leaf of ``structure`` on ``device`` (None: where it is)."""
    if device is None:
        return structure
    return map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, structure)
