"""The torch patches a strategy leases while it lives: GradScaler's merge points and the optimizer-owner check.

Applied by :mod:`distrib.torch_patches` under a counted lease (one per strategy, given back when the
strategy is garbage-collected), never at import: the replica engine leases them when several
replicas are in sync or an optimizer's steps merge; the sharded strategy when it has several workers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from distrib import context, torch_patches
from distrib.strategies import amp

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["lease_torch_patches"]


def _check_optimizer_owner(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global ``optimizer.step`` pre-hook: inside ``run`` with several replicas, the optimizer must be the strategy's."""
    ctx = context.current_replica()
    if ctx is None or ctx.strategy.num_replicas_in_sync == 1 or context.owner_of(optimizer) is ctx.strategy:
        return None
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() is called inside {type(ctx.strategy).__name__}.run with "
        f"{ctx.strategy.num_replicas_in_sync} replicas in sync, but the optimizer was built outside the "
        "strategy's scope: its update would use one replica's gradients, and the replicas would drift apart. "
        "Build the model and the optimizer inside `with strategy.scope():`"
    )


#: GradScaler's unscale_/step/update merge under a strategy (strategies/amp.py), and the global optimizer pre-hook
#: above: applied by torch_patches while a strategy with several replicas, or one merging an optimizer, lives
#: (a lease per strategy, given back when it is garbage-collected); never at import
_STRATEGY_PATCHES = torch_patches.StrategyPatches(amp.SCALER_METHODS, _check_optimizer_owner)


def lease_torch_patches(strategy: Strategy) -> weakref.finalize:
    """Hold the patches while ``strategy`` lives; the returned finalizer gives them back (call it, or let the
    strategy be collected)."""
    return weakref.finalize(strategy, _STRATEGY_PATCHES.acquire())
