"""A mesh of workers and the layouts of parameters on it, with Keras 3's names (``keras.distribution``).

* :class:`DeviceMesh` ``(shape, axis_names)``: the workers arranged as an n-dimensional array with
  a name per axis, as Keras 3's ``DeviceMesh`` (one device per worker process here). The data axes
  split the global batch: ``"batch"`` (Keras's ``batch_dim_name``), over which parameters are
  sharded (FSDP2), and optionally ``"replicate"``, over which they are replicated (hybrid
  sharding, torch's HSDP). Every other axis is a model axis: tensor parallelism, as the
  :class:`LayoutMap` says. ``MeshStrategy`` makes torch's own mesh of it
  (``init_device_mesh(device_type, shape, mesh_dim_names=axis_names)``).
* :class:`LayoutMap`: parameter names (regular expressions) to layouts, as Keras 3's ``LayoutMap``:
  a layout is a tuple with one mesh axis name (or None) per dimension of the parameter, as torch
  holds it (``nn.Linear.weight`` is ``(out_features, in_features)``: ``("model", None)`` shards the
  outputs, torch's ``ColwiseParallel``; ``(None, "model")`` the inputs, ``RowwiseParallel``). A key
  may also name modules and map them to a torch ``ParallelStyle`` (``ColwiseParallel()``,
  ``RowwiseParallel()``, ``SequenceParallel()``, with their options), as ``parallelize_module``'s
  plan does. :mod:`distrib.strategies.tensor_parallel` turns it into that plan.

Lookup is Keras's: an exact key first, else the one key whose regular expression matches anywhere
in the name (``re.search``); two matching keys are an error naming both.

Example::

    >>> mesh = DeviceMesh((2, 2), ("batch", "model"))
    >>> layout_map = LayoutMap(mesh)
    >>> layout_map[r"mlp\\.up\\.weight"] = ("model", None)      # ColwiseParallel
    >>> layout_map[r"mlp\\.down\\.weight"] = (None, "model")    # RowwiseParallel
    >>> layout_map.get("blocks.0.mlp.up.weight")
    ('model', None)
    >>> mesh.data_axes, mesh.model_axes
    (('batch',), ('model',))
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceMesh", "LayoutMap", "BATCH", "REPLICATE", "Layout"]

#: the data axis over which parameters are sharded: Keras 3's ``DEFAULT_BATCH_DIM_NAME``
BATCH = "batch"
#: the data axis over which parameters are replicated (hybrid sharding)
REPLICATE = "replicate"

#: a parameter's layout: a mesh axis name (or None) per dimension, or a torch ``ParallelStyle`` for a module
Layout = Any


@dataclass(frozen=True)
class DeviceMesh:
    """The workers as an array with named axes (Keras 3's ``keras.distribution.DeviceMesh``).

    Give it to ``ds.experimental.MeshStrategy(mesh, layout_map)``: the data axes split the global batch
    (parameters sharded over the batch axis, replicated over the replicate axis), the model axis (at most
    one) is tensor parallelism. Worker ``r`` sits at ``r``'s row-major position, so the last axis holds
    neighbours (put the model axis last: its collectives run every layer).

    Args:
        shape: the size of each axis; their product is the number of workers (one axis may be -1: the
            workers left, fixed when the strategy builds the mesh).
        axis_names: one name per axis: the data axes first (``"replicate"`` if any, then ``"batch"``), then
            the model axis.
        batch_dim_name: the name of the axis that splits the batch and shards the parameters (FSDP).
        replicate_dim_name: the name of the axis over which parameters are replicated (HSDP), if the mesh
            has one.

    Raises:
        ValueError: ``shape`` and ``axis_names`` differ in length (or are empty), names repeat, a size is 0
            or below -1 (or -1 twice), there is no batch axis, the data axes are not first and in order, or
            there is more than one model axis.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    batch_dim_name: str = BATCH
    replicate_dim_name: str = REPLICATE

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        *,
        batch_dim_name: str = BATCH,
        replicate_dim_name: str = REPLICATE,
    ) -> None:
        shape, axis_names = tuple(int(s) for s in shape), tuple(axis_names)
        if len(shape) != len(axis_names) or not shape:
            raise ValueError(
                f"DeviceMesh(shape={shape}, axis_names={axis_names}): give one name per axis (Keras: "
                "DeviceMesh(shape=(2, 4), axis_names=('batch', 'model')))"
            )
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"DeviceMesh(axis_names={axis_names}): the names must differ")
        if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
            raise ValueError(f"DeviceMesh(shape={shape}): sizes are positive, one of them may be -1 (the rest)")
        if batch_dim_name not in axis_names:
            raise ValueError(
                f"DeviceMesh(axis_names={axis_names}) has no batch axis {batch_dim_name!r}: name the axis that "
                "splits the global batch (and shards the parameters) so, or pass batch_dim_name="
            )
        data = [replicate_dim_name, batch_dim_name] if replicate_dim_name in axis_names else [batch_dim_name]
        order = [n for n in axis_names if n in data]
        if order != data or axis_names[: len(data)] != tuple(data):
            raise ValueError(
                f"DeviceMesh(axis_names={axis_names}): put the data axes first, {tuple(data)} in this order, "
                "then the model axes (torch's HSDP mesh is (replicate, shard); tensor parallelism innermost)"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "batch_dim_name", batch_dim_name)
        object.__setattr__(self, "replicate_dim_name", replicate_dim_name)
        if len(self.model_axes) > 1:
            raise ValueError(
                f"DeviceMesh(axis_names={axis_names}): one model axis at most (tensor parallelism); "
                f"{self.model_axes} are several"
            )

    @classmethod
    def hybrid(cls, shard_size: int | str = "host", num_workers: int | None = None) -> DeviceMesh:
        """Hybrid sharding's mesh: parameters sharded within groups of ``shard_size`` workers, replicated across.

        ``shard_size="host"`` (the default) shards within each host (``LOCAL_WORLD_SIZE``, which ``distrib
        launch`` and torchrun set) and replicates across hosts: the all-gathers stay on the host's links,
        and one all-reduce per step crosses hosts.

        Args:
            shard_size: the workers of one sharding group (the batch axis); ``"host"``: ``LOCAL_WORLD_SIZE``.
            num_workers: the world size; None: ``WORLD_SIZE``, else -1 (inferred when the strategy builds the
                mesh).

        Returns:
            ``DeviceMesh((num_workers // shard_size, shard_size), ("replicate", "batch"))``.

        Raises:
            ValueError: ``shard_size="host"`` without ``LOCAL_WORLD_SIZE``, ``shard_size`` is not a positive
                number, or it does not divide ``num_workers``.
        """
        if shard_size == "host":
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local is None:
                raise ValueError(
                    "DeviceMesh.hybrid(shard_size='host') reads LOCAL_WORLD_SIZE (set by distrib launch and "
                    "torchrun), which is not set here: give shard_size=<workers per group>"
                )
            shard_size = int(local)
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"DeviceMesh.hybrid(shard_size={shard_size!r}): give a positive number of workers")
        world = num_workers if num_workers is not None else int(os.environ.get("WORLD_SIZE", "-1"))
        replicas = -1 if world == -1 else world // shard_size
        if world != -1 and world % shard_size:
            raise ValueError(
                f"DeviceMesh.hybrid(shard_size={shard_size}): {world} workers do not divide into groups of {shard_size}"
            )
        return cls((replicas, shard_size), (REPLICATE, BATCH))

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes that split the global batch: ``(replicate, batch)`` or ``(batch,)``."""
        return tuple(n for n in self.axis_names if n in (self.batch_dim_name, self.replicate_dim_name))

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The tensor-parallel axes (every axis that is not a data axis; one at most)."""
        return tuple(n for n in self.axis_names if n not in self.data_axes)

    def resolved(self, num_workers: int) -> DeviceMesh:
        """This mesh for ``num_workers`` workers: what the strategy builds torch's mesh from.

        Args:
            num_workers: the workers running.

        Returns:
            A mesh of the same axes with the ``-1`` size (if any) replaced by the workers left.

        Raises:
            ValueError: the mesh cannot hold ``num_workers`` workers (the message names both counts).
        """
        known = math.prod(s for s in self.shape if s != -1)
        shape = tuple(num_workers // known if s == -1 else s for s in self.shape)
        if math.prod(shape) != num_workers or (-1 in self.shape and num_workers % known):
            raise ValueError(
                f"DeviceMesh(shape={self.shape}, axis_names={self.axis_names}) holds {math.prod(shape)} workers "
                f"but {num_workers} are running: make the product of the shape {num_workers} (or one size -1), "
                f"or start {math.prod(shape)} workers"
            )
        return DeviceMesh(
            shape, self.axis_names, batch_dim_name=self.batch_dim_name, replicate_dim_name=self.replicate_dim_name
        )

    def size(self, axes: str | Sequence[str]) -> int:
        """The number of workers along ``axes``.

        Args:
            axes: an axis name, or several.

        Returns:
            The product of their sizes (e.g. the tensor-parallel group's size for the model axis).

        Raises:
            ValueError: a name is not an axis of the mesh.
        """
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        return math.prod(self.shape[self.axis_names.index(n)] for n in names)

    def coordinate(self, rank: int) -> dict[str, int]:
        """Worker ``rank``'s index along each axis (row-major, as torch's ``init_device_mesh``).

        Args:
            rank: the worker's rank, from 0.

        Returns:
            Axis name -> the worker's index along it, in the mesh's axis order.
        """
        coords: dict[str, int] = {}
        for name, size in reversed(list(zip(self.axis_names, self.shape))):
            coords[name] = rank % size
            rank //= size
        return {n: coords[n] for n in self.axis_names}

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self.shape}, axis_names={self.axis_names})"


