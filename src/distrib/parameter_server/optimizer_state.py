"""Optimizer state of a sharded variable: gathered into whole tensors, and split back.

Each shard's optimizer keeps torch's usual per-parameter state (``sum`` for Adagrad,
``exp_avg``/``exp_avg_sq``/``step`` for Adam, ...). A checkpoint must hold the state
of the *whole* parameter, so it restores into a plain optimizer on one device:
state tensors shaped like the shard are concatenated along dim 0; anything else
(the ``step`` counter) is taken as the largest value over the shards, since a shard
that received no sparse gradient in a step does not count it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from distrib.parameter_server.variables import VariableSpec

__all__ = ["gather_state", "group_options", "merge_shard_states", "scatter_state", "split_state"]


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


def group_options(group: dict) -> dict:
    """A parameter group's options (``lr``, ``betas``, ...): the group without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def gather_state(
    optimizer: torch.optim.Optimizer, opt_id: str, spec_of: Callable[[torch.Tensor], VariableSpec], ps: Any
) -> dict[int, Any]:
    """The ``state`` of ``optimizer.state_dict()``, read from the ps tasks: whole tensors, by parameter index."""
    state = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            spec = spec_of(p)
            merged = merge_shard_states(spec, ps.optimizer_state(opt_id, spec))
            if merged:
                state[index] = merged
            index += 1
    return state


def scatter_state(
    optimizer: torch.optim.Optimizer,
    opt_id: str,
    spec_of: Callable[[torch.Tensor], VariableSpec],
    ps: Any,
    state_dict: dict,
) -> None:
    """``optimizer.load_state_dict(state_dict)`` for an optimizer whose state lives on the ps tasks.

    Raises:
        ValueError: the saved groups do not match this optimizer's (number of groups or of parameters).
    """
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
    ):
        raise ValueError(
            "loaded optimizer state has a different number of parameter groups or parameters "
            f"({[len(s['params']) for s in saved_groups]}) than this optimizer "
            f"({[len(g['params']) for g in groups]})"
        )
    saved_state = state_dict.get("state", {})
    for group, saved in zip(groups, saved_groups):
        group.update(group_options(saved))
        for p, key in zip(group["params"], saved["params"]):
            spec = spec_of(p)
            state = saved_state.get(key, saved_state.get(str(key), {}))
            ps.set_optimizer_state(opt_id, spec, split_state(spec, state), group_options(group))
