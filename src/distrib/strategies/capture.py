"""Modules and optimizers created under ``strategy.scope()``: which ones, for every kind of strategy.

While a scope is open, torch's global registration hooks tell us which modules receive
parameters, buffers or submodules; when the scope closes (or an optimizer is created inside
it, or ``run`` is called) the outermost of those modules, the *roots*, are handed to the
strategy's ``distribute_module``. No constructor is patched for modules. Optimizers have no
such hook, so ``torch.optim.Optimizer.__init__`` is wrapped while a scope is open (by
:mod:`distrib.torch_patches`, which holds every patch of a torch object), and an optimizer
built in the scope is handed to the strategy's ``distribute_optimizer`` (after the modules).

A strategy that defers initialisation (``ShardedStrategy`` with several workers: see
:mod:`distrib.strategies.deferred_record`) records the build while its scope is open, so the modules
handed over hold no data yet; every other strategy's modules are built as in plain PyTorch.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from distrib import context, torch_patches
from distrib.integrations import keras_models
from distrib.strategies import deferred_record

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["ModuleCapture", "install_capture_hooks", "remove_capture_hooks"]


class _CaptureState:
    """Process-wide hooks, installed once while any scope is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.handles: list[Any] = []


_capture = _CaptureState()


def _capturing_strategy() -> Strategy | None:
    if context.current_replica() is not None:
        return None
    return context.current_scope()


def _on_leaf_registered(module: nn.Module, name: str, value: Any) -> None:
    strategy = _capturing_strategy()
    if strategy is not None and value is not None:
        strategy.module_capture.saw(module)


def _on_module_registered(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    strategy = _capturing_strategy()
    if strategy is not None and child is not None:
        strategy.module_capture.saw(parent, child)


def _on_optimizer_built(self: torch.optim.Optimizer) -> None:
    strategy = _capturing_strategy()
    if strategy is not None and context.owner_of(self) is None:
        strategy.adopt_optimizer(self)


def install_capture_hooks() -> None:
    """Start capturing (nested scopes share one set of hooks); the current scope's strategy starts recording
    its build if it defers initialisation."""
    recorder = deferred_record.recorder_of(context.current_scope())
    if recorder is not None:
        recorder.open()
    with _capture.lock:
        _capture.depth += 1
        if _capture.depth > 1:
            return
        _capture.handles = [
            module_hooks.register_module_parameter_registration_hook(_on_leaf_registered),
            module_hooks.register_module_buffer_registration_hook(_on_leaf_registered),
            module_hooks.register_module_module_registration_hook(_on_module_registered),
        ]
        torch_patches.patch_optimizer_init(_on_optimizer_built)


def remove_capture_hooks() -> None:
    """Stop capturing once the outermost scope closes (and the current scope's recording of its build)."""
    recorder = deferred_record.recorder_of(context.current_scope())
    if recorder is not None:
        recorder.close()
    with _capture.lock:
        _capture.depth -= 1
        if _capture.depth > 0:
            return
        for h in _capture.handles:
            h.remove()
        _capture.handles = []
        torch_patches.restore_optimizer_init()


class ModuleCapture:
    """The modules one strategy saw being built in its scope, until they are claimed."""

    def __init__(self) -> None:
        self._seen: list[weakref.ref[nn.Module]] = []
        self._seen_ids: set[int] = set()
        self._children: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._seen)

    def saw(self, module: nn.Module, child: nn.Module | None = None) -> None:
        for m in (module, child):
            if m is not None and id(m) not in self._seen_ids:
                self._seen_ids.add(id(m))
                self._seen.append(weakref.ref(m))
        if child is not None:
            self._children.add(id(child))

    def take_roots(self) -> list[nn.Module]:
        """The outermost captured modules that hold parameters or buffers; forgets them all.

        A Keras layer inside a Keras model is part of the model though torch does not see it as a submodule
        (:func:`distrib.integrations.keras_models.nested_layers`): only the model is a root.
        """
        alive = [m for m in (r() for r in self._seen) if m is not None]
        roots = [
            m
            for m in alive
            if id(m) not in self._children
            and (next(m.parameters(), None) is not None or next(m.buffers(), None) is not None)
        ]
        nested = keras_models.nested_layers(roots)
        self._seen, self._seen_ids, self._children = [], set(), set()
        return [m for m in roots if id(m) not in nested]
