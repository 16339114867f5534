"""``ds.experimental.clip_grad_norm_``: torch's ``clip_grad_norm_`` for gradients on several meshes.

Under ``MeshStrategy`` the parameters are not all on one mesh: on an FSDP × TP mesh the ones a layout
map splits are ``DTensor`` s on the 2-D mesh, the rest on the data axes; on a TP-only mesh the rest are
plain tensors. torch 2.13's ``torch.nn.utils.clip_grad_norm_`` computes each gradient's norm, then the
norm of those norms, and that second step refuses to mix them: ``All operands in aten.stack.default
must have the same mesh`` (FSDP × TP), ``aten._foreach_norm.Scalar got mixed torch.Tensor and
DTensor`` (TP). On one mesh (FSDP, hybrid, or every parameter laid out, as with sequence parallelism)
it is right.

Here the gradients are grouped by mesh: each group's norm is torch's own (``get_total_norm``, a
``DTensor`` reduced over its mesh, then made whole), a plain tensor's counts as it is on this worker
(whole, and the same on every worker, as ``MeshStrategy``'s unsplit parameters); the groups' norms
combine as torch combines single tensors'. Every worker then scales its own part of each gradient by
the same factor, as torch does: ``min(1, max_norm / (total + 1e-6))``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def total_grad_norm(
    grads: Iterable[torch.Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> torch.Tensor:
    """The norm of ``grads`` taken together, whatever mesh each is on: the same on every worker.

    Args:
        grads: gradients: ``DTensor`` s on any meshes, and plain tensors (counted as they are here).
        norm_type: the norm's order, as torch's (``float("inf")`` for the largest absolute value).
        error_if_nonfinite: raise when the norm is NaN or infinite.
        foreach: torch's ``foreach`` (None: its default).

    Returns:
        The norm, a plain 0-dimensional tensor (on the first gradient's device; ``tensor(0.)`` without any).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite (torch's words).
    """
    groups: dict[Any, list[torch.Tensor]] = {}  # a DTensor's mesh (equal meshes are one), or None: plain tensors
    for g in grads:
        groups.setdefault(g.device_mesh if _is_dtensor(g) else None, []).append(g)  # type: ignore[attr-defined]
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for tensors in groups.values():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type, False, foreach)
        norms.append(norm.full_tensor() if _is_dtensor(norm) else norm)  # type: ignore[attr-defined]
    return torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite, foreach)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, right where the parameters are on several meshes (module docstring).

    The same arguments and result as torch's: the gradients of ``parameters`` are scaled in place so that
    their norm, taken together over every worker's parts, is at most ``max_norm``. Call it on every worker
    (it is a collective: each mesh's norm is reduced over its workers), after ``backward`` and before
    ``optimizer.step()``; with a ``GradScaler``, after ``scaler.unscale_(optimizer)``.

    Args:
        parameters: tensors (or one) whose ``.grad`` to clip; those without a gradient are left out.
        max_norm: the largest norm the gradients keep.
        norm_type: the norm's order (``float("inf")``: the largest absolute value).
        error_if_nonfinite: raise when the total norm is NaN or infinite.
        foreach: torch's ``foreach`` for the norms (None: its default).

    Returns:
        The total norm of the gradients before clipping: a plain 0-dimensional tensor, equal on every worker.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite.

    Example::

        loss.backward()
        ds.experimental.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    factors: dict[torch.device, torch.Tensor] = {}
    for g in grads:  # each worker scales its own part: a view of the DTensor's local tensor
        local: torch.Tensor = g.to_local() if _is_dtensor(g) else g  # type: ignore[union-attr]
        if local.device not in factors:
            factors[local.device] = coef.to(local.device)
        local.mul_(factors[local.device])
    return total
