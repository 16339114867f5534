"""Optimizers inside a captured step: made capturable, their hyperparameters watched, their state's replacement seen.

A CUDA graph replays the kernels it recorded with the values it recorded. Three things of an optimizer
would therefore be frozen at capture, and each is handled here:

* **the step count**: torch's Adam family keeps ``state["step"]`` on the CPU unless ``capturable=True``,
  so its bias correction would stay that of the captured step. :func:`make_capturable` sets
  ``capturable=True`` (the optimizer's own, documented option) and moves existing step counts to the
  parameters' device;
* **the learning rate**: a float is baked into the kernels. Where the optimizer takes a tensor rate
  (the capturable Adam family), it becomes a one-element tensor on the device, which torch's schedulers
  fill in place; a float written into ``group["lr"]`` afterwards (a hand-written schedule, Keras'
  callbacks) is copied into that tensor before the next replay (:meth:`OptimizerWatch.sync`). Every other
  hyperparameter (and the rate of an optimizer that takes no tensor) is part of the graph's guard: a
  change is a new capture, as a new Python argument retraces a tf.function. Betas and momentum stay Python
  numbers: torch's capturable Adam reads tensor betas on the host (``_foreach_pow(beta1, steps)``,
  ``addcmul_(value=1 - beta2)``), which a graph would bake in;
* **the state tensors**: ``load_state_dict`` (a checkpoint restore) replaces them with the tensors read,
  and the graph would go on updating the old ones. A load post-hook (torch's public
  ``register_load_state_dict_post_hook``) counts the loads; a graph captured before a load is dropped and
  captured again.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch

from distrib.graphs.cuda_graph import backend

__all__ = ["make_capturable", "undo_capturable", "OptimizerWatch", "state_version"]

_versions: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
#: what make_capturable changed, per optimizer: each group's (capturable, learning rate) as they were
_originals: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[bool, Any]]] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
#: every optimizer's loads together: unchanged since a guard was built, no state version changed (one int compare
#: per replay instead of a weak-key lookup per optimizer)
_all_loads = [0]


def state_version(optimizer: torch.optim.Optimizer) -> int:
    """How many times ``optimizer.load_state_dict`` has replaced its state since distrib started watching it."""
    return _versions.get(optimizer, 0)


def _count_load(optimizer: torch.optim.Optimizer) -> None:
    _versions[optimizer] = _versions.get(optimizer, 0) + 1
    _all_loads[0] += 1
    make_capturable(optimizer)  # the state read may hold CPU step counts and a CPU rate


def _watch_loads(optimizer: torch.optim.Optimizer) -> None:
    if optimizer not in _hooked:
        optimizer.register_load_state_dict_post_hook(_count_load)
        _hooked.add(optimizer)


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return None


def make_capturable(optimizer: torch.optim.Optimizer) -> list[str]:
    """Prepare ``optimizer`` for a CUDA graph; returns what was changed, in words (for the log).

    ``capturable=True`` where the optimizer has that option; existing ``step`` counts moved to the
    parameters' device; the learning rate a device tensor where the optimizer then takes one.
    """
    changed: list[str] = []
    _watch_loads(optimizer)
    device = _device_of(optimizer)
    if device is None or device.type != backend().device_type or "capturable" not in optimizer.defaults:
        return changed  # CUDA graphs only: elsewhere the optimizer stays as it was built
    name = type(optimizer).__name__
    _originals.setdefault(optimizer, [(bool(g.get("capturable")), g["lr"]) for g in optimizer.param_groups])
    if not all(group.get("capturable") for group in optimizer.param_groups):
        changed.append(f"{name}(capturable=True)")
    optimizer.defaults["capturable"] = True
    for group in optimizer.param_groups:
        group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):  # the fused kernels take a device rate too
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
            if f"{name}: lr as a device tensor" not in changed:
                changed.append(f"{name}: lr as a device tensor")
        elif group["lr"].device != device:  # a rate read from a checkpoint onto the CPU
            group["lr"] = group["lr"].to(device, torch.float32)
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
    return changed


def undo_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Put back what :func:`make_capturable` changed (a capture that failed: the step runs eagerly, as it was built):
    ``capturable`` as it was, the learning rate a float again (the one given, unless a schedule changed it since)."""
    originals = _originals.pop(optimizer, None)
    if originals is None or len(originals) != len(optimizer.param_groups):
        return
    for group, (was_capturable, lr) in zip(optimizer.param_groups, originals):
        group["capturable"] = was_capturable
        rate = group["lr"]
        if isinstance(rate, torch.Tensor) and not isinstance(lr, torch.Tensor):
            value = float(rate)
            group["lr"] = lr if value == float(torch.tensor(float(lr), dtype=torch.float32)) else value
        if not was_capturable and not group.get("fused"):
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                    optimizer.state[p]["step"] = step.cpu()
    optimizer.defaults["capturable"] = all(was for was, _ in originals)


