"""torch's FSDP2 and DTensor, as ``ShardedStrategy`` uses them: one module for every such call.

Nothing here is written again: sharding is ``torch.distributed.fsdp.fully_shard`` over a
``DeviceMesh`` of the strategy's process group, and a sharded parameter is a ``DTensor``
(``Shard(0)`` over the workers). What this module adds is the two settings distrib's loss
convention needs, and the conversions between sharded and whole state that checkpoints use.

* **Sums, not means.** ``ds.compute_average_loss`` already divides by the *global* batch, so the
  gradients of the workers must be summed, as every other distrib strategy does; FSDP divides by
  the number of workers by default. ``set_gradient_divide_factor(1.0)`` removes the division, and
  ``set_force_sum_reduction_for_comms(True)`` keeps the reduce-scatter a plain SUM (a divide factor
  otherwise asks for ``ReduceOp.PREMUL_SUM``, which gloo refuses: "Cannot use ReduceOp.PREMUL_SUM
  with Gloo").
* **Whole state for checkpoints.** :func:`full_state` turns every ``DTensor`` of a state dict into
  the whole tensor (``full_tensor()``, a collective: every worker calls it, in the same order), so a
  checkpoint of a sharded model is torch's plain ``state_dict()`` format and loads under any strategy
  and in plain PyTorch; :func:`shard_state` splits whole tensors back, locally, for the current
  number of workers (``distribute_tensor(..., src_data_rank=None)``: no communication).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

try:  # FSDP2's public API: torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError as e:  # pragma: no cover - torch 2.4/2.5
    raise ImportError(
        f"ds.ShardedStrategy needs torch >= 2.6 (FSDP2's torch.distributed.fsdp.fully_shard); this is "
        f"torch {torch.__version__}: upgrade torch, or use MultiWorkerMirroredStrategy"
    ) from e

__all__ = ["world_mesh", "shard_module", "is_sharded", "full_state", "shard_state", "mixed_precision_policy"]


def world_mesh(device_type: str) -> DeviceMesh:
    """A one-dimensional mesh over the default process group (the one the strategy's communicator made)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "ShardedStrategy needs the workers' process group; it is made by the strategy when "
            "there are several workers"
        )
    return DeviceMesh.from_group(dist.group.WORLD, device_type)  # type: ignore[arg-type]


def mixed_precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP's policy for ``param_dtype`` compute (gathered parameters in it) with float32 gradient reduction."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_module(
    root: nn.Module,
    units: Sequence[nn.Module],
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    policy: MixedPrecisionPolicy,
) -> None:
    """``fully_shard`` each unit (innermost first), then the root; gradients summed over the workers."""
    for module in [*units, root]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch < 2.9: gloo would refuse PREMUL_SUM
                module.set_force_sum_reduction_for_comms(True)


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a sharded parameter, gradient or optimizer state)."""
    return isinstance(tensor, DTensor)


def full_state(state: Any) -> Any:
    """``state`` (a state dict, nested) with every DTensor replaced by the whole tensor, on the CPU."""
    return pytree.tree_map_only(DTensor, lambda t: t.full_tensor().cpu(), state)


def shard_state(full: Any, like: Any) -> Any:
    """``full`` (whole tensors) split as the DTensors in ``like`` (the same structure) are; other values as given."""
    # walked by hand, not with pytree: ``full`` and ``like`` may differ (a key only one has), which
    # pytree's map over two trees refuses
    if (
        isinstance(like, DTensor)
        and isinstance(full, torch.Tensor)
        and not isinstance(full, DTensor)
        and tuple(full.shape) == tuple(like.shape)
    ):  # else as given: torch's load reports a mismatch itself
        return distribute_tensor(
            full.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None
        )
    if isinstance(full, dict) and isinstance(like, dict):
        return {k: shard_state(v, like[k]) if k in like else v for k, v in full.items()}
    return full
