"""Mixed precision under strategies: ``torch.amp.GradScaler`` used exactly as in plain PyTorch inside ``run``.

A ``GradScaler`` keeps one state per optimizer per step (``_per_optimizer_states``: its
stage READY -> UNSCALED -> STEPPED and ``found_inf_per_device``) and decides from the
gradients it sees in ``unscale_``. Under a strategy that merges ``optimizer.step()``,
each replica holds only its own part of the gradient, and every replica thread calls
``step`` and ``update``. Left alone, the first replica would unscale its own part and
decide alone, the others would step on half-unscaled sums, and the second ``update()``
would find no inf checks (``AssertionError: No inf checks were recorded prior to update``).

So the scaler's calls become merge points, like ``optimizer.step()``:

* ``scaler.unscale_(optimizer)`` and ``scaler.step(optimizer)``: once every local replica
  has arrived, the strategy sums the gradients over replicas and workers (its usual
  reduction: buckets, comm hook) *before* anything is unscaled; torch's own
  ``unscale_`` then unscales and checks the sums once, and the inf flag is summed over
  the workers (one scalar all-reduce), so every replica of every worker takes the same
  decision. The optimizer step runs once, or is skipped everywhere.
* ``scaler.update()``: runs once per step, on the agreed flag, so the scale is the same
  on every replica and every worker.

``scaler.scale(loss)`` needs nothing: every replica multiplies by the same scale. With the
sums checked, a clean step is single-device training with the same scaler (parameters
and scale, up to float rounding), and an inf or NaN on any replica skips the step and
backs the scale off everywhere. Gradients are unscaled once they are summed, so code
between ``unscale_`` and ``step`` (``clip_grad_norm_``) sees the global gradient.

``ParameterServerStrategy`` runs its steps asynchronously on worker processes, one replica
per worker, so nothing is summed and there is no merge point: the coordinator's ``GradScaler``
is the one authority (one scale, as TF keeps the loss scale in one variable). A function
scheduled with ``ClusterCoordinator.schedule`` that uses it carries a snapshot of its state
(scale, growth tracker, factors, interval, enabled) and runs torch's own ``unscale_``/``step``/
``update`` on a copy on its worker: a step with an inf or NaN gradient is not pushed to the
parameter servers. The outcome of each ``update()`` (inf found or not) comes back with the
function's result and is replayed on the coordinator's scaler in the order results arrive
(``torch._amp_update_scale_``, torch's own arithmetic), so ``scaler.get_scale()`` there is the
scale every later function starts from, and what a checkpoint of the scaler saves. Steps in
flight keep the scale they were sent with: training is asynchronous, as TF's is with parameter
servers (see :mod:`distrib.parameter_server.scaler`). ``ds.fit(precision="16-mixed")`` and
``distrib train --precision 16-mixed`` work there through the same path.

The strategy is reached through ``strategy.extended``'s public gradient seam
(``merges_optimizer_steps``, ``reduce_gradients_then``, ``end_gradient_reduction``,
``warn_if_loss_unscaled``).

``GradScaler``'s ``unscale_``, ``step`` and ``update`` are replaced on the class by
:mod:`distrib.torch_patches` (never at import): while a strategy with several replicas
in sync, or one that merges an optimizer's steps, exists (``SCALER_METHODS`` below are what is
put there). They are torch's own unless the optimizer (for ``update``: the calling replica's
strategy) is one whose steps a strategy merges.
Optimizers that unscale inside their own step (``fused=True``; ``_step_supports_amp_scaling``)
are checked by torch on the summed gradients, without the extra all-reduce: the sums
are the same on every worker.

Example::

    >>> import distrib as ds, torch
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(4, 1)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    >>> def step(x):
    ...     with torch.autocast("cpu", dtype=torch.bfloat16):
    ...         loss = ds.compute_average_loss(model(x).float().pow(2).sum(1))
    ...     scaler.scale(loss).backward()
    ...     scaler.step(optimizer)
    ...     scaler.update()
    ...     optimizer.zero_grad()
    >>> x = torch.ones(4, 4)
    >>> x[3, 0] = float("nan")  # replica 1's half of the batch is poisoned
    >>> for batch in strategy.experimental_distribute_dataset([x]):
    ...     _ = strategy.run(step, args=(batch,))
    >>> scaler.get_scale()  # the step was skipped on both replicas, and the scale backed off once
    512.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import GradScaler

from distrib import context, torch_patches

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["SCALER_METHODS"]


def _merging_strategy(scaler: GradScaler, optimizer: Any) -> Strategy | None:
    """The strategy that merges ``optimizer``'s steps, when ``scaler`` is enabled; else None (torch's behaviour)."""
    if not scaler.is_enabled():
        return None
    owner = context.owner_of(optimizer)
    return owner if owner is not None and owner.extended.merges_optimizer_steps(optimizer) else None


def _once(strategy: Strategy, what: str, values: list[Any], fn: Callable[[], Any]) -> list[Any]:
    """A merge function: check every replica passed the same scaler and optimizer, run ``fn`` once, cross-replica."""
    scaler, optimizer = values[0][0], values[0][1]
    if any(v[0] is not scaler or v[1] is not optimizer for v in values):
        raise ValueError(
            f"scaler.{what}(optimizer) was called with different GradScalers or optimizers on the "
            f"replicas of {type(strategy).__name__}; build one GradScaler outside strategy.run and "
            "use it with the strategy's optimizer on every replica"
        )
    strategy.extended.warn_if_loss_unscaled([v[2] for v in values])
    previous = context.set_current_replica(None)  # optimizer.step() inside fn is the cross-replica step
    try:
        result = fn()
    finally:
        context.set_current_replica(previous)
    return [result] * len(values)


def _as_merge_point(strategy: Strategy, what: str, scaler: GradScaler, optimizer: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` once per step: at a merge point inside ``run``, or directly in cross-replica context."""
    ctx = context.current_replica()
    if ctx is None or ctx.strategy is not strategy:
        return fn()
    return ctx.merge((scaler, optimizer, ctx.scaled_loss_recorded), lambda values: _once(strategy, what, values, fn))


