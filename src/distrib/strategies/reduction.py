"""Reducing and gathering values over every replica of every worker (``strategy.reduce``, ``gather``,
``ReplicaContext.all_reduce`` / ``all_gather``).

Local replicas are combined first, on the first local device; then the workers,
through the strategy's communicator. Before a collective, the workers check that
they pass the same dtypes and shapes (``Communicator.verify_same``, one small
all-reduce), so a mismatch is a :class:`~distrib.CollectiveError` on every worker
that names what each one had, instead of an aborted process or garbage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from distrib.comm.communicator import describe_tensors
from distrib.values import PerReplica, ReduceOp, local_values, map_leaves, regroup, to_tensor

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["Axis", "reduce_structure", "reduce_local_values", "gather_structure", "gather_local_values"]

Axis = None | int | Sequence[int]


def _axes(axis: Axis, rank: int) -> tuple[int, ...]:
    dims = (axis,) if isinstance(axis, int) else tuple(axis or ())
    for d in dims:
        if not -rank <= d < rank:
            raise ValueError(f"axis {axis!r} is out of range for a value of rank {rank}")
    return tuple(sorted(d % rank for d in dims))


def _leaves_as_per_replica(value: Any) -> Any:
    """A structure whose leaves are PerReplica, from a PerReplica of structures or a structure of PerReplica."""
    if isinstance(value, PerReplica) and value.values and not isinstance(value.values[0], torch.Tensor):
        grouped = regroup(list(value.values))
        if not isinstance(grouped, PerReplica):  # a PerReplica of structures: regroup its elements
            return grouped
    return value


def reduce_structure(strategy: Strategy, op: ReduceOp, value: Any, axis: Axis) -> Any:
    """``strategy.reduce`` of any structure: every leaf reduced, the structure kept."""
    if value is None:  # as TF: nothing to reduce (a step that returned nothing)
        return None
    value = _leaves_as_per_replica(value)
    return map_leaves(lambda leaf: reduce_local_values(strategy, op, _local(strategy, op, leaf, axis), axis), value)


def _local(strategy: Strategy, op: ReduceOp, leaf: Any, axis: Axis) -> tuple[Any, ...]:
    n = strategy.num_local_replicas
    if not isinstance(leaf, PerReplica) and n > 1:
        if op is ReduceOp.SUM and axis is None:
            raise ValueError(
                "strategy.reduce(SUM, value) got a plain value, but this process has "
                f"{n} replicas: pass the PerReplica value that strategy.run returned"
            )
        return (leaf,) * n
    return local_values(leaf, n)


def reduce_local_values(strategy: Strategy, op: ReduceOp, values: Sequence[Any], axis: Axis) -> torch.Tensor:
    """Reduce one value per local replica over all replicas of all workers (``axis``: also along those dims)."""
    device = strategy.local_devices[0]
    tensors = [to_tensor(v, device).detach() for v in values]
    if axis is None:
        dims: tuple[int, ...] = ()
        if len(tensors) > 1:
            total = torch.stack([t.to(tensors[0].device) for t in tensors]).sum(0)
        elif strategy.num_workers > 1:
            total = tensors[0].clone()  # all_reduce works in place: never on the replica's own tensor
        else:  # one replica of one worker: the (detached) value itself, no kernel launched per step
            total = tensors[0]
        count = (
            None if op is ReduceOp.SUM else torch.full((), float(strategy.num_replicas_in_sync), device=total.device)
        )  # a fill: ds.function captures it
    else:
        dims = _axes(axis, tensors[0].dim())
        total = tensors[0].sum(dim=dims) if dims else tensors[0].clone()
        for t in tensors[1:]:
            total = total + (t.sum(dim=dims) if dims else t).to(total.device)
        count = torch.tensor(float(sum(math.prod(t.shape[d] for d in dims) for t in tensors)), device=total.device)
    if strategy.num_workers > 1:
        if not strategy.counts_in_reductions:  # a tensor-parallel group's other workers: the first counts for it
            total = torch.zeros_like(total)
            count = torch.zeros_like(count) if axis is not None and count is not None else count
        comm = strategy.communicator
        comm.verify_same(describe_tensors([total]), "the value given to strategy.reduce")
        comm.all_reduce([total] if axis is None or count is None else [total, count])
    if op is ReduceOp.MEAN:
        assert count is not None
        if not total.is_floating_point():
            total = total.to(torch.get_default_dtype())
        return total / count.to(total.device)
    return total


def gather_structure(strategy: Strategy, value: Any, axis: int) -> Any:
    """``strategy.gather`` of any structure: every leaf concatenated along ``axis``, the structure kept."""
    value = _leaves_as_per_replica(value)
    return map_leaves(
        lambda leaf: gather_local_values(strategy, local_values(leaf, strategy.num_local_replicas), axis), value
    )


def gather_local_values(strategy: Strategy, values: Sequence[Any], axis: int, api: str = "gather") -> torch.Tensor:
    """Concatenate one value per local replica along ``axis``, then over every worker (sizes along it may differ)."""
    parts = [to_tensor(v, strategy.local_devices[0]) for v in values]
    if any(p.is_sparse for p in parts):
        raise NotImplementedError(
            f"{api} does not support sparse tensors (TF: IndexedSlices): {api} "
            "t.to_dense(), or the indices and values separately"
        )
    if parts[0].dim() == 0:
        raise ValueError("gather needs values with at least one dimension; got a scalar (use reduce for scalars)")
    axis = _axes(axis, parts[0].dim())[0]
    local = torch.cat([p.to(parts[0].device) for p in parts], dim=axis)
    if strategy.num_workers == 1:
        return local
    if not strategy.counts_in_reductions:  # a tensor-parallel group's other workers: the first counts for it
        local = local.narrow(axis, 0, 0)
    comm = strategy.communicator
    comm.verify_same(describe_tensors([local], skip_dim=axis), "the value given to gather")
    return comm.all_gather(local, axis)
