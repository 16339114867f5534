"""The replica context, and the threads that run several local replicas in one process.

When a process drives several replicas (``MirroredStrategy(["cpu:0", "cpu:1"])``,
or one per GPU), ``strategy.run`` executes the replica function once per replica,
each on its own long-lived thread, as TF's ``MirroredStrategy`` does. Threads are
needed because a replica function can stop half-way at a *merge point*
(``optimizer.step()``, ``ReplicaContext.all_reduce``) until every replica has
reached it; the merged result is then handed back to each one.

Replicas take turns, in replica order, and only one runs at a time: user code in a
replica function never races with another replica (metrics, Python lists, RNG), the
order of floating-point sums is fixed, and on GPUs the kernels of different devices
still overlap because launches are asynchronous.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils._pytree as pytree

from distrib import context
from distrib.comm import failures
from distrib.strategies.reduction import gather_local_values, reduce_local_values
from distrib.values import ReduceOp, local_values, map_leaves, parse_reduce_op, regroup, select_replica, to_device

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["ReplicaContext", "ReplicaMerger", "InPlaceMerger", "ReplicaThreads", "run_in_replica", "run_in_place"]

MergeFn = Callable[[list[Any]], Sequence[Any]]


class ReplicaMerger(Protocol):
    """What makes a strategy's local replicas meet at a merge point (``ReplicaContext.merge``).

    The replica engine (several replica threads) and :class:`InPlaceMerger` (one replica, run in
    place: parameter servers' workers, the sharded strategy) are the two there are.
    """

    def merge(self, ctx: ReplicaContext, value: Any, merge_fn: MergeFn) -> Any:
        """Wait for every local replica's ``value``; return ``merge_fn(values)[ctx.local_replica_id]``."""


class InPlaceMerger:
    """The merger of a strategy whose process drives one replica, in place: the merge is the call itself."""

    def merge(self, ctx: ReplicaContext, value: Any, merge_fn: MergeFn) -> Any:
        return merge_fn([value])[0]


class ReplicaContext:
    """What a replica function knows about itself (``tf.distribute.ReplicaContext``).

    Example::

        >>> import distrib as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> def fn():
        ...     ctx = ds.get_replica_context()
        ...     return ctx.all_reduce(ds.ReduceOp.SUM, torch.tensor(1.0 + ctx.replica_id_in_sync_group))
        >>> s.experimental_local_results(s.run(fn))
        (tensor(3.), tensor(3.))

    Args:
        strategy: the strategy running the replica.
        local_replica_id: the replica's index among this process's replicas.
        merger: how the local replicas meet in ``merge`` (threads, or in place with one replica).
    """

    def __init__(self, strategy: Strategy, local_replica_id: int, merger: ReplicaMerger) -> None:
        self.strategy = strategy
        self.local_replica_id = local_replica_id
        self._merger = merger
        self._scaled_loss = False

    def record_scaled_loss(self) -> None:
        """Called by ``compute_average_loss`` / ``scale_regularization_loss``: this step's loss was scaled."""
        self._scaled_loss = True

    @property
    def scaled_loss_recorded(self) -> bool:
        """Whether the current ``run`` call scaled a loss with distrib's helpers on this replica."""
        return self._scaled_loss

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index among all replicas of all workers."""
        return self.strategy.data_worker_index * self.strategy.num_local_replicas + self.local_replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in every step, over all workers (the strategy's)."""
        return self.strategy.num_replicas_in_sync

    @property
    def device(self) -> torch.device | None:
        """The device this replica computes on (None: wherever tensors already are)."""
        return self.strategy.local_devices[self.local_replica_id]

    @property
    def devices(self) -> tuple[str, ...]:
        """TF's ``ReplicaContext.devices``: the name of this replica's device."""
        return (str(self.device) if self.device is not None else "default",)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduce ``value`` (a tensor or a structure of them) over every replica in sync.

        Every replica must call it, in the same order; each gets the result on its own
        device. It is differentiable, as TF's: the gradient reaching a replica's input is
        the same reduction of every replica's upstream gradient (every replica then runs
        ``backward()``).

        Args:
            reduce_op: ``ds.ReduceOp.SUM`` or ``ds.ReduceOp.MEAN`` (or their names).
            value: a tensor, or a structure of them, the same structure on every replica.

        Returns:
            The reduced value, on this replica's device.
        """
        op = parse_reduce_op(reduce_op)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value)):
            return pytree.tree_map(lambda t: _AllReduce.apply(self, op, t) if isinstance(t, torch.Tensor) else t, value)
        return self._all_reduce(op, value)

    def _all_reduce(self, op: ReduceOp, value: Any) -> Any:
        def merge(values: list[Any]) -> list[Any]:
            n = len(values)
            reduced = map_leaves(
                lambda leaf: reduce_local_values(self.strategy, op, local_values(leaf, n), None), regroup(values)
            )
            return [to_device(reduced, self.strategy.local_devices[i]) for i in range(n)]

        return self.merge(value, merge)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenate ``value`` (a tensor or a structure of them) along ``axis`` over every replica in sync.

        Every replica gets the whole result, on its own device; sizes along ``axis`` may
        differ between replicas. Differentiable, as TF's: a replica's input receives the
        sum over replicas of the upstream gradients of its slice. ``options`` (TF's
        ``CommunicationOptions``) is ignored.

        Args:
            value: a tensor, or a structure of them.
            axis: the dimension to concatenate along.
            options: accepted for TF's signature, ignored.

        Returns:
            The concatenated value, on this replica's device.
        """
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value)):
            return pytree.tree_map(
                lambda t: _AllGather.apply(self, axis, t) if isinstance(t, torch.Tensor) else t, value
            )
        return self._all_gather(value, axis)

    def _all_gather(self, value: Any, axis: int) -> Any:
        def merge(values: list[Any]) -> list[Any]:
            n = len(values)
            gathered = map_leaves(
                lambda leaf: gather_local_values(self.strategy, local_values(leaf, n), axis, "all_gather"),
                regroup(values),
            )
            return [to_device(gathered, self.strategy.local_devices[i]) for i in range(n)]

        return self.merge(value, merge)

    def _slice_of_gather(self, size: int) -> int:
        """Where this replica's part starts in an all-gather whose parts have ``size`` rows here."""
        sizes = self._all_gather(torch.tensor([size]), 0)  # one size per replica, in replica order
        return int(sizes[: self.replica_id_in_sync_group].sum())

    def merge_call(
        self, merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Call ``merge_fn(strategy, *args, **kwargs)`` once, in a cross-replica context (TF's ``merge_call``).

        Every local replica must call it; each replica's ``args`` become one
        ``PerReplica`` argument (plain when this process has one replica). The result
        is given to every replica: a ``PerReplica`` in it gives each replica its element.

        Args:
            merge_fn: ``merge_fn(strategy, *args, **kwargs)``, run once in a cross-replica context.
            args: positional arguments, one ``PerReplica`` each over the replicas.
            kwargs: keyword arguments, grouped the same way.

        Returns:
            ``merge_fn``'s result (a ``PerReplica`` in it gives each replica its element).
        """

        def merge(values: list[Any]) -> list[Any]:
            grouped_args, grouped_kwargs = regroup(values)
            strategy = self.strategy
            previous = context.set_current_replica(None)
            context.push_scope(strategy)  # merge_fn sees the cross-replica context of this strategy
            try:
                result = merge_fn(strategy, *grouped_args, **grouped_kwargs)
            finally:
                context.pop_scope(strategy)
                context.set_current_replica(previous)
            return [select_replica(i, result) for i in range(len(values))]

        return self.merge((tuple(args), dict(kwargs or {})), merge)

    def merge(self, value: Any, merge_fn: MergeFn) -> Any:
        """Wait until every local replica has called ``merge``; run ``merge_fn`` once on all values.

        ``merge_fn`` receives the list of values in local-replica order and returns one
        result per replica. This is TF's ``merge_call``, reduced to what distrib needs.

        Args:
            value: this replica's value.
            merge_fn: ``values -> results``, one result per local replica.

        Returns:
            This replica's element of ``merge_fn``'s results.
        """
        return self._merger.merge(self, value, merge_fn)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class _AllReduce(torch.autograd.Function):
    """``ReplicaContext.all_reduce`` of one tensor, with TF's gradient: the same reduction of the upstream ones."""

    @staticmethod
    def forward(fctx: Any, replica: ReplicaContext, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        fctx.replica, fctx.op = replica, op
        result: torch.Tensor = replica._all_reduce(op, tensor.detach())
        return result

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        return None, None, fctx.replica._all_reduce(fctx.op, grad.contiguous())


class _AllGather(torch.autograd.Function):
    """``ReplicaContext.all_gather`` of one tensor; a replica's gradient is its slice of the summed upstream ones."""

    @staticmethod
    def forward(fctx: Any, replica: ReplicaContext, axis: int, tensor: torch.Tensor) -> torch.Tensor:
        axis = axis % max(tensor.dim(), 1)
        fctx.replica, fctx.axis, fctx.size = replica, axis, tensor.shape[axis]
        fctx.start = replica._slice_of_gather(tensor.shape[axis])
        result: torch.Tensor = replica._all_gather(tensor.detach(), axis)
        return result

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        total = fctx.replica._all_reduce(ReduceOp.SUM, grad.contiguous())
        return None, None, total.narrow(fctx.axis, fctx.start, fctx.size)


class _Aborted(Exception):
    """Raised inside replica threads when another replica has failed."""


class ReplicaThreads:
    """Long-lived threads, one per local replica, that run replica functions in turn.

    Between calls they hold nothing of the caller's (tasks, results and merge values are dropped once
    ``run`` returns), so a strategy is freed once the user drops it; :meth:`close` ends the threads.
    """

    def __init__(self, num_replicas: int, name: str) -> None:
        self._n = num_replicas
        self._cond = threading.Condition()
        self._generation = 0
        self._turn = -1
        self._tasks: list[Callable[[], Any]] = []
        self._results: list[Any] = [None] * num_replicas
        self._done = [True] * num_replicas
        self._error: BaseException | None = None
        self._merge_values: list[Any] = [None] * num_replicas
        self._merge_results: Sequence[Any] = ()
        self._merge_generation = 0
        self._arrived = 0
        self._closed = False
        for k in range(num_replicas):
            t = threading.Thread(target=self._main, args=(k,), name=f"{name}-replica-{k}", daemon=True)
            t.start()

    def run(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[k]`` on replica thread k; return their results, or raise the first error."""
        with self._cond:
            self._tasks = tasks
            self._results = [None] * self._n
            self._done = [False] * self._n
            self._error = None
            self._arrived = 0
            self._turn = 0
            self._generation += 1
            self._cond.notify_all()
            while not all(self._done):
                self._cond.wait()
            error, self._error = self._error, None
            results = list(self._results)
            # hold nothing of this call between calls (its closures reach the strategy and the user's objects)
            self._tasks, self._results, self._merge_results = [], [None] * self._n, ()
        if error is not None:
            raise error
        return results

    def close(self) -> None:
        """End the threads (they are waiting between calls); the object cannot run anything after."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def merge(self, k: int, value: Any, merge_fn: MergeFn) -> Any:
        with self._cond:
            if self._error is not None:
                raise _Aborted()
            self._merge_values[k] = value
            self._arrived += 1
            generation = self._merge_generation
            if k == self._n - 1:
                if self._arrived != self._n:
                    self._fail(RuntimeError(self._mismatch_message()))
                    raise _Aborted()
                values, self._merge_values = self._merge_values, [None] * self._n
                self._arrived = 0
                try:
                    results = list(merge_fn(values))
                except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                    self._fail(e)
                    raise _Aborted() from None
                if len(results) != self._n:
                    self._fail(RuntimeError(f"merge function returned {len(results)} results for {self._n} replicas"))
                    raise _Aborted()
                self._merge_results = results
                self._merge_generation += 1
                self._turn = 0
            else:
                self._turn = k + 1
            self._cond.notify_all()
            while not ((self._merge_generation > generation and self._turn == k) or self._error is not None):
                self._cond.wait()
            if self._error is not None:
                raise _Aborted()
            return self._merge_results[k]

    def _mismatch_message(self) -> str:
        finished = [i for i, d in enumerate(self._done) if d]
        return (
            f"replicas {finished} returned while other replicas wait at a merge point "
            "(optimizer.step() or ReplicaContext.all_reduce): every replica must reach the "
            "same merge points in the same order"
        )

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._cond.notify_all()

    def _main(self, k: int) -> None:
        seen = 0
        while True:
            with self._cond:
                while not (self._closed or (self._generation > seen and (self._turn == k or self._error is not None))):
                    self._cond.wait()
                if self._closed:
                    return
                seen = self._generation
                task = self._tasks[k] if self._error is None else None
            result, error = None, None
            if task is not None:
                try:
                    result = task()
                except _Aborted:
                    pass
                except BaseException as e:  # noqa: BLE001 - handed to the caller of run()
                    error = e
                    failures.add_note(e, f"(raised in replica {k} of {self._n})")
            with self._cond:
                if error is not None:
                    self._fail(error)
                self._results[k] = result
                task = result = None  # this thread keeps nothing of the call while it waits for the next
                self._done[k] = True
                if self._error is None:
                    if k + 1 < self._n:
                        self._turn = k + 1
                    elif self._arrived:
                        self._fail(RuntimeError(self._mismatch_message()))
                self._cond.notify_all()


def run_in_replica(
    ctx: ReplicaContext, fn: Callable[..., Any], args: tuple, kwargs: dict, grad_enabled: bool, inference: bool
) -> Any:
    """Call ``fn`` with ``ctx`` as this thread's replica context and the caller's autograd mode."""
    previous = context.set_current_replica(ctx)
    ctx._scaled_loss = False
    try:
        if torch.is_grad_enabled() == grad_enabled and torch.is_inference_mode_enabled() == inference:
            return fn(*args, **kwargs)  # the caller's own thread (one replica): its modes hold; entering
            # the two mode guards anyway costs microseconds a step, which show on a GPU
        with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
            return fn(*args, **kwargs)
    finally:
        context.set_current_replica(previous)


def run_in_place(ctx: ReplicaContext, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn`` on the calling thread as replica ``ctx``, in the caller's autograd mode (one local replica)."""
    return run_in_replica(ctx, fn, args, kwargs, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
