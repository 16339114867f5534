"""The replica engine: threads, per-replica copies and the gradient merge, as one part strategies compose.

The default, one-device, mirrored, central-storage and multi-worker strategies all run a step
the same way, and differ only in their devices, their communicator and where parameters live.
This is that way, written once:

* **run**: one replica function per local replica, on long-lived replica threads when there are
  several (:class:`~distrib.strategies.replica.ReplicaThreads`), in place when there is one;
* **copies**: a module built in the scope is placed on the first local device (or the central
  parameter device) and mirrored to the other replicas (:class:`~distrib.strategies.replication.MirroredModules`);
  with several workers, every worker then starts from the chief's values (a broadcast);
* **merge**: ``optimizer.step()`` inside ``run`` is a merge point. Once every local replica has
  reached it, the copies' gradients are summed into the primary, reduced over the workers through
  the comm hook (bucketed as :func:`~distrib.comm.gradient_reducer.bucket_layout` says), the step
  runs once, and the copies are refreshed. With one replica per worker the reduction moves into
  the backward pass (:class:`~distrib.comm.BucketedGradientReducer`), as DDP's.

The engine reaches its strategy only through the strategy's public topology (``local_devices``,
``num_local_replicas``, ``num_workers``, ``num_replicas_in_sync``, ``communicator``). It is also the
strategy's :class:`~distrib.strategies.extended.GradientMerge`, the seam ``strategy.extended`` offers to ``strategies/amp.py``.
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from distrib import context, torch_patches
from distrib.comm import BucketedGradientReducer
from distrib.comm.gradient_reducer import reduce_gradients
from distrib.comm.hooks import CommHook, allreduce_hook
from distrib.comm.options import DEFAULT_BYTES_PER_PACK
from distrib.strategies.patch_lease import lease_torch_patches
from distrib.strategies.replica import MergeFn, ReplicaContext, ReplicaThreads, run_in_replica
from distrib.strategies.replication import MirroredModules, optimizer_params
from distrib.strategies.run_options import RunOptions, UnscaledLossCheck
from distrib.strategies.workers import take_chiefs_values
from distrib.values import regroup, select_replica

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["ReplicaEngine"]

T = TypeVar("T")


class _Sums(enum.Enum):
    """Where a ``GradScaler``'s call (strategies/amp.py) left an optimizer's gradients this step.

    An optimizer absent from ``ReplicaEngine._sums`` has nothing summed yet: its ``optimizer.step()``
    merges as usual (sum, step, refresh the copies). Once a scaler's call has summed them:
    """

    #: summed, and :meth:`ReplicaEngine.reduce_gradients_then` is still running the scaler's call: an
    #: ``optimizer.step()`` inside it applies the sums as they are; the engine refreshes the copies when it returns
    APPLYING = enum.auto()
    #: summed by a scaler's call that is over (``scaler.unscale_`` alone, or a step skipped for an inf): the sums
    #: wait; an ``optimizer.step()`` applies them as they are and refreshes the copies itself
    HELD = enum.auto()


class ReplicaEngine:
    """Runs a strategy's replicas in lockstep and merges their optimizer steps (see the module docstring).

    ``parameter_device``: where parameters live when no replica computes on them (central storage);
    ``bucket_bytes``: the size of a gradient bucket reduced across workers (``bytes_per_pack``).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        parameter_device: torch.device | None = None,
        bucket_bytes: int = DEFAULT_BYTES_PER_PACK,
    ) -> None:
        self._strategy = strategy
        self._n = strategy.num_local_replicas
        self._mirrored = MirroredModules(strategy, parameter_device=parameter_device)
        self._parameter_device = parameter_device
        self._bucket_bytes = bucket_bytes
        self._threads: ReplicaThreads | None = None
        self._contexts = [ReplicaContext(strategy, k, self) for k in range(self._n)]
        self._comm_hook: CommHook = allreduce_hook
        self._unscaled_loss = UnscaledLossCheck()
        self._merging = 0  # merge functions running (with several replicas, their threads wait in it)
        # optimizers whose step() this engine merges, and those whose gradients a GradScaler's call has already
        # summed this step (see _Sums and amp.py)
        self._merged_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._sums: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Sums] = weakref.WeakKeyDictionary()
        # with one replica per worker: one reducer per optimizer, overlapped with backward; its autograd hooks
        # go when the optimizer goes
        self._reducers: weakref.WeakKeyDictionary[torch.optim.Optimizer, BucketedGradientReducer] = (
            weakref.WeakKeyDictionary()
        )
        self._patch_lease: weakref.finalize | None = None
        #: the commit gate (fault tolerance): called once the gradients are reduced, before the optimizer applies
        #: them; it returns to apply them or raises to abandon the step. None: every reduced step applies
        self.commit_gate: Callable[[], None] | None = None
        if strategy.num_replicas_in_sync > 1:
            self._lease_torch_patches()

    def _lease_torch_patches(self) -> None:
        """Hold torch_patches' GradScaler/optimizer-hook patches while the strategy lives (once per strategy)."""
        if self._patch_lease is None:
            self._patch_lease = lease_torch_patches(self._strategy)

    @property
    def parameter_device(self) -> torch.device | None:
        """The central parameter device (central storage), or None: each replica's device holds a copy."""
        return self._parameter_device

    def replica_context(self, local_replica_id: int) -> ReplicaContext:
        """The replica context of local replica ``local_replica_id``."""
        return self._contexts[local_replica_id]

    # ------------------------------------------------------------------ modules and optimizers
    def distribute_module(self, module: torch.nn.Module) -> None:
        """Place ``module`` and give every local replica its copy; with several workers, take the chief's values."""
        self._mirrored.distribute(module)
        if self._strategy.num_workers > 1:
            take_chiefs_values(self._strategy.communicator, module)
            self._mirrored.refresh(module)

    def merge_steps_of(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` a merge point, when there is anything to merge."""
        context.set_owner(optimizer, self._strategy)
        if self._strategy.num_replicas_in_sync == 1 and not self._mirrored.central:
            return  # one replica computing on the parameters themselves: nothing to merge
        foreign = [p for p in optimizer_params(optimizer) if p not in self._mirrored]
        if foreign:
            raise ValueError(
                f"{type(optimizer).__name__} was created under {type(self._strategy).__name__}.scope() over "
                f"{len(foreign)} parameter(s) of a module built outside the scope; build the model "
                "inside the same strategy.scope() as the optimizer"
            )
        self._lease_torch_patches()  # e.g. central storage with one replica: its steps merge too
        torch_patches.wrap_optimizer(optimizer, self._optimizer_step, self._optimizer_zero_grad)
        self._merged_optimizers.add(optimizer)
        if self._strategy.num_workers > 1 and self._n == 1:
            reducer = BucketedGradientReducer(
                optimizer_params(optimizer), self._strategy.communicator, self._bucket_bytes, self._comm_hook
            )
            self._reducers[optimizer] = reducer
            weakref.finalize(optimizer, reducer.close)

    def set_comm_hook(self, hook: CommHook) -> None:
        """Reduce gradients across workers through ``hook`` from now on (every optimizer's)."""
        self._comm_hook = hook
        for reducer in self._reducers.values():
            reducer.set_hook(hook)

    # ------------------------------------------------------------------ run and merge
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions) -> Any:
        """``fn`` once per local replica: in place with one replica, else on the replica threads."""
        self._unscaled_loss.options = options
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        n = self._n
        if n == 1:
            return run_in_replica(self._contexts[0], fn, args, kwargs, grad, inference)
        if self._merging:  # run called from a merge_call function: the replica threads are all waiting there
            return regroup(
                [
                    run_in_replica(
                        self._contexts[k], fn, select_replica(k, args), select_replica(k, kwargs), grad, inference
                    )
                    for k in range(n)
                ]
            )
        if self._threads is None:
            self._threads = ReplicaThreads(n, type(self._strategy).__name__)
            weakref.finalize(self._strategy, self._threads.close)  # the threads end when the strategy is freed
        tasks: list[Callable[[], Any]] = [
            functools.partial(
                run_in_replica,
                self._contexts[k],
                fn,
                select_replica(k, args),
                select_replica(k, kwargs),
                grad,
                inference,
            )
            for k in range(n)
        ]
        return regroup(self._threads.run(tasks))

    def merge(self, ctx: ReplicaContext, value: Any, merge_fn: MergeFn) -> Any:
        """The merge point of ``ReplicaContext.merge``: every local replica's value, one ``merge_fn`` call."""
        if self._merging and self._n > 1:
            # the replica threads all wait in the outer merge: a second merge could never complete
            raise RuntimeError(
                "a merge point (optimizer.step(), all_reduce, merge_call) inside a strategy.run "
                "that is itself called from a merge_call function is not supported with several "
                "local replicas"
            )

        def merging(values: list[Any]) -> Sequence[Any]:
            self._merging += 1
            try:
                return merge_fn(values)
            finally:
                self._merging -= 1

        if self._n == 1:
            return merging([value])[0]
        assert self._threads is not None, "a merge happens inside run(), which started the threads"
        return self._threads.merge(ctx.local_replica_id, value, merging)

    # ------------------------------------------------------------------ the optimizer merge
    def _optimizer_step(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        ctx = context.current_replica()
        if ctx is None and optimizer in self._sums:  # torch's GradScaler.step, on sums a scaler's call made (amp.py)
            return self._step_on_sums(optimizer, step, args, kwargs)
        if ctx is None:  # cross-replica: the gradients are already where they are
            return self._apply_update(optimizer, step, args, kwargs)
        if (args or kwargs.get("closure") is not None) and self._n > 1:
            raise ValueError(
                "optimizer.step(closure) is not supported with several local replicas; "
                "call loss.backward() and optimizer.step() in the replica function"
            )

        def merge(scaled: list[bool]) -> list[Any]:
            self.warn_if_loss_unscaled(scaled)
            return [self._apply_update(optimizer, step, args, kwargs)] * len(scaled)

        return ctx.merge(ctx.scaled_loss_recorded, merge)

    def _apply_update(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The merged step: sum the gradients, step once, refresh the replicas' copies."""
        self._reduce(optimizer)
        if self.commit_gate is not None:
            self.commit_gate()
        result = step(*args, **kwargs)
        self._mirrored.refresh(average_buffers=True)
        return result

    def _step_on_sums(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``optimizer.step()`` on gradients a ``GradScaler``'s call has summed: applied as they are, once."""
        sums = self._sums.pop(optimizer)
        result = step(*args, **kwargs)
        if sums is _Sums.HELD:  # no reduce_gradients_then is running to refresh the copies after this step
            self._mirrored.refresh()
        return result

    def _reduce(self, optimizer: torch.optim.Optimizer) -> None:
        """Sum ``optimizer``'s gradients over the local replicas and the workers into the parameters' ``.grad``."""
        reducer = self._reducers.get(optimizer)
        if reducer is not None:
            reducer.synchronize()  # backward already reduced the buckets: wait for the last ones
        else:
            self._sync_gradients(optimizer_params(optimizer))

    def _sync_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum every parameter's gradient over local replicas, then over workers, into ``param.grad``."""
        to_reduce: list[torch.Tensor] = []
        reduced: list[torch.Tensor] = []
        workers = self._strategy.num_workers
        for p in params:
            grads = [g for g in self._mirrored.replica_grads(p) if g is not None]
            if grads:
                total = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for g in grads:
                    total.add_(g.to(total.device, non_blocking=True))
                p.grad = total
            if workers > 1 and p.requires_grad:  # the parameters the overlapped reducer buckets
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                to_reduce.append(p.grad)
                reduced.append(p)
        # bucketed as the overlapped reducer does (comm.gradient_reducer.bucket_layout): bucket.index is the same
        reduce_gradients(
            self._strategy.communicator, to_reduce, self._bucket_bytes, self._comm_hook, parameters=reduced
        )

    def _optimizer_zero_grad(
        self, optimizer: torch.optim.Optimizer, zero_grad: Callable[..., None], set_to_none: bool
    ) -> None:
        reducer = self._reducers.get(optimizer)
        if reducer is not None:
            reducer.discard()
        ctx = context.current_replica()
        params = optimizer_params(optimizer)
        self._sums.pop(optimizer, None)
        if ctx is None:
            zero_grad(set_to_none)
            self._mirrored.zero_copy_grads(params, None, set_to_none)
            return
        if ctx.local_replica_id == 0:
            zero_grad(set_to_none)  # the primary's gradients (the sums of the last step)
        self._mirrored.zero_copy_grads(params, ctx.local_replica_id, set_to_none)

    def abandon_step(self) -> None:
        """Forget the step in flight (a fault stopped it before it applied): every merged optimizer's gradients
        are dropped (``grad = None``) and its reducer starts a new pass, so a step run again starts clean."""
        for optimizer in list(self._merged_optimizers):
            reducer = self._reducers.get(optimizer)
            if reducer is not None:
                reducer.abandon()
            self._sums.pop(optimizer, None)
            for p in optimizer_params(optimizer):
                p.grad = None
            self._mirrored.zero_copy_grads(optimizer_params(optimizer), None, True)

    # ------------------------------------------------------------------ GradientMerge (strategy.extended's seam)
    def merges_optimizer_steps(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step()`` is a merge point of this engine."""
        return optimizer in self._merged_optimizers

    def reduce_gradients_then(self, optimizer: torch.optim.Optimizer, then: Callable[[], T]) -> T:
        """Sum ``optimizer``'s gradients over replicas and workers (once a step), then call ``then``.

        As the merged ``optimizer.step()`` (:meth:`_apply_update`), with ``then`` in place of the step: sum,
        ``then()``, refresh the copies. An ``optimizer.step()`` that ``then`` (or a later call) makes applies
        the sums as they are (:meth:`_step_on_sums`); see :class:`_Sums` for the states.
        """
        if optimizer in self._sums:  # summed earlier this step (a scaler.unscale_ before scaler.step)
            return then()
        self._reduce(optimizer)
        if self.commit_gate is not None:
            self.commit_gate()
        self._sums[optimizer] = _Sums.APPLYING
        try:
            result = then()
            self._mirrored.refresh(average_buffers=True)
            return result
        finally:
            if optimizer in self._sums:  # then() applied no step (unscale_ alone, or a skipped step): the sums wait
                self._sums[optimizer] = _Sums.HELD

    def end_gradient_reduction(self, optimizer: torch.optim.Optimizer) -> None:
        """The step that used the summed gradients is over (applied or skipped): the next ones are summed anew."""
        self._sums.pop(optimizer, None)

    def warn_if_loss_unscaled(self, scaled: Sequence[bool]) -> None:
        """Warn once when a step's loss was not scaled by distrib's helpers while several replicas are in sync."""
        self._unscaled_loss.warn_if_unscaled(scaled, self._strategy.num_replicas_in_sync, stacklevel=2)
