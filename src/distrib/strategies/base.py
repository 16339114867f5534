"""``Strategy``: the small abstract base of every strategy.

It holds what every strategy shares and nothing of how one runs a step:

* the public ``tf.distribute.Strategy`` API (``scope``, ``run``, ``reduce``, ``gather``,
  ``experimental_local_results``, ``experimental_distribute_values_from_function``,
  ``extended``, TF's deprecated names);
* the topology, fixed by the constructor: this process's replica devices (``None``: tensors stay
  where they are), a :class:`~distrib.comm.Communicator` to the other workers, and optionally a
  cluster resolver (``num_replicas_in_sync``, ``num_local_replicas``, ``local_devices``,
  ``worker_index``, ``num_workers``, ``is_chief``, ``barrier``, ``communicator``);
* the contracts with the rest of distrib: the scope's capture (modules built inside are handed to
  :meth:`distribute_module` when complete, optimizers to :meth:`distribute_optimizer`), checkpoints
  (:meth:`checkpoint_state`, :meth:`restore_checkpoint_state`), the loop (:meth:`step_executor`)
  and the gradient seam (:attr:`gradient_merge`, through ``extended``).

Each strategy decides the abstract members: how it calls the replica function
(:meth:`call_for_each_replica`), what it does with a module and an optimizer built in its scope,
how it distributes input, and how ``fit`` runs a step. Shared behaviour comes from parts a strategy
composes: the replica engine (``replica_engine.py``) for the synchronous strategies
(``synchronous.py``), the in-place merger (``replica.InPlaceMerger``) for strategies that run
one replica in place (parameter servers' workers; the sharded strategy).
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distrib import context
from distrib.comm import Communicator, LocalCommunicator, failures
from distrib.integrations import keras_fit, keras_models, keras_objects
from distrib.strategies.capture import ModuleCapture, install_capture_hooks, remove_capture_hooks
from distrib.strategies.extended import GradientMerge, StrategyExtended
from distrib.strategies.reduction import Axis, gather_structure, reduce_structure
from distrib.strategies.run_options import RunOptions, UnscaledLossWarning, ValueContext
from distrib.values import PerReplica, ReduceOp, map_leaves, parse_reduce_op, select_replica, to_device

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver
    from distrib.strategies.execution import StepExecutor

__all__ = ["Strategy", "RunOptions", "ValueContext", "UnscaledLossWarning", "ReusableScope"]


_NO_OPTIONS = RunOptions()  # run's default, made once: a frozen dataclass costs ~0.3 us a step to build


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"strategy.{old} is TF's deprecated name of strategy.{new}; use {new}", DeprecationWarning, stacklevel=3
    )


class Strategy(abc.ABC):
    """Runs one training step on every replica and keeps replicated state in sync (``tf.distribute.Strategy``).

    Abstract: see :class:`~distrib.MirroredStrategy` for a runnable example, and the module
    docstring for what a strategy must decide.

    Args:
        devices: each local replica's device (None: tensors stay where they are); at least one.
        communicator: the collectives to the other workers; None: none (a single process).
        cluster_resolver: the cluster of a multi-worker strategy; None for a single process.
        device_names: TF-style names of the devices (``"/job:worker/replica:0/task:0/device:GPU:0"``) for
            ``extended.worker_devices``; None: derived from ``devices``.

    Raises:
        ValueError: ``devices`` is empty.
    """

    #: True where ``fit`` must schedule steps through a ``ClusterCoordinator`` (parameter servers).
    should_use_with_coordinator: bool = False

    def __init__(
        self,
        devices: Sequence[torch.device | None],
        communicator: Communicator | None = None,
        cluster_resolver: ClusterResolver | None = None,
        device_names: Sequence[str] | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a strategy needs at least one device")
        self._devices: tuple[torch.device | None, ...] = tuple(devices)
        self._device_names = tuple(device_names) if device_names else tuple(str(d) for d in devices)
        self._communicator: Communicator = communicator or LocalCommunicator()
        self._cluster_resolver = cluster_resolver
        self._capture = ModuleCapture()
        if self._communicator.world_size > 1:
            context.register_cluster_strategy(self)

    # ------------------------------------------------------------------ what each strategy decides
    @abc.abstractmethod
    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        """Call ``fn`` once per local replica (``run``'s work, after its checks): the plain result with one
        local replica, else a structure of :class:`~distrib.PerReplica` (TF's ``extended.call_for_each_replica``).

        Args:
            fn: the step function.
            args: positional arguments of ``fn`` (``PerReplica`` ones are split per replica).
            kwargs: keyword arguments of ``fn``.
            options: ``RunOptions``.

        Returns:
            ``fn``'s result, or a structure of ``PerReplica`` with several local replicas.
        """

    @abc.abstractmethod
    def distribute_module(self, module: torch.nn.Module) -> None:
        """Take over a root module built in this strategy's scope, once it is complete (place, copy, shard, ...).

        Args:
            module: the root module.
        """

    @abc.abstractmethod
    def distribute_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Take over an optimizer built in this strategy's scope (the modules built before it are distributed).

        Args:
            optimizer: the optimizer.
        """

    @abc.abstractmethod
    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Any:
        """Distribute ``dataset``'s global batches over the replicas in sync.

        Args:
            dataset: an iterable of global batches (a ``DataLoader``, a list, a generator).
            options: ``ds.InputOptions``, or None for the defaults.

        Returns:
            An iterable whose elements are this worker's batches, split per replica (``PerReplica`` with several).
        """

    @abc.abstractmethod
    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Any:
        """Call ``dataset_fn(input_context)`` for this worker's input pipeline.

        Args:
            dataset_fn: ``input_context -> iterable`` of this worker's per-worker batches (``ds.InputContext``
                gives the worker's index and the per-replica batch size).
            options: ``ds.InputOptions``, or None for the defaults.

        Returns:
            An iterable of this worker's batches, split per replica.
        """

    @abc.abstractmethod
    def step_executor(self) -> StepExecutor:
        """How ``fit``/``evaluate``/``predict`` run a step under this strategy (``strategies/execution.py``).

        Returns:
            The executor that runs the loops' steps.
        """

    @property
    def gradient_merge(self) -> GradientMerge | None:
        """What merges this strategy's optimizer steps over replicas and workers (``extended``'s seam); None
        where no step is merged."""
        return None

    @property
    def graph_capture_blocker(self) -> str | None:
        """Why ``ds.function`` cannot capture this strategy's steps as one CUDA graph, or None where it can.

        A graph captures the kernels one thread launches on one GPU, NCCL's collectives included: the
        strategies with one replica per process on a CUDA device, alone or with NCCL between workers.
        """
        n = self.num_local_replicas
        if n > 1:
            return (
                f"{type(self).__name__} runs {n} replicas in this process, on threads, and a CUDA graph "
                "holds one thread's kernels; one replica per process (distrib launch / torchrun, "
                "MultiWorkerMirroredStrategy over NCCL) can be captured"
            )
        device = self._devices[0]
        if device is not None and device.type != "cuda":
            return f"{type(self).__name__} computes on {device}, and CUDA graphs need a CUDA device"
        backend = self._communicator.backend
        if self.num_workers > 1 and backend != "nccl":
            return (
                f"the workers' collectives run over {backend}, on the host, and a CUDA graph captures only "
                "NCCL's (MultiWorkerMirroredStrategy(communication_options=CommunicationOptions("
                "implementation='NCCL')))"
            )
        return None

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
    def local_devices(self) -> tuple[torch.device | None, ...]:
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
    def data_worker_index(self) -> int:
        """This worker's index among the workers that split the global batch: ``worker_index``, except under a
        mesh (``MeshStrategy``), where the workers of one tensor-parallel group read the same part."""
        return self.worker_index

    @property
    def num_data_workers(self) -> int:
        """The workers that split the global batch: ``num_workers``, except under a mesh (the data axes' size)."""
        return self.num_workers

    @property
    def counts_in_reductions(self) -> bool:
        """Whether this worker's values count in ``reduce``/``gather``: True, except under a mesh on the workers of
        a tensor-parallel group other than its first (they hold the same replica: it would count several times)."""
        return True

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief: the one that writes checkpoints and summaries (the resolver's
        word when there is one, else worker 0)."""
        if self._cluster_resolver is not None:
            return self._cluster_resolver.is_chief
        return self.worker_index == 0

    @property
    def communicator(self) -> Communicator:
        """The collectives to the other workers (identity for single-process strategies)."""
        return self._communicator

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The cluster resolver of a multi-worker strategy; None for single-process ones."""
        return self._cluster_resolver

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every worker has reached this call (``timeout`` seconds at most).

        Example::

            >>> import distrib as ds
            >>> ds.MirroredStrategy(["cpu:0", "cpu:1"]).barrier()  # one worker: returns at once

        Args:
            timeout: seconds to wait at most; None: the communicator's timeout.

        Raises:
            CollectiveError: a worker did not arrive in time, or died.
        """
        self._communicator.barrier(timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._device_names)}, num_replicas_in_sync={self.num_replicas_in_sync})"

    # ------------------------------------------------------------------ scope
    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this the current strategy; modules and optimizers built inside are distributed.

        The returned object can be entered again (``s = strategy.scope(); with s: ...; with s: ...``).

        Returns:
            A re-enterable context manager that yields this strategy.
        """
        return ReusableScope(self._capturing_scope)

    @contextlib.contextmanager
    def _capturing_scope(self) -> Iterator[Strategy]:
        context.push_scope(self)
        install_capture_hooks()
        try:
            yield self
        finally:
            remove_capture_hooks()
            try:
                self.claim_modules()
            finally:
                context.pop_scope(self)

    @property
    def module_capture(self) -> ModuleCapture:
        """The modules seen being built in this strategy's scope and not yet distributed."""
        return self._capture

    def claim_modules(self) -> None:
        """Hand every complete root module built in the scope so far to :meth:`distribute_module`."""
        for root in self._capture.take_roots():
            self.distribute_module(root)
            keras_fit.refuse_own_training(self, root)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer was built in the scope: distribute the modules built before it, then the optimizer.

        Args:
            optimizer: the optimizer just built.
        """
        self.claim_modules()
        self.distribute_optimizer(optimizer)

    # ------------------------------------------------------------------ run
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Run ``fn`` once per local replica; PerReplica arguments give each replica its element.

        Returns the plain result when this process has one replica, else a structure
        whose leaves are :class:`~distrib.PerReplica`. ``options``: see :class:`RunOptions`.

        Args:
            fn: the step function, called once per local replica in its replica context.
            args: positional arguments of ``fn``; a ``PerReplica`` gives each replica its element.
            kwargs: keyword arguments of ``fn``, split the same way.
            options: ``RunOptions``, or None.

        An exception of ``fn`` is raised as itself, the user's frame last in its traceback (with a note naming
        the replica, and the worker where there are several); the other workers, left waiting for this one in a
        collective, raise a ``CollectiveError`` that names this worker and its error.

        Returns:
            ``fn``'s result with one local replica, else a structure of ``PerReplica``.

        Raises:
            RuntimeError: called inside a replica function.
            CollectiveError: a collective inside the step failed (a peer died, hung past the timeout, or its own
                step raised).
        """
        if context.current_replica() is not None:
            raise RuntimeError("strategy.run() was called inside a replica function; call it from the training loop")
        context.refuse_mixing(self, "run")
        if context.run_observers:
            context.note_run(self)
        if self._capture:
            self.claim_modules()
        if keras_models.keras_loaded():  # the Keras optimizers, metrics and losses the step names
            keras_objects.prepare_step(self, fn, [*args, *(kwargs or {}).values()])
        try:
            result = self.call_for_each_replica(fn, tuple(args), kwargs or {}, options or _NO_OPTIONS)
        except Exception as error:
            self._report_step_error(error)
            raise  # the user's error as itself, their frame last
        self._communicator.report_step_error(None)
        return result

    def _report_step_error(self, error: Exception) -> None:
        """An error raised in ``run``: the user's own (not a collective's failure) is named to the other workers,
        which are left waiting for this one in a collective, and noted with this worker's index."""
        if self.num_workers == 1 or failures.is_collective_failure(error):
            return
        failures.add_note(error, f"(raised in strategy.run on worker {self.worker_index} of {self.num_workers})")
        self._communicator.report_step_error(error)

    def experimental_run_v2(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """TF's older name of :meth:`run` (deprecated there, kept for ported code).

        Args:
            fn: as :meth:`run`'s.
            args: as :meth:`run`'s.
            kwargs: as :meth:`run`'s.
            options: as :meth:`run`'s.

        Returns:
            What :meth:`run` returns.
        """
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

        Args:
            value_fn: ``ValueContext -> value``, called once per local replica.

        Returns:
            A ``PerReplica`` of the values (the value itself with one replica).
        """
        first = self.data_worker_index * self.num_local_replicas
        values = [
            to_device(value_fn(ValueContext(first + k, self.num_replicas_in_sync)), device)
            for k, device in enumerate(self._devices)
        ]
        return values[0] if len(values) == 1 else PerReplica(values)

    @property
    def extended(self) -> StrategyExtended:
        """TF's ``strategy.extended``: ``reduce_to``, ``batch_reduce_to``, devices, ``should_checkpoint``, ..."""
        return StrategyExtended(self)

    # ------------------------------------------------------------------ checkpoint contract
    def checkpoint_state(self, obj: Any) -> Any:
        """The whole, plain state of ``obj`` (a module, optimizer or stateful object) for a checkpoint.

        Strategies whose parameters live elsewhere (sharded on parameter servers)
        gather them here. Called on every worker; only the chief writes.

        Args:
            obj: a module, an optimizer, or any object with ``state_dict``.

        Returns:
            ``obj``'s state dict with whole tensors.
        """
        return obj.state_dict()

    def restore_checkpoint_state(self, obj: Any, state: Any) -> None:
        """Load ``state`` into ``obj``: whole tensors (:meth:`checkpoint_state`'s, under any strategy), or tensors
        laid out as :meth:`local_checkpoint_state`'s (a sharded checkpoint read back into this strategy).

        Args:
            obj: a module, an optimizer, or any object with ``load_state_dict``.
            state: the state to load.
        """
        obj.load_state_dict(state)

    @property
    def checkpoint_format(self) -> str:
        """How ``ds.Checkpoint`` writes under this strategy: ``"plain"``, one file of whole states
        (:meth:`checkpoint_state`) that the chief writes; or ``"sharded"``, one directory into which every
        worker writes its own part (:meth:`local_checkpoint_state`) in parallel, through
        ``torch.distributed.checkpoint``. Either loads under every strategy."""
        return "plain"

    def local_checkpoint_state(self, obj: Any) -> Any:
        """``obj``'s state as this worker holds it, without gathering (a sharded strategy's ``DTensor`` shards):
        what a ``"sharded"`` checkpoint writes, and what a restore keeps to roll back. The whole state here.

        Args:
            obj: a module, an optimizer, or any object with ``state_dict``.

        Returns:
            ``obj``'s state dict as this worker holds it.
        """
        return self.checkpoint_state(obj)

    # ------------------------------------------------------------------ reductions
    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of ``value`` on this process's replicas, as a tuple.

        Args:
            value: a ``PerReplica`` (or a structure of them), or a plain value.

        Returns:
            One element per local replica (a plain value: a tuple of itself).
        """
        if isinstance(value, PerReplica):
            return value.values
        if _contains_per_replica(value):
            return tuple(select_replica(k, value) for k in range(self.num_local_replicas))
        return (value,)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Axis = None) -> Any:
        """Combine a per-replica ``value`` (any structure of them) over every replica of every worker.

        ``axis=None`` reduces across replicas only; ``axis=0`` (or a tuple of dims) also
        along those dimensions, ``MEAN`` then dividing by the true number of elements
        (uneven and empty per-replica batches are counted exactly). Structures (tuples,
        dicts) keep their structure. ``reduce_op`` may be a name in any case (``"sum"``).

        Args:
            reduce_op: ``ds.ReduceOp.SUM`` or ``ds.ReduceOp.MEAN`` (or ``"SUM"``/``"MEAN"``).
            value: what ``run`` returned: a ``PerReplica``, a plain tensor, or a structure of them.
            axis: None, a dimension, or a tuple of dimensions to reduce along as well.

        Returns:
            The reduced value (tensors on the first local device), the same on every worker.

        Raises:
            RuntimeError: called inside a replica function.
        """
        op = parse_reduce_op(reduce_op)
        if context.current_replica() is not None:
            raise RuntimeError(
                "strategy.reduce() is a cross-replica call; inside run use ds.get_replica_context().all_reduce()"
            )
        context.refuse_mixing(self, "reduce")
        return reduce_structure(self, op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate a per-replica ``value`` (any structure of them) along ``axis`` over every replica of every
        worker; sizes along ``axis`` may differ between replicas.

        Args:
            value: what ``run`` returned: a ``PerReplica``, a plain tensor, or a structure of them.
            axis: the dimension to concatenate along.

        Returns:
            The concatenated value, the same on every worker.

        Raises:
            RuntimeError: called inside a replica function.
        """
        if context.current_replica() is not None:
            raise RuntimeError(
                "strategy.gather() is a cross-replica call; inside run use ds.get_replica_context().all_gather()"
            )
        context.refuse_mixing(self, "gather")
        return gather_structure(self, value, axis)

    # ------------------------------------------------------------------ input: TF's older name
    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None
    ) -> Any:
        """TF's older name of :meth:`distribute_datasets_from_function` (deprecated there, kept for ported code).

        Args:
            dataset_fn: as :meth:`distribute_datasets_from_function`'s.
            options: as :meth:`distribute_datasets_from_function`'s.

        Returns:
            What :meth:`distribute_datasets_from_function` returns.
        """
        _deprecated("experimental_distribute_datasets_from_function", "distribute_datasets_from_function")
        return self.distribute_datasets_from_function(dataset_fn, options)


class ReusableScope:
    """``strategy.scope()``: a context manager that can be entered again after it exits."""

    def __init__(self, enter: Callable[[], contextlib.AbstractContextManager[Strategy]]) -> None:
        self._enter = enter
        self._active: list[contextlib.AbstractContextManager[Strategy]] = []

    def __enter__(self) -> Strategy:
        cm = self._enter()
        self._active.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._active.pop().__exit__(*exc)


def _contains_per_replica(value: Any) -> bool:
    found: list[bool] = []
    map_leaves(lambda x: found.append(isinstance(x, PerReplica)), value)
    return any(found)