_SCALAR_TYPES = frozenset({bool, int, float, str, type(None)})


def _frozen(value: Any) -> bool:
    # the exact types first: this runs for every hyperparameter at every replay
    if type(value) in _SCALAR_TYPES:
        return True
    return isinstance(value, (bool, int, float, str, type(None))) or (
        isinstance(value, tuple) and all(_frozen(v) for v in value)
    )


class OptimizerWatch:
    """The optimizers one graph steps: their tensor rates kept in sync, their other hyperparameters guarded.

    :meth:`current_guard` runs before every replay, where a small step's whole host budget is a few tens of
    microseconds: it first checks, in C (``operator.itemgetter``, ``operator.is_``), that every group holds the
    very objects it held at the last call, and rebuilds the guard only when one changed.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        #: held, not weakly: the graph steps their state, which must live as long as the graph (a step that
        #: reaches its optimizer through a global rebound since would otherwise free it under the graph)
        self._optimizers = list(optimizers)
        self._rates: list[tuple[dict[str, Any], torch.Tensor]] = [
            (group, group["lr"])
            for o in optimizers
            for group in o.param_groups
            if isinstance(group["lr"], torch.Tensor)
        ]
        #: the last guard, and what it was built from: each optimizer's groups, their keys and values
        self._snapshot: list[Any] = []
        self._loads = -1
        self._guard: Hashable = None
        self.guard = self.current_guard()

    def sync(self) -> None:
        """Copy a float written into ``group["lr"]`` since the last call into the captured rate tensor."""
        for group, rate in self._rates:
            value = group["lr"]
            if value is not rate:
                rate.fill_(float(value))
                group["lr"] = rate

    def current_guard(self) -> Hashable:
        """What the graph baked in: per optimizer, its state version and its groups' non-tensor hyperparameters."""
        if self._unchanged():
            return self._guard
        parts: list[Any] = []
        snapshot: list[Any] = []
        for o in self._optimizers:
            groups = list(o.param_groups)
            own: list[Any] = [state_version(o)]
            entries = []
            for group in groups:
                own.append(tuple([(k, v) for k, v in group.items() if k != "params" and _frozen(v)]))
                keys = tuple(group)
                values_of = _values_of(keys)
                entries.append((group, keys, values_of, values_of(group)))
            parts.append(tuple(own))
            snapshot.append((groups, entries))
        self._snapshot, self._guard, self._loads = snapshot, tuple(parts), _all_loads[0]
        return self._guard

    def host_set(self) -> list[tuple[torch.Tensor, str]]:
        """The rate tensors the host fills before each replay, each with its name (``Adam's lr (param group 0)``)."""
        named = []
        for o in self._optimizers:
            for i, group in enumerate(o.param_groups):
                if any(group is g for g, _ in self._rates):
                    named.append((group["lr"], f"{type(o).__name__}'s lr (param group {i})"))
        return named

    def difference(self, old: Hashable, new: Hashable) -> list[str]:
        """What differs between two guards, in words: ``SGD's lr (param group 0)``, ``Adam's state (a load)``."""
        if not isinstance(old, tuple) or not isinstance(new, tuple) or len(old) != len(new):
            return ["the optimizers"]
        out: list[str] = []
        for o, before, after in zip(self._optimizers, old, new):
            name = type(o).__name__
            if before[0] != after[0]:
                out.append(f"{name}'s state (load_state_dict)")
            if len(before) != len(after):
                out.append(f"{name}'s param groups")
                continue
            for i, (b, a) in enumerate(zip(before[1:], after[1:])):
                keys = sorted({k for k, v in set(b) ^ set(a)})
                out.extend(f"{name}'s {k} (param group {i})" for k in keys)
        return out

    def _unchanged(self) -> bool:
        """Whether every optimizer holds the same groups, keys and value objects as when the guard was built."""
        if self._loads != _all_loads[0]:  # a load since (or no guard built yet: -1)
            return False
        for o, (groups, entries) in zip(self._optimizers, self._snapshot):
            if len(o.param_groups) != len(groups):
                return False
            if not all(map(operator.is_, o.param_groups, groups)):
                return False
            for group, keys, values_of, values in entries:
                if len(group) != len(keys):
                    return False
                try:
                    if not all(map(operator.is_, values_of(group), values)):
                        return False
                except KeyError:  # a key replaced by another
                    return False
        return True


def _values_of(keys: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A group's values for ``keys``, as a tuple, in C (``operator.itemgetter``; a group of one key gets a tuple too)."""
    if len(keys) == 1:
        key = keys[0]
        return lambda group: (group[key],)
    getter: Any = operator.itemgetter  # typed through Any: mypy 2.4 crashes expanding itemgetter(*keys)
    return cast(Callable[[dict[str, Any]], tuple[Any, ...]], getter(*keys))
