"""``ShardedStrategy``: data parallelism with parameters, gradients and optimizer state sharded (FSDP2).

Every other strategy keeps a whole copy of the training state on every worker: for float32 Adam,
16 bytes per parameter per worker. Here each of N workers keeps 1/N of it: modules built in the
scope are sharded with torch's ``fully_shard`` when they are complete (one unit per block the
:class:`~distrib.strategies.sharding_policy.ShardingPolicy` chooses, then the root), so a
parameter is a ``DTensor`` holding this worker's rows; each unit's whole parameters exist only
while its forward or backward runs (ZeRO-3; ``reshard_after_forward=False`` keeps them from
forward to backward: ZeRO-2-like, more memory, fewer all-gathers). Gradients are reduce-scattered
(summed) during the backward pass, so ``optimizer.step()`` updates each worker's shard alone.

The user's loop does not change: ``strategy.run(step)`` with ``ds.compute_average_loss``,
``loss.backward(); optimizer.step()``, the same input distribution as ``MultiWorkerMirroredStrategy``
(one replica per worker process), the same clusters (``TF_CONFIG``, torchrun, Slurm, ``distrib
launch``, a pre-initialised group). Build order does not matter within the scope: an optimizer
built over a model's parameters before the model was sharded is moved onto the sharded ones.
``ds.Checkpoint`` (and the managers and callbacks on it) has every worker write its own shards into
one directory, ``<prefix>.dcp`` (``torch.distributed.checkpoint`` with distrib's manifest: atomic,
checksummed, never unpickling), with no gather; it loads with any number of workers, under every
other strategy and in plain PyTorch, and a checkpoint of any strategy loads here
(``checkpoint_format="plain"``: one file of whole tensors instead, as the other strategies write).

With one worker nothing is sharded (the model trains as under ``OneDeviceStrategy``).

Example (run it with ``distrib launch --workers 2 script.py``)::

    strategy = ds.ShardedStrategy()
    with strategy.scope():
        model = build_model()
        optimizer = torch.optim.Adam(model.parameters())
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from distrib import context
from distrib.cluster.resolver import ClusterResolver
from distrib.comm import CommunicationOptions
from distrib.integrations import keras_models
from distrib.strategies import allocator
from distrib.strategies.base import Strategy
from distrib.strategies.deferred_materialise import plan_materialisation
from distrib.strategies.deferred_record import BuildRecorder, pause_recording
from distrib.strategies.extended import GradientMerge
from distrib.strategies.patch_lease import lease_torch_patches
from distrib.strategies.replica import InPlaceMerger, ReplicaContext, run_in_place
from distrib.strategies.replication import optimizer_params
from distrib.strategies.run_options import RunOptions, UnscaledLossCheck
from distrib.strategies.sharding_policy import ShardingPolicy
from distrib.strategies.workers import join_workers, take_chiefs_values

if TYPE_CHECKING:
    from types import ModuleType

    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    from distrib.input import DistributedDataset, DistributedDatasetsFromFunction
    from distrib.strategies.execution import StepExecutor

__all__ = ["ShardedStrategy"]

log = logging.getLogger("distrib.strategies")

T = TypeVar("T")
_PARAM_DTYPES = {None: None, "32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _fsdp() -> ModuleType:
    """torch's FSDP2 (strategies/fsdp.py), imported when a sharded strategy first needs it, not at ``import distrib``."""
    from distrib.strategies import fsdp

    return fsdp


