"""What makes two calls of a ``ds.function`` the same: its input signature (tf.function's ``input_signature``).

Tensors count by shape, dtype, device and ``requires_grad`` (their values are copied into the captured
buffers at each call); every other argument counts by its value, as tf.function treats a Python argument:
a new value is a new capture (``training=True`` then ``training=False`` are two graphs). A value that cannot
be hashed counts by identity. The structure (which tuple, list, dict) counts too.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from distrib.values import PerReplica

__all__ = ["Inputs", "flatten_inputs", "describe", "quick_key"]


@dataclass(frozen=True)
class Inputs:
    """A call's arguments taken apart: the tensor leaves (in order), the rest, and the key of the signature."""

    leaves: list[Any]
    spec: pytree.TreeSpec
    tensor_positions: tuple[int, ...]
    key: Hashable
    has_per_replica: bool

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensor arguments, in order."""
        return [self.leaves[i] for i in self.tensor_positions]

    def with_leaves(self, leaves: list[Any]) -> Inputs:
        """The same signature with another call's leaves (of a call whose :func:`quick_key` matched this one's)."""
        return Inputs(leaves, self.spec, self.tensor_positions, self.key, self.has_per_replica)


def _leaf_key(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad, leaf.layout)
    if isinstance(leaf, PerReplica):
        return ("per_replica", tuple(_leaf_key(v) for v in leaf.values))
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf), id(leaf))
    return ("value", type(leaf), leaf)


def flatten_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Inputs:
    """``args`` and ``kwargs`` as leaves and a key: equal keys mean a captured graph can replay the call.

    Example::

        >>> a = flatten_inputs((torch.zeros(2, 3), 5), {})
        >>> a.key == flatten_inputs((torch.ones(2, 3), 5), {}).key     # other values, same signature
        True
        >>> a.key == flatten_inputs((torch.zeros(1, 3), 5), {}).key    # a shorter batch: a new signature
        False
        >>> a.key == flatten_inputs((torch.zeros(2, 3), 6), {}).key    # a Python argument counts by value
        False
    """
    leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, PerReplica))
    positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    key = (spec, tuple(_leaf_key(leaf) for leaf in leaves))
    return Inputs(leaves, spec, positions, key, any(isinstance(leaf, PerReplica) for leaf in leaves))


def quick_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Hashable, list[Any]] | None:
    """A cheap key and the leaves of the common call: positional tensors, or plain tuples/lists of tensors.

    torch's Python pytree costs tens of microseconds a call, as much as the replay of a small step's graph
    costs the host; this walk costs a few. Two calls with equal quick keys have equal :func:`flatten_inputs`
    keys, and the leaves come in pytree's order. Any other call (keyword arguments, Python values,
    namedtuples, ``PerReplica``) returns None and takes the full path.

        >>> key, leaves = quick_key(((torch.zeros(2), torch.zeros(3)),), {})
        >>> key == quick_key(((torch.ones(2), torch.ones(3)),), {})[0], len(leaves)
        (True, 2)
        >>> quick_key((torch.zeros(2), 5), {}) is None
        True
    """
    if kwargs:
        return None
    leaves: list[Any] = []
    structure: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            leaves.append(arg)
            structure.append(None)
        elif type(arg) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in arg):
            leaves.extend(arg)
            structure.append((type(arg), len(arg)))
        else:
            return None
    key = (tuple(structure), tuple((t.shape, t.dtype, t.device, t.requires_grad, t.layout) for t in leaves))
    return key, leaves


def describe(inputs: Inputs) -> str:
    """The signature in words, for messages: ``(Tensor[64, 1, 28, 28] float32 cuda:0, Tensor[64] int64 cuda:0)``."""
    parts = []
    for leaf in inputs.leaves:
        if isinstance(leaf, torch.Tensor):
            dtype = str(leaf.dtype).replace("torch.", "")
            parts.append(f"Tensor{list(leaf.shape)} {dtype} {leaf.device}")
        elif isinstance(leaf, PerReplica):
            parts.append(f"PerReplica({len(leaf.values)} values)")
        elif callable(leaf):
            parts.append(getattr(leaf, "__qualname__", type(leaf).__name__))
        else:
            parts.append(repr(leaf) if len(repr(leaf)) < 40 else type(leaf).__name__)
    return "(" + ", ".join(parts) + ")"
