"""The one base class of every strategy.

A strategy is fixed by three things, given to the constructor:

* its local replica devices (one per replica this process drives; ``None`` means
  "leave tensors where they are", which is what the default strategy does);
* a :class:`~distrib.comm.Communicator` for the other worker processes;
* optionally a cluster resolver.

Everything else (``scope``, ``run``, ``reduce``, ``gather``, input distribution,
the gradient merge of ``optimizer.step()``) is written once here. A training step
flows: ``run`` → one replica function per local replica (threads when there are
several) → ``optimizer.step()`` is a merge point → local gradients are summed and
reduced across workers through the comm hook → the update is applied once to the
primary copy and seen by every replica.

What the rest of distrib may use is public and typed: the topology
(``num_replicas_in_sync``, ``num_local_replicas``, ``local_devices``,
``worker_index``, ``num_workers``, ``is_chief``, ``barrier``, ``communicator``), the
checkpoint contract (``checkpoint_state``, ``restore_checkpoint_state``) and
``step_executor`` (how ``fit`` runs a step), and ``extended`` (TF's ``StrategyExtended``, which
also holds the gradient seam that ``strategies/amp.py`` uses: ``merges_optimizer_steps``,
``reduce_gradients_then``, ``end_gradient_reduction``, ``warn_if_loss_unscaled``). Subclasses
override the ``_``-methods.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import torch

from distrib import context
from distrib.comm import Communicator, LocalCommunicator
from distrib.comm.hooks import CommHook, allreduce_hook
from distrib.comm.gradient_reducer import reduce_gradients
from distrib.comm.options import DEFAULT_BYTES_PER_PACK
from distrib import torch_patches
from distrib.strategies import amp
from distrib.strategies.extended import StrategyExtended
from distrib.strategies.replica import ReplicaContext, ReplicaThreads, run_in_replica
from distrib.strategies.replication import (MirroredModules, ModuleCapture, install_capture_hooks,
                                            optimizer_params, remove_capture_hooks)
from distrib.torch_patches import wrap_optimizer
from distrib.strategies.reduction import Axis, gather_structure, reduce_structure
from distrib.values import PerReplica, ReduceOp, map_leaves, parse_reduce_op, regroup, select_replica

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver
    from distrib.strategies.execution import StepExecutor

__all__ = ["Strategy", "RunOptions", "ValueContext", "UnscaledLossWarning"]

T = TypeVar("T")


@dataclass(frozen=True)
class RunOptions:
    """Options of one ``strategy.run`` call (``tf.distribute.RunOptions``).

    ``loss_scaled_by_hand``: the step divides its loss by the global batch itself, without
    ``ds.compute_average_loss``; do not warn that the loss looks unscaled. TF's own options
    (``experimental_enable_dynamic_batch_size``, ...) have no PyTorch counterpart and are not taken.

    Example::

        >>> RunOptions(loss_scaled_by_hand=True).loss_scaled_by_hand
        True
    """

    loss_scaled_by_hand: bool = False


@dataclass(frozen=True)
class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` is told (``tf.distribute.ValueContext``)."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


class UnscaledLossWarning(UserWarning):
    """A step's loss was not scaled by the global batch while several replicas are in sync."""


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"strategy.{old} is TF's deprecated name of strategy.{new}; use {new}", DeprecationWarning,
                  stacklevel=3)


def _check_optimizer_owner(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global ``optimizer.step`` pre-hook: inside ``run`` with several replicas, the optimizer must be the strategy's."""
    ctx = context.current_replica()
    if ctx is None or ctx.strategy.num_replicas_in_sync == 1 or context.owner_of(optimizer) is ctx.strategy:
        return None
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() is called inside {type(ctx.strategy).__name__}.run with "
        f"{ctx.strategy.num_replicas_in_sync} replicas in sync, but the optimizer was built outside the "
        "strategy's scope: its update would use one replica's gradients, and the replicas would drift apart. "
        "Build the model and the optimizer inside `with strategy.scope():`")


#: GradScaler's unscale_/step/update merge under a strategy (strategies/amp.py), and the global optimizer pre-hook
#: above: applied by torch_patches while a strategy with several replicas, or one merging an optimizer, lives
#: (a lease per strategy, given back when it is garbage-collected); never at import
_STRATEGY_PATCHES = torch_patches.StrategyPatches(amp.SCALER_METHODS, _check_optimizer_owner)


