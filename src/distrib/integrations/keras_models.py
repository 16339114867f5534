"""Keras 3 models (``KERAS_BACKEND=torch``) as the modules a strategy distributes: which captured Keras layers are
nested in which, and the backend check.

On the torch backend a Keras layer is a ``torch.nn.Module``, but its sublayers are tracked by Keras, not
registered as torch submodules: building ``keras.Sequential([Dense(16), Dense(4)])`` in a scope shows torch three
unrelated modules holding parameters. Distributing each of them would give the Dense layers copies of their own
beside the copies inside the Sequential's, and a replica's gradient would land in copies nobody sums. A captured Keras
layer whose variables all belong to another captured Keras layer is that layer's part (:func:`nested_layers`),
and the whole model is distributed once, its sublayers dispatched to each replica's copy
(:func:`sublayers`). (A Keras layer's deep copy registers its parameters anew, so the replicas' copies are made
with the scope detached: they are not modules built in it.) Nothing here imports keras before the user's code
has: ``import distrib`` works without it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["keras_loaded", "is_keras_layer", "check_backend", "nested_layers", "sublayers", "describe"]


def keras_loaded() -> bool:
    """Whether the user's code imported keras (distrib never imports it itself)."""
    return "keras" in sys.modules


def check_backend() -> None:
    """Raise unless keras runs on the torch backend (the only one whose objects distrib can distribute)."""
    import keras

    backend = keras.backend.backend()
    if backend != "torch":
        raise RuntimeError(
            f"keras runs on the {backend!r} backend, and distrib distributes Keras objects on the torch backend "
            "only; set the environment variable KERAS_BACKEND=torch before keras is first imported "
            "(e.g. os.environ['KERAS_BACKEND'] = 'torch' at the top of the script)"
        )


def is_keras_layer(obj: object) -> bool:
    """Whether ``obj`` is a Keras layer (a model is one); False while keras is not imported."""
    if not keras_loaded():
        return False
    import keras

    return isinstance(obj, keras.layers.Layer)


def describe(obj: Any) -> str:
    """``'name' (Class)`` for a Keras object, ``Class`` for anything else: how errors name an object."""
    name = getattr(obj, "name", None) if is_keras_layer(obj) or hasattr(obj, "variables") else None
    return f"{name!r} ({type(obj).__name__})" if isinstance(name, str) else type(obj).__name__


def _variable_ids(layer: Any) -> frozenset[int]:
    return frozenset(id(v) for v in layer.variables)


def _contains(outer: Any, inner: Any) -> bool:
    """Whether Keras layer ``inner`` is part of ``outer`` (its variables a subset of ``outer``'s)."""
    mine, theirs = _variable_ids(inner), _variable_ids(outer)
    if not mine or not mine <= theirs:
        return False
    if mine != theirs:
        return True
    # the same variables: a model wrapping exactly one layer holds it (never the other way round)
    return any(layer is inner for layer in sublayers(outer))


def nested_layers(modules: Sequence[nn.Module]) -> set[int]:
    """The ids of the Keras layers among ``modules`` whose variables all belong to another Keras layer there."""
    layers = [m for m in modules if is_keras_layer(m)]
    if len(layers) < 2:
        return set()
    return {id(inner) for inner in layers if any(outer is not inner and _contains(outer, inner) for outer in layers)}


def sublayers(layer: Any) -> list[Any]:
    """Every Keras layer inside ``layer`` that is not among its torch submodules, depth first, in Keras' order.

    A model's layers (``model.layers``, public) are tracked by Keras, not registered with torch; a Keras layer
    assigned as an attribute is a torch submodule already. Both edges are followed, so a Sequential inside a custom
    layer inside a model is found. Deep copies list theirs in the same order: the lists of a model and of a
    replica's copy pair up.
    """
    torch_modules = {id(m) for m in layer.modules()}
    found: list[Any] = []
    seen: set[int] = set()

    def visit(node: nn.Module) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if id(node) not in torch_modules and is_keras_layer(node):
            found.append(node)
        for child in node.children():
            visit(child)
        for child in getattr(node, "layers", None) or []:
            if isinstance(child, nn.Module):
                visit(child)

    visit(layer)
    return found
