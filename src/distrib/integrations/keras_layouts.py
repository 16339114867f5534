"""A Keras 3 ``LayoutMap`` applied to a Keras model on the torch backend: its variables become ``DTensor`` s.

Keras 3 lays out a variable by its path (``"sequential/up/kernel"``) and a ``TensorLayout``: one mesh axis
name (or None) per dimension of the variable *as Keras holds it*. A ``Dense`` kernel is ``(in, out)``, so
``(None, "model")`` splits the outputs (torch's ``ColwiseParallel`` for an ``nn.Linear``, whose weight is
``(out, in)``) and ``("model", None)`` the inputs (``RowwiseParallel``). Rather than translate to torch's
styles, which accept ``nn.Linear`` and ``nn.Embedding`` only, each laid-out variable becomes a ``DTensor``
whose placements name the variable's own dimensions (``Shard(d)`` where the layout names the model axis):
the orientation cannot be crossed, and DTensor's rules make every result exact.

A layer holding such a variable gets two torch hooks (Keras calls its layers through ``nn.Module.__call__``,
so they run): its tensor inputs enter as ``DTensor`` s replicated over the model axis (their gradient is
summed over the axis in backward), and its outputs leave gathered, as plain tensors of the layer's full
shape, which the next layer (laid out or not) and Keras' own shape checks expect. A column-split layer's
output is gathered there, where Megatron would hand it split to the next, row-split layer: one
all-gather more per pair, the price of layouts that need not come in pairs.

Only ``keras.layers.Dense`` kernels and biases are laid out; a layout that splits another layer's variable,
names the batch axis, or does not fit its variable is an error naming the variable's path and the fix.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distrib.integrations.keras_models import is_keras_layer

__all__ = [
    "VariableLayout",
    "plan_layouts",
    "lay_out",
    "sync_torch_params",
    "sum_gradients_over",
    "batch_statistics_layers",
]


@dataclass(frozen=True)
class VariableLayout:
    """One Keras variable to lay out: its path, its layer, and the dimensions the model axis splits."""

    path: str
    variable: Any
    layer: Any
    split_dims: tuple[int, ...]


def _sublayers(layer: Any) -> list[Any]:
    """The Keras layers directly inside ``layer``: a model's ``.layers`` (tracked by Keras, not torch) and the
    Keras layers among its torch children (a layer assigned as an attribute of a custom layer)."""
    inner = [c for c in layer.children() if is_keras_layer(c)]
    return inner + [c for c in getattr(layer, "layers", None) or [] if is_keras_layer(c)]


def _leaf_layers(root: Any) -> Iterator[Any]:
    """The Keras layers under ``root`` (``root`` included) that hold no other Keras layer."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        inner = _sublayers(layer)
        if not inner:
            yield layer
        stack.extend(inner)


def plan_layouts(root: Any, distribution: Any, model_axis: str | None, tp_size: int) -> list[VariableLayout]:
    """The variables of ``root`` that a Keras ``ModelParallel`` splits, checked.

    Each variable's layout is Keras' own answer (``distribution.get_variable_layout``: the ``LayoutMap`` key
    that matches the whole ``variable.path``; two matching keys are Keras' error naming both).

    Args:
        root: a built Keras layer or model.
        distribution: ``keras.distribution.ModelParallel``.
        model_axis: the mesh's model axis (None: the mesh has none).
        tp_size: the model axis' size.

    Returns:
        One :class:`VariableLayout` per variable whose layout names an axis, and one (no split dimension: it is
        replicated on the model axis) per other variable of those variables' layers.

    Raises:
        ValueError: a layout splits a variable of a layer other than ``keras.layers.Dense``, names the batch axis,
            has a length other than the variable's rank, splits two dimensions, or splits a size the model axis
            does not divide. Each message names the variable's path, its layout and the fix.
    """
    import keras

    owners: dict[int, Any] = {}
    for layer in _leaf_layers(root):
        for v in layer.weights:
            owners.setdefault(id(v), layer)
    batch_axis = distribution.batch_dim_name
    planned: list[VariableLayout] = []
    for v in root.weights:
        axes = tuple(distribution.get_variable_layout(v).axes)
        where = f"the LayoutMap entry for {v.path!r} (shape {tuple(v.shape)}), layout {axes},"
        split = tuple(d for d, a in enumerate(axes) if a is not None)
        if not split:
            continue
        if len(axes) != len(v.shape):
            raise ValueError(f"{where} has {len(axes)} entries: give one axis name (or None) per dimension")
        if batch_axis in axes:
            raise ValueError(
                f"{where} names the batch axis {batch_axis!r}: on torch distrib replicates Keras variables over "
                "the batch axis (as keras.distribution.DataParallel does); put None there"
            )
        layer = owners.get(id(v))
        if not isinstance(layer, keras.layers.Dense):
            kind = type(layer).__name__ if layer is not None else "a layer that holds other layers"
            raise ValueError(
                f"{where} splits a variable of {kind}; on torch distrib splits keras.layers.Dense kernels and "
                "biases only (no torch ParallelStyle covers the rest): change the key so that it does not match "
                "this path (the variable is then replicated), or build that part from Dense layers"
            )
        if len(split) > 1:
            raise ValueError(f"{where} splits {len(split)} dimensions; one model axis splits one dimension")
        if model_axis is None or axes[split[0]] != model_axis:
            raise ValueError(f"{where} names {axes[split[0]]!r}, which is not the mesh's model axis {model_axis!r}")
        if v.shape[split[0]] % tp_size:
            raise ValueError(
                f"{where} splits dimension {split[0]} ({v.shape[split[0]]}), which does not divide by the "
                f"{tp_size} workers of axis {model_axis!r}: choose sizes that do, or another axis size"
            )
        planned.append(VariableLayout(v.path, v, layer, split))
    # a laid-out layer's other variables join its DTensors, replicated on the model axis (DTensor does not mix)
    split_ids = {id(item.variable) for item in planned}
    for layer in {id(item.layer): item.layer for item in planned}.values():
        planned.extend(VariableLayout(v.path, v, layer, ()) for v in layer.weights if id(v) not in split_ids)
    return planned


