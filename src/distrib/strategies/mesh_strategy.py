"""``ds.experimental.MeshStrategy``: data and tensor parallelism over a named mesh of workers.

``ShardedStrategy`` parallelises over one axis, the data. Here the workers form a
:class:`~distrib.strategies.mesh.DeviceMesh` (Keras 3's ``DeviceMesh(shape, axis_names)``) and
each axis has a role:

* ``"batch"`` (``batch_dim_name``): the global batch is split over it and the parameters are sharded
  over it, torch's FSDP2 (``fully_shard(mesh=mesh["batch"])``);
* ``"replicate"`` (optional, before ``"batch"``): the batch is split over it too, the parameters are
  replicated over it: hybrid sharding, torch's HSDP (``fully_shard(mesh=mesh["replicate", "batch"])``:
  reduce-scatter within a group, all-reduce across groups). ``DeviceMesh.hybrid()`` shards within
  each host and replicates across hosts;
* a model axis (any other name, last): tensor parallelism, as the
  :class:`~distrib.strategies.mesh.LayoutMap` says (torch's ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``; see
  :mod:`~distrib.strategies.tensor_parallel`).

They are applied in torchtitan's order, tensor parallelism first, then FSDP over the data axes
(``fully_shard`` of a tensor-parallel parameter shards its own shard again: a 2-D ``DTensor``).
Under deferred initialisation (the default) every step of that runs on the meta device and each
worker then fills its own part of each parameter from the recorded build: the model is never whole
in one process, whatever the mesh.

The user's loop does not change (``scope``, ``run``, ``ds.compute_average_loss``, the input, ``ds.fit``,
checkpoints, the preemption handler, the launchers). A replica is a point of the data axes: the
workers of one tensor-parallel group are one replica, read the same part of each global batch and
compute the same loss, so ``num_replicas_in_sync`` is the data axes' size, ``compute_average_loss``
divides by the global batch as before, and ``strategy.reduce`` counts each group once.

Random numbers follow the replicas (:mod:`~distrib.strategies.group_random`): with a model axis of two
workers or more, every ``strategy.run`` (so ``ds.fit`` too) draws from its tensor-parallel group's stream,
the same on each worker of the group and different across the data-parallel replicas, whatever seed each
process set; a sharded ``DataLoader`` seeds its worker processes (and runs its main-process transforms)
from a second such stream. Both are seeded from the chief's ``torch.initial_seed()`` at their first use.

Example (run it with ``distrib launch --workers 4 script.py``)::

    mesh = ds.experimental.DeviceMesh((2, 2), ("batch", "model"))
    layout_map = ds.experimental.LayoutMap(mesh)
    layout_map[r"mlp\\.up\\.weight"] = ("model", None)     # torch's ColwiseParallel
    layout_map[r"mlp\\.down\\.weight"] = (None, "model")   # torch's RowwiseParallel
    strategy = ds.experimental.MeshStrategy(layout_map=layout_map)
    with strategy.scope():
        model = build_model()
        optimizer = torch.optim.Adam(model.parameters())
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distrib.comm.process_group import one_rank_group
from distrib.strategies import tensor_parallel
from distrib.strategies.group_random import GroupRandomStream
from distrib.strategies.mesh import BATCH, DeviceMesh, LayoutMap
from distrib.strategies.sharded import ShardedStrategy, _fsdp

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver
    from distrib.comm import CommunicationOptions
    from distrib.input import DistributedDataset
    from distrib.strategies.run_options import RunOptions
    from distrib.strategies.sharding_policy import ShardingPolicy

__all__ = ["MeshStrategy"]

log = logging.getLogger("distrib.strategies")


class MeshStrategy(ShardedStrategy):
    """Data parallelism (sharded, or hybrid) and tensor parallelism over a mesh of workers (module docstring).

    One worker process per point of the mesh (``distrib launch --workers N``, torchrun), one device each.
    One worker given a ``mesh`` or a ``layout_map`` (every axis of size 1) lays the model out all the same,
    over a process group of its own rank: the parameters are ``DTensor`` s, the layout map is checked and
    applied, torch's FSDP2 hooks run, so a mesh program runs on one device the code of N workers (and
    ``ds.function`` runs its steps eagerly). Without either, one worker trains as one device.
    The keyword arguments after ``layout_map`` are ``ShardedStrategy``'s; its sharding policy, ZeRO stage
    and mixed precision apply over the data axes.

    Args:
        mesh: a :class:`DeviceMesh` of the workers; None: the layout map's, else every worker on one
            ``"batch"`` axis (which is ``ShardedStrategy``).
        layout_map: a :class:`LayoutMap` on the mesh's model axis; None: no tensor parallelism.
        cluster_resolver: the cluster; None: from the environment (``TF_CONFIG``, torchrun, Slurm), else one
            worker.
        communication_options: the collectives' options (timeout, bucket size, backend).
        devices: this process's one device (``["cuda:0"]``, ``["cpu"]``); None: its GPU, else the CPU.
        sharding_policy: which blocks become FSDP units over the data axes; None: ``ShardingPolicy()``.
        reshard_after_forward: free the gathered parameters after the forward pass (ZeRO-3); False keeps
            them until backward.
        mixed_precision: ``"bf16-mixed"``, ``"16-mixed"``, ``"32"`` or None.
        checkpoint_format: ``"sharded"`` or ``"plain"``.
        deferred_init: build modules in the scope without data and fill each worker's part from the
            recorded build (the model is never whole in one process).

    Raises:
        ValueError: ``layout_map`` is on another mesh than ``mesh``, names parameters while the mesh has no
            model axis, the mesh does not hold the number of workers running, or one of
            ``ShardedStrategy``'s (a ``checkpoint_format`` or ``mixed_precision`` it does not know, more than
            one device per process, CUDA workers on gloo).
    """

    def __init__(
        self,
        mesh: DeviceMesh | None = None,
        layout_map: LayoutMap | None = None,
        *,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str] | None = None,
        sharding_policy: ShardingPolicy | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: str | None = None,
        checkpoint_format: str = "sharded",
        deferred_init: bool = True,
    ) -> None:
        given = mesh is not None or layout_map is not None
        if mesh is None:
            mesh = layout_map.device_mesh if layout_map is not None else DeviceMesh((-1,), (BATCH,))
        elif layout_map is not None and layout_map.device_mesh != mesh:
            raise ValueError(
                f"MeshStrategy(mesh={mesh}, layout_map=...): the layout map is on {layout_map.device_mesh}; give "
                "the layout map built on this mesh (LayoutMap(mesh)), or leave mesh out"
            )
        if layout_map is not None and len(layout_map) and not mesh.model_axes:
            raise ValueError(
                f"MeshStrategy: the layout map names parameters but {mesh} has no model axis to split them over; "
                "add one (DeviceMesh((2, 2), ('batch', 'model')))"
            )
        super().__init__(
            cluster_resolver,
            communication_options,
            devices,
            sharding_policy=sharding_policy,
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            checkpoint_format=checkpoint_format,
            deferred_init=deferred_init,
        )
        #: the mesh, sizes resolved for the workers running (ValueError naming both when they differ)
        self.device_mesh = mesh.resolved(self.num_workers)
        self.layout_map = layout_map
        coords = self.device_mesh.coordinate(self.worker_index)
        data_index = 0
        for axis in self.device_mesh.data_axes:
            data_index = data_index * self.device_mesh.size(axis) + coords[axis]
        self._data_index = data_index
        self._num_data = self.device_mesh.size(self.device_mesh.data_axes)
        model_axes = self.device_mesh.model_axes
        self._model_axis = model_axes[0] if model_axes else None
        self._tp_index = coords[self._model_axis] if self._model_axis else 0
        self._torch_mesh: Any = None
        #: one worker given a mesh: every axis of size 1, laid out all the same (DTensors, torch's hooks)
        self._one_worker_mesh = self.num_workers == 1 and given
        # the parameters no layout splits where no data axis shards them (plain tensors, whole on every worker)
        self._plain: dict[int, weakref.ref[nn.Parameter]] = {}
        #: the seed every worker's random streams derive from (the chief's), agreed at the first use of one
        self._group_seed: int | None = None
        #: with a model axis of 2 or more: the steps' and the sharded loader's streams of this worker's group
        self.model_stream: GroupRandomStream | None = None
        self.input_stream: GroupRandomStream | None = None
        self._dtensor_tracker_checked = False
        if self.tensor_parallel_size > 1:
            device = self.local_devices[0] or torch.device("cpu")
            self.model_stream = GroupRandomStream("model", self._data_index, device, self._agreed_seed)
            self.input_stream = GroupRandomStream("input", self._data_index, device, self._agreed_seed)
        log.info(
            "MeshStrategy: worker %d at %s of %s",
            self.worker_index,
            coords,
            self.device_mesh,
        )

    # ------------------------------------------------------------------ the replicas: points of the data axes
    @property
    def num_replicas_in_sync(self) -> int:
        """The data axes' size: the workers of one tensor-parallel group are one replica."""
        return self._num_data

    @property
    def data_worker_index(self) -> int:
        """This worker's position on the data axes (row-major): which part of each global batch it reads."""
        return self._data_index

    @property
    def num_data_workers(self) -> int:
        """The data axes' size: how many parts each global batch is split into across the workers."""
        return self._num_data

    @property
    def counts_in_reductions(self) -> bool:
        """The first worker of each tensor-parallel group counts for the group in ``reduce`` and ``gather``."""
        return self._tp_index == 0

    @property
    def tensor_parallel_size(self) -> int:
        """The model axis's size (1 without one)."""
        return self.device_mesh.size(self._model_axis) if self._model_axis else 1

    # ------------------------------------------------------------------ random numbers: one stream per TP group
    def _agreed_seed(self) -> int:
        """The chief's ``torch.initial_seed()``, on every worker (a collective, once: the first stream's first use)."""
        if self._group_seed is None:
            self._group_seed = int(self.communicator.broadcast_object(torch.initial_seed(), src=0))
        return self._group_seed

    def _set_dtensor_rng_tracker(self) -> None:
        """On CUDA, before the first step: DTensor's random ops (a dropout on a ``DTensor``) get torch's RNG
        tracker without the state broadcast over the world that torch's lazy one makes at their first call (which
        would give every data-parallel replica the chief's stream); the tracker offsets each shard's draws within
        the live stream, as ``torch.distributed.tensor._random.manual_seed`` (torchtitan's call) sets it up."""
        device = self.local_devices[0]
        if self._torch_mesh is None and device is not None and device.type == "cuda":
            return  # no model laid out yet: again at the next step
        self._dtensor_tracker_checked = True
        if device is None or device.type != "cuda":
            return
        from torch.distributed.tensor import _random as dtensor_random

        if dtensor_random._rng_tracker is None:
            dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(self._torch_mesh, run_state_sync=False)

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        """As ``ShardedStrategy``'s, with the tensor-parallel group's random stream live during the step.

        Args:
            fn: the step function.
            args: positional arguments of ``fn``.
            kwargs: keyword arguments of ``fn``.
            options: ``RunOptions``.

        Returns:
            What ``fn`` returns.
        """
        if self.model_stream is None:
            return super().call_for_each_replica(fn, args, kwargs, options)
        if not self._dtensor_tracker_checked:
            self._set_dtensor_rng_tracker()
        with self.model_stream.active():
            return super().call_for_each_replica(fn, args, kwargs, options)

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> DistributedDataset:
        """As ``ShardedStrategy``'s (each global batch split over the data axes); a sharded ``DataLoader`` draws
        its worker processes' seed and its main-process transforms from the group's input stream.

        Args:
            dataset: an iterable of global batches.
            options: ``ds.InputOptions``, or None.

        Returns:
            A distributed dataset whose batches are this worker's data-parallel part of each global batch.
        """
        from distrib.input import DistributedDataset

        return DistributedDataset(dataset, self, options=options, loader_stream=self.input_stream)

    def torch_mesh(self, device_type: str = "cpu") -> Any:
        """torch's ``DeviceMesh`` of :attr:`device_mesh` (``init_device_mesh``; made once, on every worker).

        Args:
            device_type: the device type of the mesh (``"cpu"``, ``"cuda"``), used the first time only.

        Returns:
            The ``torch.distributed.device_mesh.DeviceMesh``, its dimensions named as the mesh's axes: index
            it by axis name (``mesh["model"]``) for a sub-mesh.
        """
        if self._torch_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = self.device_mesh
            if self.num_workers == 1:  # torch's mesh needs a process group, even of one rank
                one_rank_group(torch.device(device_type))
            self._torch_mesh = self.communicator.guarded(
                "making the device mesh",
                lambda: init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names),
            )
        return self._torch_mesh

    # ------------------------------------------------------------------ applying the mesh to a model
    @property
    def graph_capture_blocker(self) -> str | None:
        """With the model laid out (several workers, or one given a mesh): ``ds.function`` runs the step eagerly."""
        if self._lays_out_model:
            return (
                f"MeshStrategy lays the model out on torch's mesh {self.device_mesh.shape}: FSDP2 all-gathers and "
                "frees the parameters around every unit, and DTensor redistributes them, from Python on the host, "
                "which a CUDA graph does not replay"
            )
        return super().graph_capture_blocker

    @property
    def _lays_out_model(self) -> bool:
        """Several workers, or one given a mesh (or a layout map): the model is laid out on torch's mesh."""
        return self.num_workers > 1 or self._one_worker_mesh

    def distribute_module(self, module: nn.Module) -> None:
        """Lay ``module`` out on the mesh: tensor parallelism by the layout map, then FSDP over the data axes.

        As ``ShardedStrategy``'s otherwise; without a data axis to shard over, the parameters that no layout
        splits stay plain tensors (whole on every worker of the group), and are recorded as this strategy's.

        Args:
            module: a root module built under ``strategy.scope()``.

        Raises:
            ValueError: a layout map key matches nothing in ``module``, a layout does not fit its parameter
                (the number of dimensions, a size the model axis does not divide, a module torch's styles do
                not cover), or a submodule belongs to another strategy or scope block.
        """
        super().distribute_module(module)
        for param in module.parameters():
            if not _fsdp().is_sharded(param):
                self._plain[id(param)] = weakref.ref(param)

    def _distributes(self, param: Any) -> bool:
        entry = self._plain.get(id(param))
        return super()._distributes(param) or (entry is not None and entry() is param)

    def _parallelise(self, module: nn.Module, device: torch.device | None) -> list[nn.Module]:
        """Tensor parallelism (the layout map), then FSDP over the data axes: torch's calls, torchtitan's order."""
        mesh = self.device_mesh
        plan = (
            tensor_parallel.plan_for(module, self.layout_map, self.tensor_parallel_size)
            if self.layout_map is not None
            else {}
        )
        tmesh = self.torch_mesh(device.type if device is not None else "cpu")
        if plan and self._model_axis is not None and (self.tensor_parallel_size > 1 or self._one_worker_mesh):
            tp_mesh = tmesh[self._model_axis]
            self.communicator.guarded(
                "applying the layout map (parallelize_module)", lambda: tensor_parallel.apply(module, tp_mesh, plan)
            )
        units: list[nn.Module] = []
        if self._num_data > 1 or self._one_worker_mesh:
            units = self._policy.units(module)
            data_mesh = tmesh[mesh.data_axes] if len(mesh.data_axes) > 1 else tmesh[mesh.data_axes[0]]
            self._shard_units(module, units, data_mesh, "sharding the model over the data axes")
        log.info(
            "MeshStrategy: %s on %s: %d module(s) tensor-parallel, %d FSDP unit(s) + the root over %s",
            type(module).__name__,
            mesh,
            len(plan),
            len(units),
            mesh.data_axes,
        )
        return units