class Strategy:
    """Runs one training step on every replica and keeps replicated state in sync.

    Subclasses only choose devices, a communicator and a cluster resolver; see
    :class:`~distrib.MirroredStrategy` for a runnable example.
    """

    #: True where ``fit`` must schedule steps through a ``ClusterCoordinator`` (parameter servers).
    should_use_with_coordinator: bool = False

    def __init__(
        self,
        devices: Sequence[Optional[torch.device]],
        communicator: Optional[Communicator] = None,
        cluster_resolver: Optional["ClusterResolver"] = None,
        device_names: Optional[Sequence[str]] = None,
    ) -> None:
        if not devices:
            raise ValueError("a strategy needs at least one device")
        self._devices: tuple[Optional[torch.device], ...] = tuple(devices)
        self._device_names = tuple(device_names) if device_names else tuple(str(d) for d in devices)
        self._communicator: Communicator = communicator or LocalCommunicator()
        self._cluster_resolver = cluster_resolver
        self._capture = ModuleCapture()
        self._mirrored = MirroredModules(self)
        self._threads: Optional[ReplicaThreads] = None
        self._replica_contexts = [ReplicaContext(self, k) for k in range(len(self._devices))]
        self._comm_hook: CommHook = allreduce_hook
        self._run_options = RunOptions()
        self._warned_unscaled = False
        self._merging = 0  # merge functions running (with several replicas, their threads wait in it)
        # optimizers whose step() this strategy merges, and those whose gradients a GradScaler call has already
        # summed this step (True while inside _apply_update, which refreshes the copies itself): see amp.py
        self._merged_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._summed: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self._patch_lease: Optional[weakref.finalize] = None
        if self.num_replicas_in_sync > 1:
            self._lease_torch_patches()
        if self._communicator.world_size > 1:
            context.register_cluster_strategy(self)

    def _lease_torch_patches(self) -> None:
        """Hold torch_patches' GradScaler/optimizer-hook patches while this strategy lives (once per strategy)."""
        if self._patch_lease is None:
            self._patch_lease = weakref.finalize(self, _STRATEGY_PATCHES.acquire())

    # ------------------------------------------------------------------ topology
    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in every step, over all workers."""
        return len(self._devices) * self._communicator.world_size

    @property
    def num_local_replicas(self) -> int:
        """Replicas this process drives (one per local device)."""
        return len(self._devices)

    @property
    def local_devices(self) -> tuple[Optional[torch.device], ...]:
        """The device of each local replica (None: tensors stay where they are)."""
        return self._devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where the parameters live: every replica's device (each holds a copy), unless a strategy centralises them."""
        return tuple(str(d) if d is not None else "default" for d in self._devices)

    @property
    def worker_index(self) -> int:
        """This process's index among the workers in sync (0 on the chief)."""
        return self._communicator.rank

    @property
    def num_workers(self) -> int:
        """Worker processes in sync (1 for single-process strategies)."""
        return self._communicator.world_size

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief: the one that writes checkpoints and summaries."""
        return self.worker_index == 0

    @property
    def communicator(self) -> Communicator:
        """The collectives to the other workers (identity for single-process strategies)."""
        return self._communicator

    @property
    def cluster_resolver(self) -> Optional["ClusterResolver"]:
        """The cluster resolver of a multi-worker strategy; None for single-process ones."""
        return self._cluster_resolver

    def _refuse_mixing(self, api: str) -> None:
        """TF's rule: a strategy's cross-replica API is not called inside another strategy's scope."""
        scope = context.current_scope()
        if scope is not None and scope is not self:
            raise RuntimeError(f"Mixing different strategies: {type(self).__name__}.{api} was called inside the "
                               f"scope of {type(scope).__name__}; call it outside that scope, or use that strategy")

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Return once every worker has reached this call (``timeout`` seconds at most).

        Example::

            >>> import distrib as ds
            >>> ds.MirroredStrategy(["cpu:0", "cpu:1"]).barrier()  # one worker: returns at once
        """
        self._communicator.barrier(timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._device_names)}, num_replicas_in_sync={self.num_replicas_in_sync})"

    # ------------------------------------------------------------------ scope
    @contextlib.contextmanager
    def _scope(self) -> Iterator["Strategy"]:
        context.push_scope(self)
        install_capture_hooks()
        try:
            yield self
        finally:
            remove_capture_hooks()
            try:
                self._claim_captured_modules()
            finally:
                context.pop_scope(self)

    def scope(self) -> contextlib.AbstractContextManager["Strategy"]:
        """Make this the current strategy; modules and optimizers built inside are distributed.

        The returned object can be entered again (``s = strategy.scope(); with s: ...; with s: ...``).
        """
        return _ReusableScope(self)

    def _claim_captured_modules(self) -> None:
        for root in self._capture.take_roots():
            self._distribute_module(root)

    def _distribute_module(self, module: torch.nn.Module) -> None:
        self._mirrored.distribute(module)

    def _on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        self._claim_captured_modules()
        context.set_owner(optimizer, self)
        if self.num_replicas_in_sync == 1 and not self._mirrored.central:
            return  # one replica computing on the parameters themselves: nothing to merge
        foreign = [p for p in optimizer_params(optimizer) if p not in self._mirrored]
        if foreign:
            raise ValueError(
                f"{type(optimizer).__name__} was created under {type(self).__name__}.scope() over "
                f"{len(foreign)} parameter(s) of a module built outside the scope; build the model "
                "inside the same strategy.scope() as the optimizer"
            )
        self._lease_torch_patches()  # e.g. central storage with one replica: its steps merge too
        wrap_optimizer(optimizer, self._optimizer_step, self._optimizer_zero_grad)
        self._merged_optimizers.add(optimizer)

    # ------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None,
            options: Optional[RunOptions] = None) -> Any:
        """Run ``fn`` once per local replica; PerReplica arguments give each replica its element.

        Returns the plain result when this process has one replica, else a structure
        whose leaves are :class:`~distrib.PerReplica`. ``options``: see :class:`RunOptions`.
        """
        if context.current_replica() is not None:
            raise RuntimeError("strategy.run() was called inside a replica function; call it from the training loop")
        self._refuse_mixing("run")
        if self._capture:
            self._claim_captured_modules()
        self._run_options = options or RunOptions()
        kwargs = kwargs or {}
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        n = self.num_local_replicas
        if n == 1:
            return run_in_replica(self._replica_contexts[0], fn, tuple(args), kwargs, grad, inference)
        if self._merging:  # run called from a merge_call function: the replica threads are all waiting there
            return regroup([run_in_replica(self._replica_contexts[k], fn, select_replica(k, tuple(args)),
                                           select_replica(k, kwargs), grad, inference) for k in range(n)])
        if self._threads is None:
            self._threads = ReplicaThreads(n, type(self).__name__)
            weakref.finalize(self, self._threads.close)  # the threads end when the strategy is freed
        tasks: list[Callable[[], Any]] = [
            functools.partial(run_in_replica, self._replica_contexts[k], fn, select_replica(k, tuple(args)),
                              select_replica(k, kwargs), grad, inference)
            for k in range(n)
        ]
        return regroup(self._threads.run(tasks))

    def experimental_run_v2(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                            kwargs: Optional[dict[str, Any]] = None, options: Optional[RunOptions] = None) -> Any:
        """TF's older name of :meth:`run` (deprecated there, kept for ported code)."""
        _deprecated("experimental_run_v2", "run")
        return self.run(fn, args, kwargs, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``value_fn(ValueContext)`` once per local replica: a PerReplica value (plain with one replica).

        Example::

            >>> import distrib as ds, torch
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> v = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor(ctx.replica_id_in_sync_group))
            >>> s.experimental_local_results(v)
            (tensor(0), tensor(1))
        """
        values = []
        for k in range(self.num_local_replicas):
            replica = self._replica_contexts[k]
            value = value_fn(ValueContext(replica.replica_id_in_sync_group, self.num_replicas_in_sync))
            values.append(self._to_replica_device(value, k))
        return values[0] if len(values) == 1 else PerReplica(values)

    @property
    def extended(self) -> StrategyExtended:
        """TF's ``strategy.extended``: ``reduce_to``, ``batch_reduce_to``, devices, ``should_checkpoint``, ..."""
        return StrategyExtended(self)

    def _merge(self, ctx: ReplicaContext, value: Any, merge_fn: Callable[[list[Any]], Sequence[Any]]) -> Any:
        if self._merging and self.num_local_replicas > 1:
            # the replica threads all wait in the outer merge: a second merge could never complete
            raise RuntimeError("a merge point (optimizer.step(), all_reduce, merge_call) inside a strategy.run "
                               "that is itself called from a merge_call function is not supported with several "
                               "local replicas")

        def merging(values: list[Any]) -> Sequence[Any]:
            self._merging += 1
            try:
                return merge_fn(values)
            finally:
                self._merging -= 1

        if self.num_local_replicas == 1:
            return merging([value])[0]
        assert self._threads is not None, "a merge happens inside run(), which started the threads"
        return self._threads.merge(ctx.local_replica_id, value, merging)

    def step_executor(self) -> "StepExecutor":
        """How ``fit`` runs its steps under this strategy: here, ``strategy.run`` on each global batch."""
        from distrib.strategies.execution import SynchronousExecutor

        return SynchronousExecutor(self)

    # ------------------------------------------------------------------ optimizer merge
    def register_comm_hook(self, hook: CommHook) -> None:
        """Reduce gradients across workers through ``hook`` (see :mod:`distrib.comm.hooks`), as DDP's."""
        self._comm_hook = hook

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any],
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ctx = context.current_replica()
        if ctx is None and optimizer in self._summed:  # a GradScaler summed this step's gradients (amp.py)
            inside_update = self._summed.pop(optimizer)
            result = step(*args, **kwargs)
            if not inside_update:
                self._mirrored.refresh()
            return result
        if ctx is None:  # cross-replica: the gradients are already where they are
            return self._apply_update(optimizer, step, args, kwargs)
        if (args or kwargs.get("closure") is not None) and self.num_local_replicas > 1:
            raise ValueError("optimizer.step(closure) is not supported with several local replicas; "
                             "call loss.backward() and optimizer.step() in the replica function")

        def merge(scaled: list[bool]) -> list[Any]:
            self._warn_if_loss_unscaled(scaled)
            return [self._apply_update(optimizer, step, args, kwargs)] * len(scaled)

        return ctx.merge(ctx.scaled_loss_recorded, merge)

    def _merges_steps(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step()`` is a merge point of this strategy (see ``extended.merges_optimizer_steps``)."""
        return optimizer in self._merged_optimizers

    def _reduce_gradients_for(self, optimizer: torch.optim.Optimizer, then: Callable[[], T]) -> T:
        """Sum ``optimizer``'s gradients over replicas and workers (once a step), then call ``then``.

        The strategy's own reduction (``_apply_update``) runs with ``then`` in place of the
        optimizer's step; an ``optimizer.step()`` that ``then`` (or a later call) makes applies
        the update without summing again. See ``extended.reduce_gradients_then``.
        """
        if optimizer in self._summed:
            return then()

        def summed_then() -> T:
            self._summed[optimizer] = True
            return then()

        try:
            result: T = self._apply_update(optimizer, summed_then, (), {})
            return result
        finally:
            if optimizer in self._summed:  # unscale_ alone, or a skipped step: the sums stay until step/zero_grad
                self._summed[optimizer] = False

    def _end_gradient_reduction(self, optimizer: torch.optim.Optimizer) -> None:
        """The step that used the summed gradients is over (applied or skipped): the next ones are summed anew."""
        self._summed.pop(optimizer, None)

    def _warn_if_loss_unscaled(self, scaled: Sequence[bool]) -> None:
        """Warn once when a step's loss was not scaled by distrib's helpers while several replicas are in sync."""
        if all(scaled) or self.num_replicas_in_sync == 1 or self._warned_unscaled or \
                self._run_options.loss_scaled_by_hand:
            return
        self._warned_unscaled = True
        warnings.warn(
            f"optimizer.step() ran in strategy.run without the loss being scaled by ds.compute_average_loss or "
            f"ds.scale_regularization_loss, with {self.num_replicas_in_sync} replicas in sync. Gradients are "
            f"summed over replicas, so a loss averaged per replica (PyTorch's default reduction='mean') gives "
            f"gradients {self.num_replicas_in_sync} times too large. Fix: loss = ds.compute_average_loss("
            "F.cross_entropy(logits, labels, reduction='none'), global_batch_size=GLOBAL_BATCH). If you already "
            "divide by the global batch yourself, pass options=ds.RunOptions(loss_scaled_by_hand=True) to run.",
            UnscaledLossWarning, stacklevel=2)

    def _apply_update(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any],
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._sync_gradients(optimizer_params(optimizer))
        result = step(*args, **kwargs)
        self._mirrored.refresh(average_buffers=True)
        return result

    def _sync_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum every parameter's gradient over local replicas, then over workers, into ``param.grad``."""
        to_reduce: list[torch.Tensor] = []
        reduced: list[torch.Tensor] = []
        for p in params:
            grads = [g for g in self._mirrored.replica_grads(p) if g is not None]
            if grads:
                total = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for g in grads:
                    total.add_(g.to(total.device, non_blocking=True))
                p.grad = total
            if self.num_workers > 1 and p.requires_grad:  # the parameters the overlapped reducer buckets
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                to_reduce.append(p.grad)
                reduced.append(p)
        # bucketed as the overlapped reducer does (comm.gradient_reducer.bucket_layout): bucket.index is the same
        reduce_gradients(self._communicator, to_reduce, self._gradient_bucket_bytes(), self._comm_hook,
                         parameters=reduced)

    def _gradient_bucket_bytes(self) -> int:
        """The bucket size of the reduction across workers (a strategy with ``CommunicationOptions``: theirs)."""
        return DEFAULT_BYTES_PER_PACK

    def _optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, zero_grad: Callable[..., None],
                             set_to_none: bool) -> None:
        ctx = context.current_replica()
        params = optimizer_params(optimizer)
        self._summed.pop(optimizer, None)
        if ctx is None:
            zero_grad(set_to_none)
            self._mirrored.zero_copy_grads(params, None, set_to_none)
            return
        if ctx.local_replica_id == 0:
            zero_grad(set_to_none)  # the primary's gradients (the sums of the last step)
        self._mirrored.zero_copy_grads(params, ctx.local_replica_id, set_to_none)

    # ------------------------------------------------------------------ checkpoint contract
    def checkpoint_state(self, obj: Any) -> Any:
        """The whole, plain state of ``obj`` (a module, optimizer or stateful object) for a checkpoint.

        Strategies whose parameters live elsewhere (sharded on parameter servers)
        gather them here. Called on every worker; only the chief writes.
        """
        return obj.state_dict()

    def restore_checkpoint_state(self, obj: Any, state: Any) -> None:
        """Load ``state`` (as made by :meth:`checkpoint_state`, under any strategy) into ``obj``."""
        obj.load_state_dict(state)

    # ------------------------------------------------------------------ reductions
    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of ``value`` on this process's replicas, as a tuple."""
        if isinstance(value, PerReplica):
            return value.values
        if _contains_per_replica(value):
            return tuple(select_replica(k, value) for k in range(self.num_local_replicas))
        return (value,)

    def reduce(self, reduce_op: "ReduceOp | str", value: Any, axis: Axis = None) -> Any:
        """Combine a per-replica ``value`` (any structure of them) over every replica of every worker.

        ``axis=None`` reduces across replicas only; ``axis=0`` (or a tuple of dims) also
        along those dimensions, ``MEAN`` then dividing by the true number of elements
        (uneven and empty per-replica batches are counted exactly). Structures (tuples,
        dicts) keep their structure. ``reduce_op`` may be a name in any case (``"sum"``).
        """
        op = parse_reduce_op(reduce_op)
        if context.current_replica() is not None:
            raise RuntimeError("strategy.reduce() is a cross-replica call; inside run use "
                               "ds.get_replica_context().all_reduce()")
        self._refuse_mixing("reduce")
        return reduce_structure(self, op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate a per-replica ``value`` (any structure of them) along ``axis`` over every replica of every
        worker; sizes along ``axis`` may differ between replicas."""
        if context.current_replica() is not None:
            raise RuntimeError("strategy.gather() is a cross-replica call; inside run use "
                               "ds.get_replica_context().all_gather()")
        self._refuse_mixing("gather")
        return gather_structure(self, value, axis)

    def _to_replica_device(self, value: Any, local_replica_id: int) -> Any:
        device = self._devices[local_replica_id]
        if device is None:
            return value
        return map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)

    # ------------------------------------------------------------------ input
    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Any:
        """Split every global batch of ``dataset`` over all replicas in sync.

        ``dataset`` is any iterable of global batches (a ``DataLoader`` with the global
        batch size, a list of tensors, ...). See :class:`~distrib.input.DistributedDataset`.
        ``options`` (TF's ``tf.distribute.InputOptions``) is accepted and ignored.
        """
        from distrib.input import DistributedDataset

        return DistributedDataset(dataset, self, options=options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Any:
        """Call ``dataset_fn(input_context)`` once on this worker; its batches are per-replica batches.

        ``options`` (TF's ``tf.distribute.InputOptions``) is accepted and ignored.
        """
        from distrib.input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self, options=options)

    def experimental_distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]],
                                                       options: Any = None) -> Any:
        """TF's older name of :meth:`distribute_datasets_from_function` (deprecated there, kept for ported code)."""
        _deprecated("experimental_distribute_datasets_from_function", "distribute_datasets_from_function")
        return self.distribute_datasets_from_function(dataset_fn, options)


class _ReusableScope:
    """``strategy.scope()``: a context manager that can be entered again after it exits."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._active: list[contextlib.AbstractContextManager[Strategy]] = []

    def __enter__(self) -> Strategy:
        cm = self._strategy._scope()
        self._active.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc: Any) -> Optional[bool]:
        return self._active.pop().__exit__(*exc)


def _contains_per_replica(value: Any) -> bool:
    found: list[bool] = []
    map_leaves(lambda x: found.append(isinstance(x, PerReplica)), value)
    return any(found)