def _agree(strategy: Strategy, scaler: GradScaler, optimizer: Any) -> None:
    """Sum the inf flags of ``optimizer``'s unscaled gradients over the workers: one decision everywhere."""
    if strategy.num_workers == 1:
        return
    scale = torch_patches.scale_tensor(scaler)
    assert scale is not None, "unscale_ ran, so the scale exists"
    total = torch.zeros((), dtype=torch.float32, device=scale.device)
    for found in torch_patches.found_inf_per_device(scaler, optimizer).values():
        total += found.to(scale.device)
    strategy.communicator.all_reduce([total])
    torch_patches.set_found_inf_per_device(scaler, optimizer, {total.device: total.clamp_(max=1.0)})


def _unscale_agreed(strategy: Strategy, scaler: GradScaler, optimizer: Any) -> None:
    """torch's ``unscale_`` of the summed gradients, then the inf flag agreed over the workers (:func:`_agree`)."""
    torch_patches.torch_unscale_(scaler, optimizer)
    _agree(strategy, scaler, optimizer)


def _merged_unscale_(strategy: Strategy, scaler: GradScaler, optimizer: Any) -> None:
    """The user's ``scaler.unscale_(optimizer)``, once for every replica: sum (the sums then wait for the step),
    unscale and agree."""
    strategy.extended.reduce_gradients_then(optimizer, lambda: _unscale_agreed(strategy, scaler, optimizer))


def _merged_step(strategy: Strategy, scaler: GradScaler, optimizer: Any, args: Any, kwargs: Any) -> float | None:
    """``scaler.step(optimizer)`` once for every replica, cross-replica. The chain, in order:

    1. ``strategy.extended.reduce_gradients_then``: the strategy sums the gradients over the replicas and
       workers (once a step: a ``scaler.unscale_`` earlier in the step already did);
    2. :func:`_unscale_agreed`: torch's ``unscale_`` on the sums and the inf flag agreed over the workers,
       unless the user unscaled already or the optimizer unscales in its own step (fused: torch checks the
       sums there, the same on every worker);
    3. torch's own ``GradScaler.step``: ``optimizer.step()`` unless an inf was found (the step is then skipped
       on every replica of every worker); that call, the optimizer's merged step, finds the sums in place and
       applies them as they are;
    4. ``strategy.extended.end_gradient_reduction``: the next step's gradients are summed anew.
    """

    def unscale_then_step() -> float | None:
        if torch_patches.awaits_unscale(scaler, optimizer):
            _unscale_agreed(strategy, scaler, optimizer)
        result: float | None = torch_patches.torch_scaler_step(scaler, optimizer, *args, **kwargs)
        return result

    try:
        return strategy.extended.reduce_gradients_then(optimizer, unscale_then_step)
    finally:
        strategy.extended.end_gradient_reduction(optimizer)


def unscale_(self: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``GradScaler.unscale_``: under a strategy, unscale and check the gradients summed over every replica."""
    strategy = _merging_strategy(self, optimizer)
    if strategy is None:
        return torch_patches.torch_unscale_(self, optimizer)
    _as_merge_point(strategy, "unscale_", self, optimizer, lambda: _merged_unscale_(strategy, self, optimizer))


def step(self: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
    """``GradScaler.step``: under a strategy, one decision over the summed gradients, one step (or none) everywhere
    (:func:`_merged_step`)."""
    strategy = _merging_strategy(self, optimizer)
    if strategy is None or "closure" in kwargs:  # torch refuses a closure itself
        return torch_patches.torch_scaler_step(self, optimizer, *args, **kwargs)
    result: float | None = _as_merge_point(
        strategy, "step", self, optimizer, lambda: _merged_step(strategy, self, optimizer, args, kwargs)
    )
    return result


def update(self: GradScaler, new_scale: float | torch.Tensor | None = None) -> None:
    """``GradScaler.update``: with several local replicas, once per step (the first replica to arrive waits)."""
    ctx = context.current_replica()
    if ctx is None or ctx.strategy.num_local_replicas == 1 or not self.is_enabled():
        return torch_patches.torch_scaler_update(self, new_scale)

    def merge(values: list[Any]) -> Sequence[Any]:
        previous = context.set_current_replica(None)
        try:
            done: list[GradScaler] = []
            for scaler, scale in values:  # normally one scaler shared by every replica: updated once
                if not any(scaler is d for d in done):
                    done.append(scaler)
                    torch_patches.torch_scaler_update(scaler, scale)
        finally:
            context.set_current_replica(previous)
        return [None] * len(values)

    ctx.merge((self, new_scale), merge)


#: what :class:`~distrib.torch_patches.StrategyPatches` puts on ``GradScaler`` while a strategy needs it
SCALER_METHODS: dict[str, Callable[..., Any]] = {"unscale_": unscale_, "step": step, "update": update}
