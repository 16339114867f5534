"""A :class:`~distrib.strategies.mesh.LayoutMap` applied to a model: torch's ``parallelize_module``.

Nothing is written again: :func:`plan_for` turns the layout map into ``parallelize_module``'s plan
(module name to ``ParallelStyle``), checking it against the model first, and :func:`apply` calls
``parallelize_module(model, tp_mesh, plan)``. A parameter layout says which dimension of a weight
the model axis splits, which is what torch's styles mean:

=====================  ==========================  =====================================
module, parameter      layout                      torch's style
=====================  ==========================  =====================================
``nn.Linear.weight``   ``("model", None)``         ``ColwiseParallel()`` (outputs split)
``nn.Linear.weight``   ``(None, "model")``         ``RowwiseParallel()`` (inputs split)
``nn.Embedding.weight`` ``("model", None)``        ``RowwiseParallel()`` (vocabulary split)
``nn.Embedding.weight`` ``(None, "model")``        ``ColwiseParallel()`` (features split)
=====================  ==========================  =====================================

A bias follows its weight (``ColwiseParallel`` splits it, ``RowwiseParallel`` keeps it whole); a
layout for it that says otherwise is an error. Anything else (a ``LayerNorm``, an attention block's
own layout) takes a ``ParallelStyle`` keyed by module name. The checks, each an error naming the key
and the model: a key that matches no parameter (or module); a dimension that the model axis does not
divide; a layout torch has no style for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from distrib.strategies.mesh import LayoutMap

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

__all__ = ["plan_for", "apply"]


def _styles() -> tuple[Any, Any]:
    """torch's two styles, imported when a layout map is applied (not at ``import distrib``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def _replicate() -> Any:
    from torch.distributed.tensor import Replicate

    return Replicate()


def _names(model: nn.Module, what: str, limit: int = 12) -> str:
    names = [n for n, _ in (model.named_parameters() if what == "parameters" else model.named_modules()) if n]
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def plan_for(model: nn.Module, layout_map: LayoutMap, tp_size: int) -> dict[str, Any]:
    """``parallelize_module``'s plan for ``model`` (module name to style), after checking the map against it."""
    colwise, rowwise = _styles()
    plan: dict[str, Any] = {}
    used: set[str] = set()
    by_module: dict[str, dict[str, tuple[str, tuple[Any, ...]]]] = {}
    for name, param in model.named_parameters():
        key = layout_map.key_for(name)
        if key is None:
            continue
        used.add(key)
        layout = layout_map[key]
        if len(layout) != param.dim():
            raise ValueError(
                f"LayoutMap[{key!r}] = {layout} has {len(layout)} entries but {type(model).__name__}.{name} has "
                f"{param.dim()} dimensions {list(param.shape)}: give one axis name (or None) per dimension"
            )
        for dim, axis in enumerate(layout):
            if axis is not None and param.shape[dim] % tp_size:
                raise ValueError(
                    f"LayoutMap[{key!r}] = {layout} splits {type(model).__name__}.{name} (shape {list(param.shape)}) "
                    f"along dimension {dim} over the {tp_size} workers of axis {axis!r}, but {param.shape[dim]} "
                    f"does not divide by {tp_size}: choose sizes that do, or another axis size"
                )
        owner, _, leaf = name.rpartition(".")
        by_module.setdefault(owner, {})[leaf] = (key, layout)
    for owner, leaves in by_module.items():
        style = _style_of(model, owner, leaves, colwise, rowwise)
        if style is not None:
            plan[owner] = style
    for name, module in model.named_modules():
        key = layout_map.key_for(name, styles=True) if name else None
        if key is None:
            continue
        used.add(key)
        if name in plan:
            raise ValueError(
                f"LayoutMap: module {name!r} takes both {layout_map[key]!r} (key {key!r}) and a parameter layout "
                f"({plan[name]!r}); give one of them"
            )
        _check_style_divides(model, name, module, layout_map[key], key, tp_size, colwise, rowwise)
        plan[name] = layout_map[key]
    unused = [k for k in layout_map if k not in used]
    if unused:
        what = "parameters" if isinstance(layout_map[unused[0]], tuple) else "modules"
        raise ValueError(
            f"LayoutMap key(s) {unused} match no {what[:-1]} of {type(model).__name__} (its {what}: "
            f"{_names(model, what)}); fix the regular expression or remove the key"
        )
    return plan


