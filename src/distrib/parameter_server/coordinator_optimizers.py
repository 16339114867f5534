"""The optimizers built under a ``ParameterServerStrategy``'s scope, as the coordinator holds them.

Each one gets a twin beside every shard of its parameters, on the ps task holding that shard; the coordinator's
optimizer keeps no state of its own. What a user does with it on the coordinator still works as in plain
PyTorch: ``optimizer.step()`` pushes the local gradients to the twins, ``state_dict()`` gathers the twins'
state into whole tensors and ``load_state_dict()`` splits a saved state back over the current shards (so a
checkpoint moves between plain models and any number of ps tasks or shards). Options changed here (a
learning-rate schedule) travel to the workers with the next scheduled calls (:meth:`options`); an optimizer a
scheduled function names travels as its id and groups (:meth:`travel_tag`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from distrib.parameter_server.optimizer_state import gather_state, group_options, scatter_state
from distrib.parameter_server.variables import LocalVariable, ParameterClient, VariableSpec
from distrib.strategies.replication import optimizer_params
from distrib.torch_patches import replace_load_state_dict, wrap_optimizer

__all__ = ["CoordinatorOptimizers"]


class CoordinatorOptimizers:
    """The coordinator's optimizers of one strategy, each with its twins on the ps tasks.

    Args:
        session: the strategy's session id, the prefix of every optimizer id on the ps tasks.
        ps: the client of the ps tasks.
        variables: the strategy's placed parameters, by ``id`` of the coordinator's tensor (shared, not copied:
            the strategy adds to it as modules are placed).
    """

    def __init__(self, session: str, ps: ParameterClient, variables: dict[int, LocalVariable]) -> None:
        self._session = session
        self._ps = ps
        self._variables = variables
        self._optimizers: dict[int, tuple[torch.optim.Optimizer, str]] = {}

    def _spec(self, p: torch.Tensor) -> VariableSpec:
        return self._variables[id(p)].spec

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """Create ``optimizer``'s twins on the ps tasks and route its step and state dicts through them.

        Args:
            optimizer: an optimizer built under the strategy's scope.

        Raises:
            ValueError: some of its parameters were not placed on the ps tasks.
        """
        foreign = [p for p in optimizer_params(optimizer) if id(p) not in self._variables]
        if foreign:
            raise ValueError(
                f"{type(optimizer).__name__} was created under ParameterServerStrategy.scope() over {len(foreign)} "
                "parameter(s) not placed on the ps tasks; build the model inside the same strategy.scope()"
            )
        opt_id = f"{self._session}/opt{len(self._optimizers)}"
        entries = [(self._spec(p), group_options(group)) for group in optimizer.param_groups for p in group["params"]]
        self._ps.create_optimizer(opt_id, cloudpickle.dumps(type(optimizer)), entries)
        self._optimizers[id(optimizer)] = (optimizer, opt_id)
        wrap_optimizer(optimizer, self._step, lambda opt, zero_grad, set_to_none: zero_grad(set_to_none))
        # torch's public hook: the servers' state replaces the (empty) local one in every state_dict()
        optimizer.register_state_dict_post_hook(lambda opt, sd: self._state_dict(opt, opt_id, sd))
        replace_load_state_dict(optimizer, lambda opt, state_dict: self._load_state_dict(opt, opt_id, state_dict))

    def _step(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``optimizer.step()`` called on the coordinator itself: push its local gradients."""
        closure = kwargs.get("closure", args[0] if args else None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [
            (self._variables[id(p)], p.grad, g)
            for g, group in enumerate(optimizer.param_groups)
            for p in group["params"]
            if p.grad is not None
        ]
        if items:
            self._ps.push(self._optimizers[id(optimizer)][1], items, [group_options(g) for g in optimizer.param_groups])
        return loss

    def options(self) -> dict[str, list[dict[str, Any]]]:
        """Every optimizer's current options per group: optimizer id -> one dict (``lr``, ...) per group."""
        return {
            opt_id: [group_options(g) for g in optimizer.param_groups]
            for optimizer, opt_id in self._optimizers.values()
        }

    def travel_tag(self, obj: Any) -> tuple[Any, ...] | None:
        """How ``obj`` travels in a scheduled function when it is one of these optimizers (its id and groups: the
        worker rebuilds it over the ps tasks' twins); None for any other object."""
        entry = self._optimizers.get(id(obj))
        if entry is None or entry[0] is not obj:
            return None
        groups = [(group_options(g), [self._spec(p) for p in g["params"]]) for g in obj.param_groups]
        return ("opt", entry[1], groups)

    def _state_dict(self, optimizer: torch.optim.Optimizer, opt_id: str, sd: dict) -> dict:
        """``optimizer.state_dict()``'s post-hook: torch's dict, its ``state`` read from the ps tasks."""
        sd["state"] = gather_state(optimizer, opt_id, self._spec, self._ps)
        return sd

    def _load_state_dict(self, optimizer: torch.optim.Optimizer, opt_id: str, state_dict: dict) -> None:
        scatter_state(optimizer, opt_id, self._spec, self._ps, state_dict)
