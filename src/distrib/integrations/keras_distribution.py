"""Keras 3's ``keras.distribution`` on the torch backend: ``DataParallel`` and ``ModelParallel`` as a ``MeshStrategy``.

Keras 3 implements its distribution API for JAX only; on torch, ``keras.distribution.list_devices()`` fails and
a ``ModelParallel`` lays nothing out. ``ds.experimental.keras_distribution(distribution)`` takes the same
objects (``DeviceMesh``, ``LayoutMap``, ``DataParallel``, ``ModelParallel``) and returns the strategy that does
what they say, one worker process per device of the mesh (``distrib launch --workers N``)::

    devices = keras_distribution.list_devices()          # one name per worker: Keras' list_devices on JAX
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")      # Keras' (in, out) kernel: the outputs split
    layout_map[".*dense.*bias"] = ("model",)
    strategy = ds.experimental.keras_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, name="dense_up"), ...])
        optimizer = torch.optim.Adam(model.parameters())

What each name becomes:

* the mesh's batch axis (``batch_dim_name``; ``DataParallel``: the first axis) splits every global batch, as
  under any distrib strategy (``num_replicas_in_sync`` is its size); Keras variables are *replicated* over it,
  as Keras does, and each gradient is summed over it in backward (see
  :func:`~distrib.integrations.keras_layouts.sum_gradients_over`). A torch module built in the same scope is
  treated so too: torch's FSDP would replace the parameters that Keras' variables hold;
* the other axis (one at most) is the model axis: each variable that the ``LayoutMap`` splits over it becomes a
  ``DTensor`` on the axis (:mod:`~distrib.integrations.keras_layouts`), the rest are replicated;
* ``LayoutMap`` keys are Keras' (regular expressions matched against the whole ``variable.path``), its layouts
  are per dimension of the variable as Keras holds it (a ``Dense`` kernel is ``(in, out)``).

The model must be built inside ``strategy.scope()`` (a ``keras.Input`` first, or ``model.build(shape)``): its
variables are laid out when the scope closes. ``keras.distribution.set_distribution`` is not needed; set, it is
harmless unless the layout map has ``".../output"`` keys, which Keras then applies itself through its JAX-only
backend (an error).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distrib.integrations import keras_layouts, keras_models
from distrib.strategies.mesh import DeviceMesh
from distrib.strategies.mesh_strategy import MeshStrategy

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver
    from distrib.comm import CommunicationOptions
    from distrib.strategies.run_options import RunOptions

__all__ = ["keras_distribution", "list_devices", "device_mesh_of", "KerasMeshStrategy"]


def list_devices(device_type: str | None = None) -> list[str]:
    """One device name per worker process, for ``keras.distribution.DeviceMesh(..., devices=...)``.

    On JAX, Keras' ``list_devices()`` lists every device of every process; on torch it fails (Keras has no torch
    implementation). distrib runs one worker process per device, so the mesh's devices are the workers.

    Args:
        device_type: ``"cpu"`` or ``"gpu"``/``"cuda"``; None: ``"cuda"`` when a GPU is visible, else ``"cpu"``.

    Returns:
        ``["cpu:0", "cpu:1", ...]`` (or ``cuda:i``), ``WORLD_SIZE`` of them (1 without it).
    """
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "cuda" if kind == "gpu" else kind
    return [f"{kind}:{i}" for i in range(int(os.environ.get("WORLD_SIZE", "1")))]


def device_mesh_of(keras_mesh: Any, batch_dim_name: str) -> DeviceMesh:
    """distrib's :class:`~distrib.strategies.mesh.DeviceMesh` of a Keras ``DeviceMesh``.

    Args:
        keras_mesh: ``keras.distribution.DeviceMesh``.
        batch_dim_name: the axis that splits the batch.

    Returns:
        The mesh with the same shape and names, ``batch_dim_name`` as its batch axis.

    Raises:
        ValueError: the batch axis is not the first, or the mesh has more than two axes.
    """
    names, shape = tuple(keras_mesh.axis_names), tuple(int(s) for s in keras_mesh.shape)
    if names[0] != batch_dim_name or len(names) > 2:
        raise ValueError(
            f"keras.distribution.DeviceMesh(shape={shape}, axis_names={list(names)}) with batch_dim_name="
            f"{batch_dim_name!r}: on torch distrib takes the batch axis first and one model axis at most, e.g. "
            f"DeviceMesh({(2, 2)}, ['{batch_dim_name}', 'model'])"
        )
    # no replicate axis: Keras has no hybrid sharding; a name no axis can have
    return DeviceMesh(shape, names, batch_dim_name=batch_dim_name, replicate_dim_name="")


class KerasMeshStrategy(MeshStrategy):
    """``MeshStrategy`` for a Keras 3 ``DataParallel`` or ``ModelParallel`` (module docstring).

    Args:
        distribution: ``keras.distribution.DataParallel`` or ``ModelParallel``.
        cluster_resolver: the cluster; None: from the environment (``TF_CONFIG``, torchrun, Slurm).
        communication_options: the collectives' options (timeout, backend).
        devices: this process's one device (``["cuda:0"]``, ``["cpu"]``); None: its GPU, else the CPU.

    Raises:
        TypeError: ``distribution`` is not one of Keras' two.
        ValueError: the mesh does not fit (see :func:`device_mesh_of`), ``auto_shard_dataset=False`` (use
            ``strategy.distribute_datasets_from_function`` for a dataset each worker reads itself), or the
            mesh does not hold the workers running.
    """

    #: Keras variables stay whole over the batch axis: no FSDP (the allocator advice for its buffers does not apply)
    shards_parameters = False

    def __init__(
        self,
        distribution: Any,
        *,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str] | None = None,
    ) -> None:
        from keras import distribution as kd

        if not isinstance(distribution, (kd.DataParallel, kd.ModelParallel)):
            raise TypeError(
                f"keras_distribution({distribution!r}): give keras.distribution.DataParallel(...) or "
                "ModelParallel(layout_map=..., batch_dim_name=...)"
            )
        if not distribution.auto_shard_dataset:
            raise ValueError(
                f"{type(distribution).__name__}(auto_shard_dataset=False): each worker reads its own part of the "
                "data; give the strategy a function that builds it (strategy.distribute_datasets_from_function) "
                "and leave auto_shard_dataset at True"
            )
        self.keras_distribution = distribution
        #: whether the distribution lays variables out (ModelParallel; DataParallel replicates them all)
        self.lays_out_variables = isinstance(distribution, kd.ModelParallel)
        mesh = device_mesh_of(distribution.device_mesh, distribution.batch_dim_name)
        # MeshStrategy's FSDP options (sharding policy, mixed precision, resharding) do not apply: no FSDP here
        super().__init__(
            mesh,
            None,
            cluster_resolver=cluster_resolver,
            communication_options=communication_options,
            devices=devices,
            deferred_init=False,
        )
        self._keras_hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._summed: set[int] = set()
        #: how many steps of this strategy are running (strategy.run): the gradient sums are only right inside one
        self._steps_running = 0

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        """As ``MeshStrategy``'s; once a layer is laid out, under DTensor's ``implicit_replication``.

        A plain tensor in the step is the same on every worker of a model-axis group (they are one replica: the
        same part of the batch, the same random stream, the replicated variables, the layers' gathered outputs),
        so DTensor may take it as replicated where it meets a split variable: a Keras optimizer's update (its
        slot variables whole, its step count a plain scalar) and a loss on a split layer's output compute exactly.

        Args:
            fn: the step function.
            args: positional arguments of ``fn``.
            kwargs: keyword arguments of ``fn``.
            options: ``RunOptions``.

        Returns:
            What ``fn`` returns.
        """
        self._steps_running += 1
        try:
            if not len(self._keras_hooked):
                return super().call_for_each_replica(fn, args, kwargs, options)
            from torch.distributed.tensor.experimental import implicit_replication

            with implicit_replication():
                return super().call_for_each_replica(fn, args, kwargs, options)
        finally:
            self._steps_running -= 1

    def _parallelise(self, module: nn.Module, device: torch.device | None) -> list[nn.Module]:
        """Keras variables laid out by the layout map on the model axis; every parameter's gradient summed over the
        batch axis in backward. No FSDP unit: the parameters stay whole over the batch axis."""
        mesh = self.device_mesh
        tmesh = self.torch_mesh(device.type if device is not None else "cpu")
        model_axes = mesh.model_axes
        if keras_models.is_keras_layer(module):
            import keras

            if not module.built:
                raise ValueError(
                    f"{type(module).__name__} {module.name!r} was not built in strategy.scope(): its variables do "
                    "not exist yet to be laid out; start it with keras.Input(shape) or call model.build(shape) "
                    "inside the scope"
                )
            if self.lays_out_variables:
                planned = keras_layouts.plan_layouts(
                    module, self.keras_distribution, model_axes[0] if model_axes else None, self.tensor_parallel_size
                )
                if planned:
                    keras_layouts.lay_out(planned, tmesh[model_axes[0]], self._keras_hooked)
                elif isinstance(module, keras.Model) and model_axes:
                    paths = [v.path for v in module.weights]
                    warnings.warn(
                        f"ModelParallel splits no variable of {type(module).__name__} {module.name!r}: every variable "
                        f"is whole on every worker. LayoutMap keys match the whole variable.path (Keras' re.fullmatch);"
                        f" its paths: {paths[:8]}{' ...' if len(paths) > 8 else ''}",
                        stacklevel=2,
                    )
            keras_layouts.sync_torch_params(module)
            statistics = keras_layouts.batch_statistics_layers(module)
            if statistics and self.num_data_workers > 1:
                warnings.warn(
                    f"{', '.join(statistics)} normalise with the statistics of each worker's part of the batch (and "
                    f"keep moving averages per worker), where Keras on JAX uses the global batch's: results differ "
                    f"from one process (as under TF's MirroredStrategy). Use LayerNormalization (per example), or a "
                    f"mesh whose batch axis has size 1",
                    stacklevel=2,
                )
        if self.num_data_workers > 1:
            group = tmesh[mesh.batch_dim_name].get_group()
            me = weakref.ref(self)  # the parameters' hooks must not keep the strategy alive

            def in_step() -> bool:
                strategy = me()
                return strategy is not None and strategy._steps_running > 0

            keras_layouts.sum_gradients_over(
                list(module.parameters()), group, self._summed, in_step, type(self).__name__
            )
        return []


def keras_distribution(
    distribution: Any,
    *,
    devices: Sequence[str] | None = None,
    cluster_resolver: ClusterResolver | None = None,
    communication_options: CommunicationOptions | None = None,
) -> MeshStrategy:
    """The strategy that runs Keras 3's ``DataParallel`` or ``ModelParallel`` on torch (module docstring).

    Args:
        distribution: ``keras.distribution.DataParallel(device_mesh=...)`` or
            ``keras.distribution.ModelParallel(layout_map=..., batch_dim_name=...)``, its mesh's devices from
            :func:`list_devices` (or any list as long as the workers).
        devices: this process's one device (``["cuda:0"]``, ``["cpu"]``); None: its GPU, else the CPU.
        cluster_resolver: the cluster; None: from the environment (``TF_CONFIG``, torchrun, Slurm).
        communication_options: the collectives' options (timeout, backend).

    Returns:
        A :class:`KerasMeshStrategy` (a ``MeshStrategy``): its ``scope()``, ``run``, ``reduce`` and input as any.

    Raises:
        TypeError: ``distribution`` is not one of the two.
        ValueError: the mesh or a layout does not fit (each message names the variable, its layout and the fix).
    """
    return KerasMeshStrategy(
        distribution, devices=devices, cluster_resolver=cluster_resolver, communication_options=communication_options
    )