def _give_variable(variable: Any, param: nn.Parameter) -> None:
    """Make Keras' ``variable`` hold ``param`` from now on: what Keras' torch ``Variable._initialize`` does when
    it is given a ``Parameter``. Keras 3 on torch has no public way to change the tensor behind a variable (its
    JAX backend lays variables out as it creates them, through a ``distribution_lib`` that torch's lacks), and
    ``assign`` copies into the old tensor, which cannot become a ``DTensor``."""
    variable._value = param


def _replicated(value: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False)


def _gathered(value: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return value
    return value.redistribute(mesh, [Replicate()]).to_local()


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def lay_out(planned: list[VariableLayout], tp_mesh: Any, hooked: weakref.WeakSet[nn.Module]) -> None:
    """Each planned variable becomes a ``DTensor`` on ``tp_mesh`` (``Shard`` on its split dimension); each of
    their layers gets the input and output hooks once (``hooked`` remembers which have them)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for item in planned:
        value = item.variable.value
        if isinstance(value, DTensor):
            continue  # laid out already (through another root holding the same layer)
        placements = [Shard(item.split_dims[0])] if item.split_dims else [Replicate()]
        whole = value.detach()
        param = nn.Parameter(distribute_tensor(whole, tp_mesh, placements), requires_grad=value.requires_grad)
        _give_variable(item.variable, param)
        layer = item.layer
        if layer not in hooked:
            hooked.add(layer)
            layer.register_forward_pre_hook(
                lambda _m, args, kwargs: (_map(lambda t: _replicated(t, tp_mesh), args), kwargs), with_kwargs=True
            )
            layer.register_forward_hook(lambda _m, _args, out: _map(lambda t: _gathered(t, tp_mesh), out))


def sync_torch_params(root: Any) -> None:
    """Every Keras layer under ``root`` (torch's view of the model) lists its variables' current tensors in its
    ``torch_params``, so ``model.parameters()`` and ``state_dict()`` give the laid-out ones."""
    for module in root.modules():
        if not is_keras_layer(module):
            continue
        params = module.torch_params
        for v in module.variables:
            if v.path in params and params[v.path] is not v.value and isinstance(v.value, nn.Parameter):
                params[v.path] = v.value


def sum_gradients_over(
    params: list[nn.Parameter], group: Any, hooked: set[int], in_step: Callable[[], bool], strategy_name: str
) -> None:
    """Each gradient of ``params`` summed over ``group`` (the data axis) as backward computes it, before it
    accumulates into ``.grad``: every replica then holds the global batch's gradient, whatever steps it (a torch
    optimizer, a Keras one, a clip), and accumulating over several backward passes stays right.

    A backward outside the strategy's step (``in_step()`` False: Keras' own ``model.fit``, a loop without
    ``strategy.run``) is an error: no one split the batch over the workers, so summing would count it once per
    worker, and not summing would leave the workers apart."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not in_step():
            raise RuntimeError(
                f"A gradient of a model distributed by {strategy_name} is computed outside strategy.run: the workers "
                "sum their gradients in the step, over the parts of the global batch the strategy gives them. Run "
                "the training step with strategy.run(step, args=(x, y)) over strategy.experimental_distribute_dataset"
                "(dataset), or ds.fit; Keras' own model.fit and train_on_batch do not split the batch over workers"
            )
        if isinstance(grad, DTensor):
            local = grad.to_local().clone()
            dist.all_reduce(local, group=group)
            return DTensor.from_local(
                local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
        summed = grad.clone()
        dist.all_reduce(summed, group=group)
        return summed

    for param in params:
        if param.requires_grad and id(param) not in hooked:
            hooked.add(id(param))
            param.register_hook(hook)


def batch_statistics_layers(root: Any) -> list[str]:
    """The names of the layers under ``root`` that normalise with batch statistics (``BatchNormalization``): with
    the batch split over workers each sees only its part's, where Keras on JAX computes over the global batch."""
    import keras

    return [f"{layer.name!r}" for layer in _leaf_layers(root) if isinstance(layer, keras.layers.BatchNormalization)]