def _style_of(
    model: nn.Module, owner: str, leaves: dict[str, tuple[str, tuple[Any, ...]]], colwise: Any, rowwise: Any
) -> Any:
    module = model.get_submodule(owner)
    where = f"{type(model).__name__}.{owner}" if owner else type(model).__name__
    weight = leaves.get("weight")
    others = [leaf for leaf in leaves if leaf not in ("weight", "bias")]
    if not isinstance(module, (nn.Linear, nn.Embedding)) or others:
        key, layout = next(iter(leaves.values()))
        raise ValueError(
            f"LayoutMap[{key!r}] = {layout} lays out a parameter of {where} ({type(module).__name__}); parameter "
            "layouts translate to torch's styles for nn.Linear and nn.Embedding weights only: map the module's "
            f"name to a ParallelStyle instead (layout_map[{owner!r}] = SequenceParallel(), or your own style)"
        )
    if weight is None:
        key, layout = leaves["bias"]
        if any(a is not None for a in layout):
            raise ValueError(
                f"LayoutMap[{key!r}] = {layout} splits {where}.bias but no layout names {where}.weight: give the "
                f"weight's layout (the bias follows it)"
            )
        return None
    key, layout = weight
    if all(a is None for a in layout):
        style = None
    elif layout[1] is None:  # the first dimension split: out_features (Linear), the vocabulary (Embedding)
        # an Embedding's input is whole token ids: RowwiseParallel's default input layout, Shard(-1), would gather them
        style = colwise() if isinstance(module, nn.Linear) else rowwise(input_layouts=_replicate())
    elif layout[0] is None:  # an Embedding's features split: its output whole again, as it would be without a layout
        style = rowwise() if isinstance(module, nn.Linear) else colwise(output_layouts=_replicate())
    else:
        raise ValueError(
            f"LayoutMap[{key!r}] = {layout} splits both dimensions of {where}.weight; one model axis splits one "
            "dimension (torch's ColwiseParallel or RowwiseParallel)"
        )
    bias = leaves.get("bias")
    if bias is not None and isinstance(module, nn.Linear):
        split, splits = bias[1][0] is not None, isinstance(style, colwise)
        if split != splits:
            raise ValueError(
                f"LayoutMap[{bias[0]!r}] = {bias[1]} for {where}.bias disagrees with {where}.weight's {layout}, "
                f"under which the bias is {'split' if splits else 'whole'}; drop the bias's key (it follows the weight)"
            )
    return style


def _check_style_divides(
    model: nn.Module, name: str, module: nn.Module, style: Any, key: str, tp_size: int, colwise: Any, rowwise: Any
) -> None:
    """A torch style on a Linear or Embedding: the dimension it splits must divide by the model axis."""
    weight = getattr(module, "weight", None)
    if not isinstance(module, (nn.Linear, nn.Embedding)) or weight is None:
        return
    dim = None
    if isinstance(style, colwise):
        dim = 0 if isinstance(module, nn.Linear) else 1
    elif isinstance(style, rowwise):
        dim = 1 if isinstance(module, nn.Linear) else 0
    if dim is not None and weight.shape[dim] % tp_size:
        raise ValueError(
            f"LayoutMap[{key!r}] = {type(style).__name__}() splits {type(model).__name__}.{name}.weight (shape "
            f"{list(weight.shape)}) along dimension {dim} over {tp_size} workers, but {weight.shape[dim]} does not "
            f"divide by {tp_size}"
        )


def apply(model: nn.Module, tp_mesh: TorchMesh, plan: dict[str, Any]) -> None:
    """torch's ``parallelize_module(model, tp_mesh, plan)``: each planned module's parameters become DTensors."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)
