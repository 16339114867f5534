"""Which blocks of a model become FSDP units (``fully_shard`` calls) under ``ShardedStrategy``.

A unit's parameters are gathered together before its forward and freed (resharded) after, so
units bound the memory a step holds beyond the shards: the largest unit's full parameters. The
root module is always a unit too (it holds whatever no other unit took).

* ``ShardingPolicy(module_classes=["TransformerBlock"])``: every submodule of those classes (by
  class name or class), as Lightning's ``FSDPStrategy(auto_wrap_policy={Block})`` and Accelerate's
  ``transformer_layer_cls_to_wrap``. A named class that the model does not contain is an error
  naming it and listing the classes it does contain ("could not find the layer class to wrap").
* ``ShardingPolicy(min_params=N)`` (the default, N = 100,000): size-based, as torch's
  ``size_based_auto_wrap_policy``: in post-order, a submodule becomes a unit when the parameters it
  holds that no unit below it took reach ``N``.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(500, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))
    >>> [type(m).__name__ for m in ShardingPolicy().units(model)]  # 250,500 parameters: a unit; 5,010: not
    ['Linear']
    >>> ShardingPolicy(module_classes=["Block"]).units(model)
    Traceback (most recent call last):
    ...
    ValueError: ShardingPolicy(module_classes=['Block']): the model (Sequential) has no module of class Block; its classes are Linear, ReLU, Sequential
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["ShardingPolicy"]

#: the default size of a size-based unit, in parameters (torch's size_based_auto_wrap_policy says 1e8 for
#: GPUs; on CPUs with gloo smaller units overlap communication with compute better and still stay coarse)
DEFAULT_MIN_PARAMS = 100_000


@dataclass(frozen=True)
class ShardingPolicy:
    """Which submodules are FSDP units: by class (``module_classes``) or by size (``min_params``).

    Give it to ``ShardedStrategy(sharding_policy=...)`` (or ``MeshStrategy``): the units bound the memory a
    step holds beyond the shards, since a unit's parameters are gathered whole around its forward and
    backward (see the module docstring).

    Attributes:
        module_classes: every submodule of these classes (class names, ``"TransformerBlock"``, or classes)
            becomes a unit; None: by size.
        min_params: with ``module_classes`` None, a submodule becomes a unit when the parameters it holds that
            no unit below it took reach this many (torch's ``size_based_auto_wrap_policy``).
    """

    module_classes: Sequence[str | type] | None = None
    min_params: int = DEFAULT_MIN_PARAMS

    def units(self, root: nn.Module) -> list[nn.Module]:
        """The submodules of ``root`` (not ``root`` itself) to shard as units, innermost first.

        Args:
            root: the model built in the strategy's scope.

        Returns:
            The units, the deepest first (the order ``fully_shard`` needs: nested units before their parents);
            ``root`` itself is never among them (the strategy always shards it last).

        Raises:
            ValueError: a class of ``module_classes`` is not in ``root`` (the message lists those it has).
        """
        if self.module_classes is not None:
            return self._by_class(root)
        return self._by_size(root)

    def _by_class(self, root: nn.Module) -> list[nn.Module]:
        wanted = list(self.module_classes or [])
        found = [m for m in root.modules() if m is not root and any(_is(m, c) for c in wanted)]
        missing = [c for c in wanted if not any(_is(m, c) for m in root.modules())]
        if missing:
            names = ", ".join(c if isinstance(c, str) else c.__name__ for c in missing)
            classes = ", ".join(sorted({type(m).__name__ for m in root.modules()}))
            raise ValueError(
                f"ShardingPolicy(module_classes={[c if isinstance(c, str) else c.__name__ for c in wanted]})"
                f": the model ({type(root).__name__}) has no module of class {names}; its classes are "
                f"{classes}"
            )
        depth = {id(m): name.count(".") for name, m in root.named_modules()}
        return sorted(found, key=lambda m: -depth[id(m)])  # fully_shard goes bottom-up: nested units first

    def _by_size(self, root: nn.Module) -> list[nn.Module]:
        units: list[nn.Module] = []
        taken: set[int] = set()

        def visit(module: nn.Module) -> None:
            for child in module.children():
                visit(child)
            if module is root:
                return
            free = [p for p in module.parameters() if id(p) not in taken]
            if sum(p.numel() for p in free) >= self.min_params:
                units.append(module)
                taken.update(id(p) for p in free)

        visit(root)
        return units


def _is(module: nn.Module, cls: str | type) -> bool:
    return type(module).__name__ == cls if isinstance(cls, str) else isinstance(module, cls)
