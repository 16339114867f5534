"""Optimizer state of a sharded variable: gathered into whole tensors, and split back.

Each shard's optimizer keeps torch's usual per-parameter state (``sum`` for Adagrad,
``exp_avg``/``exp_avg_sq``/``step`` for Adam, ...). A checkpoint must hold the state
of the *whole* parameter, so it restores into a plain optimizer on one device:
state tensors shaped like the shard are concatenated along dim 0; anything else
(the ``step`` counter) is taken as the largest value over the shards, since a shard
that received no sparse gradient in a step does not count it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distrib.parameter_server.variables import VariableSpec

__all__ = ["merge_shard_states", "split_state"]


def _shard_shape(spec: VariableSpec, index: int) -> tuple[int, ...]:
    s = spec.shards[index]
    return (s.stop - s.start, *spec.shape[1:]) if spec.shape else ()


def _is_row_state(spec: VariableSpec, value: Any, index: int) -> bool:
    return isinstance(value, torch.Tensor) and bool(spec.shape) and tuple(value.shape) == _shard_shape(spec, index)


def merge_shard_states(spec: VariableSpec, states: Sequence[dict]) -> dict:
    """One state dict for the whole variable from the state dicts of its shards."""
    keys: list[str] = []
    for state in states:
        keys.extend(k for k in state if k not in keys)
    merged: dict[str, Any] = {}
    for key in keys:
        values = [state.get(key) for state in states]
        present = [(i, v) for i, v in enumerate(values) if v is not None]
        i0, first = present[0]
        if _is_row_state(spec, first, i0):
            parts = [
                v if v is not None else torch.zeros(_shard_shape(spec, i), dtype=first.dtype)
                for i, v in enumerate(values)
            ]
            merged[key] = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
        elif isinstance(first, torch.Tensor) and first.dim() == 0:
            merged[key] = max((v for _, v in present), key=lambda t: t.item()).clone()
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            merged[key] = max(v for _, v in present)
        else:
            merged[key] = first
    return merged


def split_state(spec: VariableSpec, state: dict) -> list[dict]:
    """The state dict of every shard of ``spec`` from the state dict of the whole variable."""
    out: list[dict] = [{} for _ in spec.shards]
    for key, value in state.items():
        whole = isinstance(value, torch.Tensor) and bool(spec.shape) and tuple(value.shape) == spec.shape
        for i in range(len(spec.shards)):
            out[i][key] = spec.shard_view(value, i).clone() if whole else value
    return out