class ShardedStrategy(Strategy):
    """Sharded data parallelism over worker processes, on torch's FSDP2 (see the module docstring).

    ``sharding_policy``: which blocks become units (default: by size, 100,000 parameters);
    ``reshard_after_forward``: True (ZeRO-3, the default) or False (ZeRO-2-like);
    ``mixed_precision``: ``"bf16-mixed"`` or ``"16-mixed"`` gathers parameters in that dtype for
    compute and reduces gradients in float32 (FSDP's ``MixedPrecisionPolicy``); the shards and the
    optimizer stay float32. None (the default) or ``"32"`` computes in float32. ``checkpoint_format``: ``"sharded"`` or ``"plain"`` (see :attr:`checkpoint_format`).
    ``deferred_init``: True (the default) builds modules in the scope without their data and initialises
    them shard by shard, never whole (the same values as a plain build with the same seed); False builds
    them whole on every worker and shards them when the scope closes.
    ``cluster_resolver``, ``communication_options`` and ``devices`` are ``MultiWorkerMirroredStrategy``'s
    (one device per process).

    Args:
        cluster_resolver: the cluster; None: from the environment (``TF_CONFIG``, torchrun, Slurm), else one worker.
        communication_options: the collectives' options (timeout, bucket size, backend).
        devices: this process's one device (``["cuda:0"]``, ``["cpu"]``); None: its GPU, else the CPU.
        sharding_policy: which blocks become units; None: ``ShardingPolicy()`` (by size).
        reshard_after_forward: free the gathered parameters after the forward pass (ZeRO-3); False keeps
            them until backward (ZeRO-2-like: more memory, one gather less).
        mixed_precision: ``"bf16-mixed"``, ``"16-mixed"``, ``"32"`` or None.
        checkpoint_format: ``"sharded"`` or ``"plain"``.
        deferred_init: build modules in the scope without data and initialise them shard by shard.

    Raises:
        ValueError: ``checkpoint_format`` or ``mixed_precision`` is not one of the values above, more than one
            device per process, or CUDA devices whose workers fell back to gloo.

    Examples:
        On each worker process (``distrib launch``, or torchrun), as under any strategy:

        ```python
        strategy = ds.ShardedStrategy()
        with strategy.scope():
            model = make_model()  # built shard by shard: never whole on one worker
            optimizer = torch.optim.AdamW(model.parameters())
        for batch in strategy.experimental_distribute_dataset(loader):
            strategy.run(train_step, args=(batch,))
        ```
    """

    #: whether the parameters are sharded over the workers by FSDP2 (whose freed buffers the allocator advice is for)
    shards_parameters: bool = True

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str] | None = None,
        *,
        sharding_policy: ShardingPolicy | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: str | None = None,
        checkpoint_format: str = "sharded",
        deferred_init: bool = True,
    ) -> None:
        if checkpoint_format not in ("sharded", "plain"):
            raise ValueError(
                f"ShardedStrategy(checkpoint_format={checkpoint_format!r}): give 'sharded' (every worker "
                "writes its own shards) or 'plain' (one file of whole tensors, gathered)"
            )
        if mixed_precision not in _PARAM_DTYPES:
            accepted = ", ".join(repr(name) for name in _PARAM_DTYPES)
            raise ValueError(
                f"ShardedStrategy(mixed_precision={mixed_precision!r}): give one of {accepted} "
                "(Lightning's names; None and '32' keep float32)"
            )
        workers = join_workers(cluster_resolver, communication_options or CommunicationOptions(), devices)
        if len(workers.devices) != 1:
            raise ValueError(
                f"ShardedStrategy runs one replica per worker process, but devices={workers.device_names}"
                "; start one process per device (distrib launch, torchrun) and give each one device"
            )
        if workers.devices[0].type == "cuda" and workers.communicator.backend == "gloo":
            raise ValueError(
                f"ShardedStrategy on {workers.device_names[0]} needs NCCL, but the workers fell back to "
                "gloo (several processes share one GPU, or NCCL is missing): gloo cannot reduce-scatter "
                "CUDA tensors. Give each worker its own GPU, or train on the CPU with devices=['cpu']"
            )
        super().__init__(workers.devices, workers.communicator, workers.resolver, device_names=workers.device_names)
        self._policy = sharding_policy or ShardingPolicy()
        self._reshard_after_forward = reshard_after_forward
        self._checkpoint_format = checkpoint_format
        self._param_dtype = _PARAM_DTYPES[mixed_precision]
        #: with several workers, the scope records the build and distribute_module initialises shard by shard
        #: (strategies/deferred_record.py); ``deferred_init=False`` builds whole and shards when the scope closes
        self.build_recorder = BuildRecorder() if deferred_init and self.num_workers > 1 else None
        self._replica = ReplicaContext(self, 0, InPlaceMerger())
        self._mesh: Any = None
        # a parameter replaced by its shard -> (the old parameter, its module, its name): moves optimizers built
        # over the old ones onto the shards
        self._moved: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[nn.Module], str]] = {}
        self._unscaled_loss = UnscaledLossCheck()
        self._gradients = _ShardedGradients(self)
        if self.num_workers > 1:  # a GradScaler's decision must be every worker's: amp.py's merge, leased
            lease_torch_patches(self)  # given back when the strategy is collected (weakref.finalize keeps itself)
        log.info(
            "ShardedStrategy: worker %d of %d, device %s, %s",
            self.worker_index,
            self.num_workers,
            workers.device_names[0],
            "ZeRO-3" if reshard_after_forward else "ZeRO-2",
        )
        if self.shards_parameters:
            allocator.warn_if_untuned(workers.devices[0].type, self.num_workers, self.is_chief, type(self).__name__)

    @property
    def gradient_merge(self) -> GradientMerge | None:
        """With several workers: FSDP sums gradients in backward; a ``GradScaler``'s inf check is agreed over the
        workers (strategies/amp.py) so every shard's inf or NaN skips the step everywhere. None with one."""
        return self._gradients if self.num_workers > 1 else None

    @property
    def graph_capture_blocker(self) -> str | None:
        """With several workers FSDP2 gathers and frees parameters between its hooks, deciding on the host, and
        its process group may be gloo: ``ds.function`` runs such a step eagerly. With one worker nothing is
        sharded and the step is captured as under ``OneDeviceStrategy``."""
        if self._lays_out_model:
            return (
                "ShardedStrategy's FSDP2 all-gathers and frees the parameters around every unit from Python "
                "hooks on the host, which a CUDA graph does not replay"
            )
        return super().graph_capture_blocker

    @property
    def _lays_out_model(self) -> bool:
        """Whether ``distribute_module`` applies torch's parallelism (FSDP2) to a model: with several workers.
        ``MeshStrategy`` also does on one worker given a mesh."""
        return self.num_workers > 1

    @property
    def sharding_policy(self) -> ShardingPolicy:
        """Which blocks become units."""
        return self._policy

    # ------------------------------------------------------------------ modules and optimizers
    def distribute_module(self, module: nn.Module) -> None:
        """Place ``module`` on this worker's device and shard it (with several workers).

        A module built under deferred initialisation holds no data yet: it is sharded on the meta device,
        allocated (``to_empty``), and each parameter's rows are filled from the recorded build, one tensor
        at a time (strategies/deferred_record.py); the workers then agree on the chief's values.

        Args:
            module: a root module built under ``strategy.scope()``.

        Raises:
            ValueError: a submodule of ``module`` belongs to another strategy or another scope block.
        """
        owner = context.owner_of(module)
        if owner is self:
            return
        if type(self) is ShardedStrategy and self._lays_out_model and keras_models.is_keras_layer(module):
            raise NotImplementedError(
                f"Keras model {keras_models.describe(module)}: ShardedStrategy with several workers does not support "
                "Keras models yet (FSDP would replace the parameters Keras' variables hold); use "
                "MultiWorkerMirroredStrategy, or ds.experimental.keras_distribution(keras.distribution.DataParallel"
                "(...)) for Keras' own names"
            )
        for sub in module.modules():
            if context.owner_of(sub) is not None:
                raise ValueError(
                    f"module {type(module).__name__} contains {type(sub).__name__}, which another "
                    "strategy or scope block distributes; build the whole model inside one scope block"
                )
        device = self.local_devices[0]
        if not self._lays_out_model:  # one worker: nothing to shard
            if device is not None:
                module.to(device)
        else:
            with pause_recording(self):
                self._shard(module, device)
        for sub in module.modules():
            context.set_owner(sub, self)

    def _shard(self, module: nn.Module, device: torch.device | None) -> None:
        """Every worker's values agree (the chief's), then ``fully_shard`` per unit and the root; a module built
        under deferred initialisation is sharded on the meta device, then filled tensor by tensor."""
        plan = plan_materialisation(module)
        if plan is None:
            if device is not None:
                module.to(device)
            take_chiefs_values(self.communicator, module)  # each worker keeps its rows of the chief's values
        else:
            self.communicator.verify_same(plan.signature(), f"the {type(module).__name__} built in strategy.scope()")
            plan.take_chiefs_real_values(self.communicator, device)
        # weakly: a strong list would keep every unit's whole parameters alive until the last unit is sharded
        before = [(name, weakref.ref(p), id(p)) for name, p in module.named_parameters()]
        if plan is not None:
            plan.to_meta()
        units = self._parallelise(module, device)
        if plan is not None:
            self.communicator.guarded(
                "initialising the sharded model", lambda: plan.materialise(device, self.communicator)
            )
        for name, old, key in before:
            if old() is not None:  # an optimizer holds it: it may be built over it before the scope closed
                self._moved[key] = (old, weakref.ref(module), name)
        log.info(
            "sharded %s over %d workers: %d unit(s) + the root%s",
            type(module).__name__,
            self.num_workers,
            len(units),
            ", initialised shard by shard" if plan is not None else "",
        )

    def _parallelise(self, module: nn.Module, device: torch.device | None) -> list[nn.Module]:
        """``fully_shard`` per unit and the root, over every worker (on the meta device under deferred init);
        the units. ``MeshStrategy`` applies its layouts here too."""
        if self._mesh is None:
            self._mesh = _fsdp().world_mesh(device.type if device is not None else "cpu")
        units = self._policy.units(module)
        self._shard_units(module, units, self._mesh, "sharding the model")
        return units

    def _shard_units(self, module: nn.Module, units: list[nn.Module], mesh: TorchDeviceMesh, what: str) -> None:
        """``fully_shard`` each unit, then ``module`` (the root), over ``mesh`` with this strategy's resharding and
        mixed precision (torch's mesh of the sharding axes); a failure of FSDP's collectives is a CollectiveError
        naming ``what``. One call for both strategies: ``MeshStrategy`` shards over its data axes only."""
        self.communicator.guarded(
            what,
            lambda: _fsdp().shard_module(
                module, units, mesh, self._reshard_after_forward, _fsdp().mixed_precision_policy(self._param_dtype)
            ),
        )

    def distribute_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` update the shards: parameters it took before sharding are replaced by theirs.

        Args:
            optimizer: an optimizer built under ``strategy.scope()``.

        Raises:
            ValueError: some of its parameters are not sharded (a module built outside the scope).
        """
        context.set_owner(optimizer, self)
        for group in optimizer.param_groups:
            group["params"] = [self._shard_of(p) for p in group["params"]]
        foreign = [
            p
            for p in optimizer_params(optimizer)
            if context.owner_of(p) is None and self.num_workers > 1 and not self._distributes(p)
        ]
        if foreign:
            raise ValueError(
                f"{type(optimizer).__name__} was created under ShardedStrategy.scope() over {len(foreign)} "
                "parameter(s) that are not sharded (a module built outside the scope); build the model inside the "
                "same strategy.scope() as the optimizer"
            )
        optimizer.register_step_pre_hook(self._check_loss_scaled)
        self._gradients.merge_steps_of(optimizer)

    def _distributes(self, param: Any) -> bool:
        """Whether ``param`` is one of the models' this strategy distributed (a shard)."""
        return bool(_fsdp().is_sharded(param))

    def _shard_of(self, param: Any) -> Any:
        entry = self._moved.get(id(param))
        if entry is None or entry[0]() is not param:
            return param
        module = entry[1]()
        return module.get_parameter(entry[2]) if module is not None else param

    def _check_loss_scaled(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        ctx = context.current_replica()
        if ctx is not None and ctx.strategy is self:
            self.warn_if_loss_unscaled([ctx.scaled_loss_recorded])

    def warn_if_loss_unscaled(self, scaled: Sequence[bool]) -> None:
        """Warn once (``ds.UnscaledLossWarning``) when several workers step on a loss not scaled by the global batch.

        Args:
            scaled: per replica, whether its step's loss went through ``ds.compute_average_loss``.
        """
        self._unscaled_loss.warn_if_unscaled(scaled, self.num_replicas_in_sync, stacklevel=4)

    # ------------------------------------------------------------------ run, input, fit
    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        """``fn`` once, in place (one replica per worker); FSDP's collectives inside it fail as CollectiveError.

        Args:
            fn: the step function.
            args: positional arguments of ``fn``.
            kwargs: keyword arguments of ``fn``.
            options: ``RunOptions``.

        Returns:
            What ``fn`` returns.
        """
        self._unscaled_loss.options = options
        return self.communicator.guarded(
            "a sharded step (FSDP's all-gather / reduce-scatter)", lambda: run_in_place(self._replica, fn, args, kwargs)
        )

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> DistributedDataset:
        """As ``MultiWorkerMirroredStrategy``: each global batch split over the workers.

        Args:
            dataset: an iterable of global batches.
            options: ``ds.InputOptions``, or None.

        Returns:
            A distributed dataset whose batches are this worker's share of each global batch.
        """
        from distrib.input import DistributedDataset

        return DistributedDataset(dataset, self, options=options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None
    ) -> DistributedDatasetsFromFunction:
        """As ``MultiWorkerMirroredStrategy``: ``dataset_fn(input_context)`` once per worker.

        Args:
            dataset_fn: ``input_context -> iterable`` of this worker's batches.
            options: ``ds.InputOptions``, or None.

        Returns:
            A distributed dataset over what ``dataset_fn`` returns.
        """
        from distrib.input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self, options=options)

    def step_executor(self) -> StepExecutor:
        """``fit`` runs ``strategy.run`` on each global batch, as under the synchronous strategies.

        Returns:
            The synchronous step executor.
        """
        from distrib.strategies.execution import SynchronousExecutor

        return SynchronousExecutor(self)

    # ------------------------------------------------------------------ checkpoint contract
    @property
    def checkpoint_format(self) -> str:
        """``"sharded"`` (the default, with several workers): ``ds.Checkpoint`` has every worker write its own
        shards into one directory (torch.distributed.checkpoint), never gathering the model; ``"plain"``: one
        file of whole tensors, gathered on every worker and written by the chief. One worker: ``"plain"``."""
        return self._checkpoint_format if self.num_workers > 1 else "plain"

    def local_checkpoint_state(self, obj: Any) -> Any:
        """``obj.state_dict()`` as it is here: parameters and optimizer state are this worker's ``DTensor`` shards.

        Args:
            obj: a module or optimizer of this strategy (or any object with ``state_dict``).

        Returns:
            ``obj.state_dict()``, with ``DTensor`` shards.
        """
        return obj.state_dict()

    def checkpoint_state(self, obj: Any) -> Any:
        """Torch's plain ``state_dict()`` of ``obj``, every shard gathered (on every worker: a collective).

        Args:
            obj: a module or optimizer of this strategy (or any object with ``state_dict``).

        Returns:
            ``obj``'s state dict with whole tensors.
        """
        return self.communicator.guarded(
            "gathering the shards for a checkpoint", lambda: _fsdp().full_state(obj.state_dict())
        )

    def restore_checkpoint_state(self, obj: Any, state: Any) -> None:
        """Load a plain state (of any strategy, any number of workers) into ``obj``, split into this worker's shards.

        Args:
            obj: a module or optimizer of this strategy.
            state: a plain state dict (whole tensors).
        """
        if isinstance(obj, torch.optim.Optimizer):
            params = optimizer_params(obj)
            like = {
                i: {k: p for k in saved}
                for i, p in enumerate(params)
                for saved in [state.get("state", {}).get(i, state.get("state", {}).get(str(i), {}))]
            }
            state = {
                **state,
                "state": {k: _fsdp().shard_state(v, like.get(int(k), {})) for k, v in state.get("state", {}).items()},
            }
            obj.load_state_dict(state)
            return
        if isinstance(obj, nn.Module):
            state = _fsdp().shard_state(state, obj.state_dict())
        obj.load_state_dict(state)


class _ShardedGradients:
    """The sharded strategy's :class:`~distrib.strategies.extended.GradientMerge`: FSDP has summed each shard's
    gradient over the workers by the end of backward, so nothing is left to reduce; what amp.py adds is the
    agreement on a GradScaler's inf check (one all-reduced flag), so a step is applied or skipped everywhere."""

    def __init__(self, strategy: ShardedStrategy) -> None:
        self._strategy = weakref.ref(strategy)
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def merge_steps_of(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)

    def merges_optimizer_steps(self, optimizer: Any) -> bool:
        return optimizer in self._optimizers

    def reduce_gradients_then(self, optimizer: torch.optim.Optimizer, then: Callable[[], T]) -> T:
        return then()  # already summed, shard by shard, in backward

    def end_gradient_reduction(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def warn_if_loss_unscaled(self, scaled: Sequence[bool]) -> None:
        strategy = self._strategy()
        if strategy is not None:
            strategy.warn_if_loss_unscaled(scaled)
