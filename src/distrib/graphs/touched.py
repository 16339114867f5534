"""What a ``ds.function`` step touches at its warm-up calls: the strategies it runs, the optimizers it steps, the
modules it calls.

The step is plain Python, so what its graph must track (the ``.grad`` state of which parameters, which
optimizers to make capturable, which modules' ``train()``/``eval()`` modes to guard) is learnt by watching an
eager call through torch's public global hooks (``register_optimizer_step_pre_hook``,
``register_module_forward_pre_hook``) and distrib's own run observers, not by reading the step's source. Every
object is held weakly: a model or optimizer the user drops is not kept alive by a function that saw it once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distrib import context

__all__ = ["Touched"]


class Touched:
    """What a step's warm-up calls touched: strategies, optimizers stepped, modules run (weakly held)."""

    def __init__(self) -> None:
        self.strategies: weakref.WeakSet[Any] = weakref.WeakSet()
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn``, noting what it touches through torch's public global hooks."""
        hooks = [
            register_optimizer_step_pre_hook(self._optimizer_stepped),
            register_module_forward_pre_hook(self._module_ran),
        ]
        context.run_observers.append(self.strategies.add)
        try:
            return fn(*args, **kwargs)
        finally:
            context.run_observers.remove(self.strategies.add)
            for h in hooks:
                h.remove()

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.add(optimizer)

    def _module_ran(self, module: torch.nn.Module, args: Any) -> None:
        self.modules.add(module)

    def params(self) -> list[torch.Tensor]:
        """Every parameter of the optimizers and modules seen (each once): the ``.grad`` states a graph tracks."""
        found: dict[int, torch.Tensor] = {}
        for o in self.optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    found.setdefault(id(p), p)
        for m in self.modules:
            for p in m.parameters(recurse=False):
                found.setdefault(id(p), p)
        return list(found.values())
