"""``ParameterServerStrategy``: parameters on ps tasks, steps on workers, scheduled by a coordinator.

Single-client, as in TF 2: the chief runs the user's script. Under
``strategy.scope()``:

* every parameter of a module built there is placed on the ps tasks, round robin,
  split along dim 0 into shards if the ``variable_partitioner`` says so. The module
  on the coordinator keeps a local copy that is refreshed from the ps tasks when it
  is called or its ``state_dict()`` is read; ``load_state_dict()`` writes whole
  tensors back, re-split for the current shards (so ``ds.Checkpoint`` works as is,
  and a checkpoint moves between plain models and any number of ps tasks or shards);
* an optimizer built there gets a twin beside every shard, on the ps task holding
  it; ``optimizer.step()`` sends gradients there (only the touched rows for sparse
  gradients) and the update is applied there, asynchronously with other workers.
  ``optimizer.state_dict()`` on the coordinator gathers whole tensors, and options
  changed on the coordinator (a learning-rate schedule) reach the ps tasks with the
  next scheduled calls.

Functions run on workers through :class:`~distrib.coordinator.ClusterCoordinator`.
Inside them ``strategy.run(fn, args)`` runs ``fn`` once (one replica per worker, as
TF's parameter-server tutorial on CPU) and ``strategy.reduce`` works on its result.
``run`` and ``reduce`` called on the coordinator itself work too, with TF's warning.

Metrics (``ds.metrics.*``, ``torchmetrics``) that scheduled functions update travel
to the workers as copies whose updates come back with each call's result (see
:class:`~distrib.coordinator.ClusterCoordinator`): after ``coordinator.join()``,
``metric.result()`` on the coordinator counts every completed call exactly once.

A ``torch.amp.GradScaler`` that scheduled functions use works as in plain PyTorch inside them
(``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``): each call runs
torch's own scaler on a copy of the coordinator's (a step with inf/NaN gradients is not pushed to
the ps tasks), and the outcome of each ``update()`` comes back with the result and is replayed on
the coordinator's scaler, the one scale every later call starts from. Steps in flight keep the
scale they were sent with, as training is asynchronous (see :mod:`distrib.parameter_server.scaler`).

Example::

    >>> import distrib as ds, torch
    >>> resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    >>> strategy = ds.ParameterServerStrategy(resolver)
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(2, 1)
    ...     optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    >>> coordinator = ds.coordinator.ClusterCoordinator(strategy)
    >>> def step(x, y):
    ...     loss = torch.nn.functional.mse_loss(model(x), y)
    ...     loss.backward()
    ...     optimizer.step()
    ...     return loss
    >>> losses = [coordinator.schedule(step, args=(torch.ones(4, 2), torch.zeros(4, 1))) for _ in range(5)]
    >>> coordinator.join()
    >>> len(coordinator.fetch(losses))
    5
    >>> with strategy.scope():
    ...     steps = ds.metrics.Sum()
    >>> def count(x):
    ...     steps.update_state(x)
    >>> for _ in range(3):
    ...     _ = coordinator.schedule(count, args=(torch.tensor(2.0),))
    >>> coordinator.join()
    >>> float(steps.result())
    6.0
    >>> ds.testing.stop_in_process_cluster(resolver)
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler

from distrib import context
from distrib.cluster import ClusterSpec
from distrib.input import InputContext
from distrib.integrations import keras_models
from distrib.parameter_server.captured_metrics import CapturedMetrics, MetricCopy, is_metric
from distrib.parameter_server.cluster_checks import check_cluster
from distrib.parameter_server.coordinator_optimizers import CoordinatorOptimizers
from distrib.parameter_server.datasets import DatasetSource
from distrib.parameter_server.scaler import Acknowledgements, ScalerAuthority
from distrib.parameter_server.transport import rpc
from distrib.parameter_server.transport.rpc import TLSConfig
from distrib.parameter_server.variables import LocalVariable, ParameterClient, Placer
from distrib.parameter_server.worker_strategy import ParameterServerWorkerStrategy
from distrib.strategies.base import Strategy
from distrib.strategies.replica import InPlaceMerger, ReplicaContext, run_in_place
from distrib.strategies.run_options import RunOptions
from distrib.torch_patches import scaler_device

if TYPE_CHECKING:
    from distrib.strategies.execution import StepExecutor

__all__ = ["ParameterServerStrategy", "DatasetSource"]

log = logging.getLogger("distrib.parameter_server")


class _Hook:
    """A module hook of the coordinator; on a worker (after pickling) it does nothing."""

    def __init__(self, strategy: ParameterServerStrategy | None, kind: str) -> None:
        self.strategy = strategy
        self.kind = kind

    def __call__(self, module: nn.Module, *args: Any) -> None:
        if self.strategy is not None:
            self.strategy._module_hook(self.kind, module)

    def __reduce__(self) -> tuple:
        return (_Hook, (None, self.kind))


class ParameterServerStrategy(Strategy):
    """Asynchronous training against parameter servers (``tf.distribute.experimental.ParameterServerStrategy``).

    ``cluster_resolver`` must describe ``ps`` and ``worker`` tasks (and normally a
    ``chief``: this process). ``variable_partitioner`` is a callable
    ``(shape, dtype) -> [shards, 1, ...]`` such as :class:`~distrib.partitioners.MinSizePartitioner`.
    ``token``/``tls`` default to ``DISTRIB_CLUSTER_TOKEN`` and ``DISTRIB_TLS_*``.
    ``connect_timeout`` bounds the wait for the ps tasks when the first module is placed.
    See the module docstring for a runnable example.

    Args:
        cluster_resolver: the cluster (any object with ``cluster_spec()``, normally a
            ``ds.cluster_resolver`` resolver): at least one ``ps`` and one ``worker`` task, at most one
            ``chief``.
        variable_partitioner: ``(shape, dtype) -> [shards, 1, ...]``, how many shards each parameter is
            split into along its first dimension (``ds.partitioners``); None: one shard per parameter.
        token: the cluster token every RPC carries; None: ``DISTRIB_CLUSTER_TOKEN``.
        tls: certificates for the RPCs; None: from ``DISTRIB_TLS_*`` (none set: plain TCP).
        connect_timeout: seconds to wait for the ps tasks when the first module is placed.

    Raises:
        ValueError: no cluster resolver, or a cluster that is not a parameter-server cluster (an unknown
            job, two chiefs, no worker or no ps), or this task's type is not one of its jobs.
    """

    should_use_with_coordinator = True

    def __init__(
        self,
        cluster_resolver: Any,
        variable_partitioner: Callable[..., Sequence[int]] | None = None,
        *,
        token: str | None = None,
        tls: TLSConfig | None = None,
        connect_timeout: float = 60.0,
    ) -> None:
        if cluster_resolver is None or not hasattr(cluster_resolver, "cluster_spec"):
            raise ValueError(
                "ParameterServerStrategy(cluster_resolver) needs a cluster resolver, e.g. "
                "ds.cluster_resolver.TFConfigClusterResolver() or ds.testing.create_in_process_cluster(2, 1)"
            )
        spec = cluster_resolver.cluster_spec()
        check_cluster(spec, getattr(cluster_resolver, "task_type", None))
        super().__init__(
            [None], cluster_resolver=cluster_resolver, device_names=["/job:chief/replica:0/task:0/device:CPU:0"]
        )
        self._spec = spec
        self._replica = ReplicaContext(self, 0, InPlaceMerger())
        self._token = rpc.cluster_token(token)
        self._tls = tls if tls is not None else TLSConfig.from_env()
        self._ps = ParameterClient(spec.job_tasks("ps"), self._token, self._tls)
        self._connect_timeout = connect_timeout
        self._connected = False
        self._session = uuid.uuid4().hex[:12]
        self._placer = Placer(spec.num_tasks("ps"), variable_partitioner, self._session, self._ps.budget)
        self._metrics = CapturedMetrics(f"{self._session}/m")  # metrics sent to the workers in scheduled functions
        self._scalers = ScalerAuthority(self._session)  # GradScalers sent to the workers: the one scale of each
        self._variables: dict[int, LocalVariable] = {}
        self._optimizers = CoordinatorOptimizers(self._session, self._ps, self._variables)
        #: the ClusterCoordinator made for this strategy (there is at most one), or None
        self.cluster_coordinator: Any = None
        log.info("ParameterServerStrategy is initialized with cluster_spec: %s", spec)

    @staticmethod
    def for_worker(cluster_spec: ClusterSpec, worker_index: int) -> ParameterServerWorkerStrategy:
        """The strategy object a scheduled function sees on worker ``worker_index`` (its own class).

        Args:
            cluster_spec: the cluster.
            worker_index: the index of the worker task.

        Returns:
            A ``ParameterServerWorkerStrategy`` (``isinstance(s, ParameterServerStrategy)`` holds for it).
        """
        return ParameterServerWorkerStrategy(cluster_spec, worker_index)

    @property
    def is_chief(self) -> bool:
        """True: the coordinator alone writes checkpoints."""
        return True

    @property
    def on_coordinator(self) -> bool:
        """True: this is the coordinator's strategy (the one a scheduled function sees on a worker says False)."""
        return True

    @property
    def cluster_spec(self) -> ClusterSpec:
        """The cluster: its ``ps``, ``worker`` and ``chief`` tasks."""
        return self._spec

    @property
    def cluster_token(self) -> str:
        """The secret every call to a task of this cluster carries."""
        return self._token

    @property
    def tls(self) -> TLSConfig | None:
        """The TLS certificates for calls to the cluster's tasks, if any."""
        return self._tls

    @property
    def graph_capture_blocker(self) -> str | None:
        """Scheduled steps pull and push parameters over RPC, on the host: ``ds.function`` runs them eagerly."""
        return (
            "ParameterServerStrategy's steps pull parameters from and push gradients to the ps tasks over "
            "RPC, on the host, which a CUDA graph cannot hold"
        )

    def step_executor(self) -> StepExecutor:
        """Steps of ``fit``/``evaluate``/``predict`` are scheduled on the workers through the ClusterCoordinator.

        Returns:
            A ``ScheduledExecutor`` over a new ``ClusterCoordinator`` of this strategy.
        """
        from distrib.parameter_server.client.coordinator import ClusterCoordinator
        from distrib.parameter_server.client.step_executor import ScheduledExecutor

        return ScheduledExecutor(self, ClusterCoordinator(self))

    @property
    def _num_ps(self) -> int:
        return self._spec.num_tasks("ps")

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(ps={self._num_ps}, workers={self._spec.num_tasks('worker')}, on coordinator)"

    def __deepcopy__(self, memo: dict) -> ParameterServerStrategy:
        return self  # a copied module (``copy.deepcopy(model)``) still names its strategy

    def __reduce__(self) -> tuple:
        raise TypeError(
            "a ParameterServerStrategy can only be sent inside a function scheduled with "
            "ClusterCoordinator.schedule (where it becomes the worker's strategy)"
        )

    def _ensure_connected(self) -> None:
        if not self._connected:
            self._ps.wait_ready(self._connect_timeout)
            self._connected = True

    # ------------------------------------------------------------------ modules
    def distribute_module(self, module: nn.Module) -> None:
        """Place every parameter of ``module`` on the ps tasks (sharded as the partitioner says).

        Args:
            module: a module built under ``strategy.scope()``.

        Raises:
            ValueError: a submodule of ``module`` belongs to another strategy.
        """
        if context.owner_of(module) is self:
            return
        if keras_models.is_keras_layer(module):
            raise NotImplementedError(
                f"Keras model {keras_models.describe(module)}: ParameterServerStrategy does not support Keras models "
                "yet (their variables would have to live on the ps tasks); build the model with torch.nn, or train "
                "the Keras model under MultiWorkerMirroredStrategy"
            )
        for sub in module.modules():
            owner = context.owner_of(sub)
            if owner is not None and owner is not self:
                raise ValueError(
                    f"module {type(module).__name__} contains {type(sub).__name__}, which another "
                    "strategy distributes; build the whole model inside one strategy.scope()"
                )
        self._ensure_connected()
        new: list[LocalVariable] = []
        for name, p in module.named_parameters():
            if id(p) not in self._variables:
                new.append(LocalVariable(self._placer.place(f"{type(module).__name__}.{name}", p), p))
        self._ps.create([(v.spec, v.tensor.detach()) for v in new])
        for v in new:
            v.versions = [1] * len(v.spec.shards)  # the ps tasks now hold exactly this value, at version 1
            self._variables[id(v.tensor)] = v
        for sub in module.modules():
            if context.owner_of(sub) is self:
                continue  # placed by an earlier scope block, hooks already there
            context.set_owner(sub, self)
            if any(id(p) in self._variables for p in sub.parameters(recurse=False)):
                sub.register_state_dict_pre_hook(_Hook(self, "read"))
                sub.register_load_state_dict_post_hook(_Hook(self, "write"))
        module.register_forward_pre_hook(_Hook(self, "forward"))
        log.debug(
            "placed %s on %d ps task(s): %s",
            type(module).__name__,
            self._num_ps,
            ", ".join(f"{v.spec.name}->{[s.ps for s in v.spec.shards]}" for v in new),
        )

    def _module_hook(self, kind: str, module: nn.Module) -> None:
        if kind == "forward":
            self._ps.pull(self._module_variables(module, recurse=True))
        elif kind == "read":
            self._ps.pull(self._module_variables(module, recurse=False))
        elif kind == "write":
            self._ps.assign([(v.spec, v.tensor.detach()) for v in self._module_variables(module, recurse=False)])

    def checkpoint_state(self, obj: Any) -> Any:
        """Whole tensors gathered from the ps tasks: a module's parameters, an optimizer's state.

        Args:
            obj: a module or an optimizer of this strategy.

        Returns:
            ``obj.state_dict()`` with its parameters freshly pulled from the ps tasks.
        """
        if isinstance(obj, nn.Module):
            self._ps.pull(self._module_variables(obj, recurse=True))  # one call per ps for the whole module
        return obj.state_dict()  # hooks keep it fresh; an optimizer's state_dict gathers its shards

    def restore_checkpoint_state(self, obj: Any, state: Any) -> None:
        """Whole tensors written back to the ps tasks, re-split for the current shards.

        Args:
            obj: a module or an optimizer of this strategy.
            state: what ``checkpoint_state(obj)`` returned, here or under another strategy.
        """
        obj.load_state_dict(state)  # the module's post-hook assigns; the optimizer's splits its state

    def _module_variables(self, module: nn.Module, recurse: bool) -> list[LocalVariable]:
        return [self._variables[id(p)] for p in module.parameters(recurse=recurse) if id(p) in self._variables]

    def variable_placement(self, module: nn.Module) -> dict[str, list[tuple[int, int, int]]]:
        """Where each parameter of ``module`` lives: name -> [(ps task, first row, end row), ...] per shard.

        Args:
            module: a module placed by this strategy.

        Returns:
            Parameter name -> one ``(ps task, first row, end row)`` per shard; parameters not placed are left out.
        """
        return {
            name: [(s.ps, s.start, s.stop) for s in self._variables[id(p)].spec.shards]
            for name, p in module.named_parameters()
            if id(p) in self._variables
        }

    def variable_shards(self, module: nn.Module) -> dict[str, list[torch.Tensor]]:
        """Each parameter's shards, read from the ps tasks that hold them (TF's ``ShardedVariable.variables``).

        Example (one shard per parameter without a partitioner)::

            >>> import distrib as ds, torch
            >>> resolver = ds.testing.create_in_process_cluster(num_workers=1, num_ps=2)
            >>> strategy = ds.ParameterServerStrategy(resolver, ds.partitioners.FixedShardsPartitioner(2))
            >>> with strategy.scope():
            ...     table = torch.nn.Embedding(5, 2)
            >>> [tuple(s.shape) for s in strategy.variable_shards(table)["weight"]]
            [(3, 2), (2, 2)]
            >>> ds.testing.stop_in_process_cluster(resolver)

        Args:
            module: a module placed by this strategy.

        Returns:
            Parameter name -> its shards' current values, in row order.
        """
        return {
            name: self._ps.read_shards(self._variables[id(p)].spec)
            for name, p in module.named_parameters()
            if id(p) in self._variables
        }

    # ------------------------------------------------------------------ optimizers
    def distribute_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` a twin beside every shard of its parameters, on the ps task holding it.

        Args:
            optimizer: an optimizer built under ``strategy.scope()`` over parameters of this strategy.

        Raises:
            ValueError: some of its parameters were not placed on the ps tasks.
        """
        context.set_owner(optimizer, self)
        self._optimizers.add(optimizer)

    def optimizer_options(self) -> dict[str, list[dict[str, Any]]]:
        """Every optimizer's current options per group, sent to the workers with each batch of calls.

        Returns:
            Optimizer id -> one dict of options (``lr``, ...) per parameter group.
        """
        return self._optimizers.options()

    # ------------------------------------------------------------------ metrics
    def merge_metric_deltas(self, deltas: dict[str, dict[str, Any]]) -> None:
        """Add what one completed scheduled call added to workers' copies of metrics into the metrics here.

        Args:
            deltas: metric id (given when the function was sent) -> its state on the worker after the call.
        """
        self._metrics.merge(deltas)

    # ------------------------------------------------------------------ GradScalers
    def scaler_snapshot(self, acks: Acknowledgements) -> dict[str, Any] | None:
        """The state of every GradScaler scheduled functions use, for a request to one worker (see
        :mod:`distrib.parameter_server.scaler`); ``acks``: that worker's outcomes replayed here.

        Args:
            acks: the outcomes of that worker already replayed here.

        Returns:
            The scalers' state to send, or None when no scheduled function uses a GradScaler.
        """
        return self._scalers.snapshot(acks)

    def merge_scaler_outcomes(self, info: Any, acks: Acknowledgements) -> None:
        """Replay on the coordinator's GradScalers the ``update()`` outcomes of one completed scheduled call.

        Args:
            info: the outcomes the worker reported with its result.
            acks: the outcomes of that worker already replayed here (updated).
        """
        self._scalers.merge(info, acks)

    # ------------------------------------------------------------------ pickling for workers
    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        """How ``obj`` travels inside a scheduled function (None: pickled as usual).

        Args:
            obj: an object being pickled with a scheduled function.

        Returns:
            A tag the worker rebuilds ``obj`` from (the strategy, a GradScaler, a metric, a placed parameter,
            an optimizer), or None to pickle ``obj`` as usual.
        """
        if obj is self:
            return ("strategy",)
        if isinstance(obj, GradScaler) and obj.is_enabled():
            return ("scaler", self._scalers.key(obj), scaler_device(obj))
        if is_metric(obj):
            return ("metric", self._metrics.key(obj), MetricCopy(obj))
        if isinstance(obj, torch.Tensor):
            var = self._variables.get(id(obj))
            return ("var", var.spec) if var is not None and var.tensor is obj else None
        return self._optimizers.travel_tag(obj)

    # ------------------------------------------------------------------ run, input
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Run ``fn`` once, here, on the coordinator, with TF's warning: inside a function scheduled with
        ``ClusterCoordinator.schedule`` (the normal use) ``strategy.run`` runs on the worker instead.

        Args:
            fn: the step function.
            args: positional arguments of ``fn``.
            kwargs: keyword arguments of ``fn``.
            options: ``RunOptions`` (accepted, as every strategy's ``run``).

        Returns:
            What ``fn`` returns.
        """
        self._warn_on_coordinator("run")
        return super().run(fn, args, kwargs, options)

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        """Run ``fn`` once, here, in the strategy's one replica context (what ``run`` calls).

        Args:
            fn: the step function.
            args: positional arguments of ``fn``.
            kwargs: keyword arguments of ``fn``.
            options: ``RunOptions`` (unused here).

        Returns:
            What ``fn`` returns.
        """
        return run_in_place(self._replica, fn, args, kwargs)

    def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any:
        """As every strategy's ``reduce`` (one replica per worker); on the coordinator it warns as TF does.

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (or their names).
            value: a tensor, or a nest of them.
            axis: also reduce along this dimension of each tensor; None: across replicas only.

        Returns:
            The reduced value.
        """
        self._warn_on_coordinator("reduce")
        return super().reduce(reduce_op, value, axis)

    @staticmethod
    def _warn_on_coordinator(method: str) -> None:
        log.warning(
            f"A `ParameterServerStrategy` method ({method}) is invoked without using "
            "`ClusterCoordinator.schedule`: it runs here, on the coordinator, which can be slow. To "
            "dispatch functions to the workers, call `run` or `reduce` within a function passed to "
            "`ds.coordinator.ClusterCoordinator.schedule`."
        )

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> DatasetSource:
        """A dataset to give to ``coordinator.create_per_worker_dataset`` (each worker iterates all of it).

        Args:
            dataset: any iterable of batches.
            options: accepted for TF's signature, ignored.

        Returns:
            A ``DatasetSource`` holding ``dataset``.
        """
        return DatasetSource(dataset=dataset)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: Any = None
    ) -> DatasetSource:
        """``dataset_fn(input_context)`` is called on every worker by ``coordinator.create_per_worker_dataset``.

        Args:
            dataset_fn: ``input_context -> iterable``, called once on each worker.
            options: accepted for TF's signature, ignored.

        Returns:
            A ``DatasetSource`` holding ``dataset_fn``.
        """
        return DatasetSource(dataset_fn=dataset_fn)


# a worker's strategy answers isinstance(strategy, ParameterServerStrategy), as TF's does
ParameterServerStrategy.register(ParameterServerWorkerStrategy)
