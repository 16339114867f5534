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
``step_executor`` (how ``fit`` runs a step). Subclasses override the ``_``-methods.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from distrib import context
from distrib.comm import Communicator, LocalCommunicator
from distrib.comm.hooks import CommHook, allreduce_hook
from distrib.comm.gradient_reducer import reduce_gradients
from distrib.comm.options import DEFAULT_BYTES_PER_PACK
from distrib.strategies.replica import ReplicaContext, ReplicaThreads, run_in_replica
from distrib.strategies.replication import (MirroredModules, ModuleCapture, install_capture_hooks,
                                            optimizer_params, remove_capture_hooks, wrap_optimizer)
from distrib.values import (PerReplica, ReduceOp, local_values, map_leaves, parse_reduce_op, regroup, select_replica,
                            to_tensor)

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver
    from distrib.strategies.execution import StepExecutor

__all__ = ["Strategy"]


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
        if self._communicator.world_size > 1:
            context.register_cluster_strategy(self)

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
        if self.num_replicas_in_sync == 1:
            return
        foreign = [p for p in optimizer_params(optimizer) if p not in self._mirrored]
        if foreign:
            raise ValueError(
                f"{type(optimizer).__name__} was created under {type(self).__name__}.scope() over "
                f"{len(foreign)} parameter(s) of a module built outside the scope; build the model "
                "inside the same strategy.scope() as the optimizer"
            )
        wrap_optimizer(optimizer, self._optimizer_step, self._optimizer_zero_grad)

    # ------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        """Run ``fn`` once per local replica; PerReplica arguments give each replica its element.

        Returns the plain result when this process has one replica, else a structure
        whose leaves are :class:`~distrib.PerReplica`.
        """
        if context.current_replica() is not None:
            raise RuntimeError("strategy.run() was called inside a replica function; call it from the training loop")
        if self._capture:
            self._claim_captured_modules()
        kwargs = kwargs or {}
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        n = self.num_local_replicas
        if n == 1:
            return run_in_replica(self._replica_contexts[0], fn, tuple(args), kwargs, grad, inference)
        if self._threads is None:
            self._threads = ReplicaThreads(n, type(self).__name__)
        tasks: list[Callable[[], Any]] = [
            functools.partial(run_in_replica, self._replica_contexts[k], fn, select_replica(k, tuple(args)),
                              select_replica(k, kwargs), grad, inference)
            for k in range(n)
        ]
        return regroup(self._threads.run(tasks))

    def _merge(self, ctx: ReplicaContext, value: Any, merge_fn: Callable[[list[Any]], Sequence[Any]]) -> Any:
        if self.num_local_replicas == 1:
            return merge_fn([value])[0]
        assert self._threads is not None, "a merge happens inside run(), which started the threads"
        return self._threads.merge(ctx.local_replica_id, value, merge_fn)

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
        if ctx is None:  # cross-replica: the gradients are already where they are
            return self._apply_update(optimizer, step, args, kwargs)
        if (args or kwargs.get("closure") is not None) and self.num_local_replicas > 1:
            raise ValueError("optimizer.step(closure) is not supported with several local replicas; "
                             "call loss.backward() and optimizer.step() in the replica function")
        return ctx.merge(None, lambda values: [self._apply_update(optimizer, step, args, kwargs)] * len(values))

    def _apply_update(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any],
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._sync_gradients(optimizer_params(optimizer))
        result = step(*args, **kwargs)
        self._mirrored.refresh(average_buffers=True)
        return result

    def _sync_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum every parameter's gradient over local replicas, then over workers, into ``param.grad``."""
        to_reduce: list[torch.Tensor] = []
        for p in params:
            grads = [g for g in self._mirrored.replica_grads(p) if g is not None]
            if grads:
                total = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for g in grads:
                    total.add_(g.to(total.device, non_blocking=True))
                p.grad = total
            if self.num_workers > 1:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                to_reduce.append(p.grad)
        reduce_gradients(self._communicator, to_reduce, DEFAULT_BYTES_PER_PACK, self._comm_hook)

    def _optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, zero_grad: Callable[..., None],
                             set_to_none: bool) -> None:
        ctx = context.current_replica()
        params = optimizer_params(optimizer)
        if ctx is None:
            zero_grad(set_to_none)
            self._mirrored.zero_copy_grads(params, None, set_to_none)
        elif ctx.local_replica_id == 0:
            zero_grad(set_to_none)
        else:
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

    def reduce(self, reduce_op: "ReduceOp | str", value: Any, axis: Optional[int] = None) -> Any:
        """Combine a per-replica ``value`` over every replica of every worker.

        ``axis=None`` reduces across replicas only; ``axis=0`` also along the batch
        dimension, ``MEAN`` then dividing by the true number of elements (uneven and
        empty per-replica batches are counted exactly).
        """
        op = parse_reduce_op(reduce_op)
        if context.current_replica() is not None:
            raise RuntimeError("strategy.reduce() is a cross-replica call; inside run use "
                               "ds.get_replica_context().all_reduce()")
        if isinstance(value, PerReplica) or not _contains_per_replica(value):
            return self._reduce_one(op, value, axis)
        return map_leaves(lambda leaf: self._reduce_one(op, leaf, axis), value)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: Optional[int]) -> torch.Tensor:
        if not isinstance(value, PerReplica) and self.num_local_replicas > 1:
            if op is ReduceOp.SUM and axis is None:
                raise ValueError(
                    "strategy.reduce(SUM, value) got a plain value, but this process has "
                    f"{self.num_local_replicas} replicas: pass the PerReplica value that strategy.run returned"
                )
            value = PerReplica([value] * self.num_local_replicas)
        return self._reduce_local_values(op, local_values(value, self.num_local_replicas), axis)

    def _reduce_local_values(self, op: ReduceOp, values: Sequence[Any], axis: Optional[int]) -> Any:
        """Reduce one value per local replica over all replicas of all workers."""
        device = self._devices[0]
        tensors = [to_tensor(v, device).detach() for v in values]
        if axis is None:
            total = tensors[0].clone() if len(tensors) == 1 else torch.stack([t.to(tensors[0].device) for t in tensors]).sum(0)
            count = torch.tensor(float(self.num_replicas_in_sync))
            if self.num_workers > 1:
                self._communicator.all_reduce([total])
        else:
            total = tensors[0].sum(dim=axis)
            for t in tensors[1:]:
                total = total + t.sum(dim=axis).to(total.device)
            count = torch.tensor(float(sum(t.shape[axis] for t in tensors)), device=total.device)
            if self.num_workers > 1:
                self._communicator.all_reduce([total, count])
        if op is ReduceOp.MEAN:
            if not total.is_floating_point():
                total = total.to(torch.get_default_dtype())
            return total / count.to(total.device)
        return total

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate a per-replica ``value`` along ``axis`` over every replica of every worker."""
        def gather_one(leaf: Any) -> torch.Tensor:
            parts = [to_tensor(v, self._devices[0]) for v in local_values(leaf, self.num_local_replicas)]
            local = torch.cat([p.to(parts[0].device) for p in parts], dim=axis)
            return self._communicator.all_gather(local, axis) if self.num_workers > 1 else local

        if isinstance(value, PerReplica) or not _contains_per_replica(value):
            return gather_one(value)
        return map_leaves(gather_one, value)

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

        return DistributedDataset(dataset, self)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Any:
        """Call ``dataset_fn(input_context)`` once on this worker; its batches are per-replica batches.

        ``options`` (TF's ``tf.distribute.InputOptions``) is accepted and ignored.
        """
        from distrib.input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self)


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