class LayoutMap(MutableMapping[str, Layout]):
    """Parameter (or module) names, as regular expressions, to layouts: Keras 3's ``keras.distribution.LayoutMap``.

    ``layout_map[key] = ("model", None)``: every parameter whose name ``key`` matches (exactly, else
    ``re.search``) is laid out so, one mesh axis name or None per dimension. ``layout_map[key] =
    ColwiseParallel()`` (any torch ``ParallelStyle``): every module whose name matches is parallelised
    with it, as in ``parallelize_module``'s plan. A key that matches nothing in the model is an error when
    the model is distributed, naming the key and the model's names.

    Setting a key raises ``ValueError`` when it already has a layout, is not a regular expression, or its
    layout names an axis the mesh lacks or a data axis (the strategy shards over those itself), and
    ``TypeError`` for a layout that is neither a tuple nor a ``ParallelStyle``.

    Args:
        device_mesh: the mesh whose axis names the layouts use.
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        self.device_mesh = device_mesh
        self._layouts: dict[str, Layout] = {}

    def __getitem__(self, key: str) -> Layout:
        return self._layouts[key]

    def __setitem__(self, key: str, layout: Layout) -> None:
        if key in self._layouts:
            raise ValueError(f"LayoutMap: {key!r} already has a layout ({self._layouts[key]!r}); delete it first")
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"LayoutMap key {key!r} is not a regular expression: {e}") from e
        if isinstance(layout, (tuple, list)):
            layout = tuple(layout)
            axes = self.device_mesh.axis_names
            for axis in layout:
                if axis is not None and axis not in axes:
                    raise ValueError(f"LayoutMap[{key!r}] = {layout}: {axis!r} is not an axis of {self.device_mesh}")
                if axis is not None and axis in self.device_mesh.data_axes:
                    raise ValueError(
                        f"LayoutMap[{key!r}] = {layout}: {axis!r} is a data axis; the strategy shards every "
                        f"parameter over the data axes itself (FSDP): name a model axis {self.device_mesh.model_axes}"
                    )
        elif not callable(getattr(layout, "_apply", None)):  # torch's ParallelStyle: apply(module, mesh) as _apply
            raise TypeError(
                f"LayoutMap[{key!r}] = {layout!r}: give a tuple of mesh axis names (one per dimension, None to "
                "replicate it) or a torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), SequenceParallel())"
            )
        self._layouts[key] = layout

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def key_for(self, name: str, styles: bool = False) -> str | None:
        """The key whose layout ``name`` takes: an exact key first, else the one that ``re.search``-matches.

        Args:
            name: a parameter name (``"blocks.0.mlp.up.weight"``) or, with ``styles``, a module name.
            styles: look among the ``ParallelStyle`` keys (module names); False: among the tuple keys
                (parameters).

        Returns:
            The key, or None when none matches.

        Raises:
            ValueError: several keys match ``name`` (Keras 3 refuses this too).
        """
        keys = [k for k, v in self._layouts.items() if isinstance(v, tuple) != styles]
        if name in keys:
            return name
        found = [k for k in keys if re.search(k, name)]
        if len(found) > 1:
            raise ValueError(
                f"LayoutMap: {name!r} matches several keys, {found}; make the regular expressions exclusive "
                "(Keras 3 refuses this too)"
            )
        return found[0] if found else None

    def get(self, key: str, default: Any = None) -> Layout:
        """The layout of ``key`` (a parameter or module name), by Keras's lookup.

        Args:
            key: a parameter name, else a module name (the tuple keys are tried first).
            default: what to return when no key matches.

        Returns:
            The matching key's layout (a tuple of axis names or a ``ParallelStyle``), or ``default``.

        Raises:
            ValueError: several keys match ``key``.
        """
        k = self.key_for(key) or self.key_for(key, styles=True)
        return self._layouts[k] if k is not None else default

    def __repr__(self) -> str:
        return f"LayoutMap({self.device_mesh}, {self._layouts!r})"
