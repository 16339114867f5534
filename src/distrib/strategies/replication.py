"""Per-replica copies of the modules a replica engine distributes (captured by :mod:`~distrib.strategies.capture`).

A root module is the primary copy, on the first local device. Every
other local replica gets a copy: on the same physical device the copy's parameters
share storage with the primary's (separate autograd leaves, so separate ``.grad``),
so an update to the primary is seen by every copy for free; on another device the
copy is a real one, refreshed after each update. Calling the module (or any of its
submodules) inside ``run`` dispatches to the calling replica's copy.

Owners live in :mod:`distrib.context`'s weak-key registry and copies in
:class:`MirroredModules`; the only change to a module is its ``forward`` (an instance
attribute that dispatches by replica, set on modules a strategy with several local replicas
distributes), and to an optimizer whose steps merge, its ``step`` and ``zero_grad``
(:func:`distrib.torch_patches.wrap_optimizer`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from distrib import context, torch_patches
from distrib.integrations import keras_models

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["MirroredModules", "optimizer_params"]


# --------------------------------------------------------------------------- copies


@dataclass(frozen=True)
class _Mirror:
    """The copies the local replicas call in place of one submodule.

    ``copies[k]`` serves local replica ``k + 1`` when the primary computes (replica 0 calls the module
    itself), else local replica ``k``. The module itself is not held: this is ``_mirrors``' value for it,
    and a strong reference there would keep module and strategy alive forever.
    """

    owner: Strategy
    copies: tuple[nn.Module, ...]
    primary_computes: bool  # replica 0 computes on the module itself (Mirrored) or on a copy (central storage)


_mirrors: weakref.WeakKeyDictionary[nn.Module, _Mirror] = weakref.WeakKeyDictionary()


def _dispatching_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    mirror = _mirrors.get(self)
    ctx = context.current_replica()
    if (
        mirror is not None
        and ctx is not None
        and ctx.strategy is mirror.owner
        and (ctx.local_replica_id or not mirror.primary_computes)
    ):
        replica = mirror.copies[ctx.local_replica_id - mirror.primary_computes]
        for mine, theirs in zip(self.modules(), replica.modules()):
            theirs.training = mine.training  # model.train()/eval() was called on the primary only
        return replica.forward(*args, **kwargs)
    return type(self).forward(self, *args, **kwargs)  # a copy.deepcopy of the module lands here too


def _dispatching_zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    """A Keras model's ``zero_grad``: on a replica thread, that replica's copy; outside ``run``, every copy too."""
    mirror = _mirrors.get(self)
    ctx = context.current_replica()
    if mirror is None or ctx is None or ctx.strategy is not mirror.owner:
        type(self).zero_grad(self, set_to_none)
        for replica in mirror.copies if mirror is not None else ():
            replica.zero_grad(set_to_none)
        return
    if ctx.local_replica_id or not mirror.primary_computes:
        mirror.copies[ctx.local_replica_id - mirror.primary_computes].zero_grad(set_to_none)
    if ctx.local_replica_id == 0:  # the primary's gradients: replica 0's own, or (central storage) the last sums
        type(self).zero_grad(self, set_to_none)


def _bypasses_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` may not reach its ``forward``: its class defines its own ``__call__``.

    A Keras layer does, and reaches ``forward`` through ``nn.Module.__call__`` (keras' torch ``layer.py``); so do
    torch's own classes that override it.
    """
    call = type(module).__call__
    if call is nn.Module.__call__ or keras_models.is_keras_layer(module):
        return False
    # torch's own overrides reach forward (fx's GraphModule, torch.compile's OptimizedModule) or refuse to be called
    # at all (ParameterDict, ParameterList)
    return not getattr(call, "__module__", "").startswith("torch.")


def _refuse_primary_gradients(module: nn.Module, owner: Strategy, primary_computes: bool) -> None:
    """Raise when a replica that computes on a copy accumulates a gradient into ``module``'s own parameters.

    Each replica computes on its own copy because its ``forward`` is dispatched; a ``__call__`` that computes
    without ``forward`` uses replica 0's parameters on every replica. The check runs where autograd accumulates
    (``register_post_accumulate_grad_hook``, public), on the replica's thread: CPU backward runs there. (CUDA's
    backward runs on torch's device threads, where it does not; there replica 0's parameters sit on another device
    than the replica's inputs, which torch refuses.)
    """
    owner_ref = weakref.ref(owner)
    label = f"{type(module).__name__}"

    def check(param: torch.Tensor) -> None:
        ctx = context.current_replica()
        if ctx is None or ctx.strategy is not owner_ref():
            return
        if ctx.local_replica_id or not primary_computes:
            raise RuntimeError(
                f"module {label} defines its own __call__, which computed without calling forward() on replica "
                f"{ctx.replica_id_in_sync_group}: distrib gives each replica its copy of a module through forward "
                f"(what nn.Module.__call__ calls), so this replica computed on replica 0's parameters instead of "
                f"its own copy. Move the computation into {label}.forward() and let nn.Module.__call__ "
                "call it (a __call__ override that calls super().__call__(...) works too)"
            )

    for param in module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(check)


class MirroredModules:
    """The root modules a strategy mirrors, and each parameter's copies on the replicas.

    Mirrored (``parameter_device=None``): the primary lives on the first replica's device
    and replica 0 computes on it; replicas 1..n-1 get copies. Central storage
    (``parameter_device`` given): the primary lives on that device and every replica
    computes on a copy of its own; gradients are summed from all copies into the primary.
    """

    def __init__(self, strategy: Strategy, parameter_device: torch.device | None = None) -> None:
        self._strategy = strategy
        self._parameter_device = parameter_device
        self._first = 0 if parameter_device is not None else 1  # local replica id of the first copy
        # (root, its copies): the root weakly, so that a strategy and the modules it distributed are freed once the
        # user drops them (context's owner registry and _mirrors hold the strategy from the module's side)
        self._roots: list[tuple[weakref.ref[nn.Module], list[nn.Module]]] = []
        # primary parameter -> its copies, one per replica that does not compute on the primary; held by the
        # parameter's identity and weakly, so that a model freed does not leave its ids to a later model's
        # parameters (a new model in the same scope was taken for one sharing the old one's parameters)
        self._param_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __contains__(self, param: object) -> bool:
        return param in self._param_copies

    @property
    def central(self) -> bool:
        """True when no replica computes on the primary (central storage): gradients always need merging."""
        return not self._first

    def distribute(self, root: nn.Module) -> None:
        """Place ``root`` (on the parameter device, or the first local one) and give replicas their copies."""
        owner = context.owner_of(root)
        if owner is not None:
            if owner is not self._strategy:
                raise ValueError(
                    f"module {type(root).__name__} is already distributed by another strategy; "
                    "build a new module under this strategy's scope"
                )
            return
        for sub in root.modules():
            if context.owner_of(sub) is not None:
                raise ValueError(
                    f"module {type(root).__name__} contains {type(sub).__name__}, which was built in an "
                    "earlier strategy.scope() block; build the whole model inside one scope block"
                )
        params = list(root.parameters())
        taken = [p for p in params if p in self._param_copies]
        if taken:
            raise ValueError(
                f"module {keras_models.describe(root)} shares {len(taken)} parameter(s) with a module this strategy "
                "already distributes; each replica would compute on a different copy of them and one copy's gradient "
                "would be lost. Hold both in one parent module (e.g. an nn.ModuleDict or a Keras model) built in "
                "the scope, and call them through it"
            )
        devices = self._strategy.local_devices
        home = self._parameter_device or devices[0]
        if home is not None:
            root.to(home)
        copies = [self._replicate(root, d) for d in devices[self._first :]]
        for p in params:
            self._param_copies[p] = []
        for c in copies:
            for p, pc in zip(params, c.parameters()):
                self._param_copies[p].append(pc)
        keras_parts = keras_models.sublayers(root)
        if copies:
            pairs = [(sub, [c.get_submodule(name) for c in copies]) for name, sub in root.named_modules()]
            copy_parts = [keras_models.sublayers(c) for c in copies]
            pairs += [(sub, [parts[i] for parts in copy_parts]) for i, sub in enumerate(keras_parts)]
            if keras_models.is_keras_layer(root):
                torch_patches.route_zero_grad(root, _dispatching_zero_grad)
            for sub, sub_copies in pairs:
                _mirrors[sub] = _Mirror(self._strategy, tuple(sub_copies), primary_computes=bool(self._first))
                torch_patches.route_forward(sub, _dispatching_forward)
                if _bypasses_forward(sub):
                    _refuse_primary_gradients(sub, self._strategy, primary_computes=bool(self._first))
        for sub in [*root.modules(), *keras_parts]:
            context.set_owner(sub, self._strategy)
        root.register_load_state_dict_post_hook(lambda module, keys: self.refresh(module))
        self._roots.append((weakref.ref(root), copies))

    @staticmethod
    def _replicate(root: nn.Module, device: torch.device | None) -> nn.Module:
        # a Keras layer's deep copy registers its parameters anew: not a module built in the scope
        with context.detached():
            clone = copy.deepcopy(root)
        pairs = list(zip(root.parameters(), clone.parameters()))
        if len(pairs) != len(list(clone.parameters())) or not all(
            p.shape == pc.shape and torch.equal(p.detach(), pc.detach()) for p, pc in pairs
        ):  # each copy's parameters are paired with the module's by order: a copy that lists them otherwise
            raise ValueError(
                f"module {keras_models.describe(root)}: its deep copy lists its parameters in another order (or "
                "number), so a replica's gradients could not be paired with the model's; with a Keras model, use "
                "keras>=3.4.1 (pip install 'distrib[keras]')"
            )
        if device is not None:
            clone.to(device)
        for p, pc in zip(root.parameters(), clone.parameters()):
            pc.grad = None
            if pc.device == p.device and not _replica_state(root, p):
                pc.data = p.data
        return clone

    def replica_grads(self, param: torch.Tensor) -> list[torch.Tensor | None]:
        """The gradients of ``param``'s copies (the replicas that do not compute on ``param`` itself)."""
        return [pc.grad for pc in self._param_copies.get(param, ())]

    def zero_copy_grads(self, params: Iterable[torch.Tensor], replica: int | None, set_to_none: bool) -> None:
        """Clear the gradients of the copies of ``params`` (of one local replica, or of all if None)."""
        for p in params:
            copies = self._param_copies.get(p, ())
            if replica is None:
                chosen = list(copies)
            else:
                index = replica - self._first
                chosen = [copies[index]] if 0 <= index < len(copies) else []
            for pc in chosen:
                if pc.grad is None:
                    continue
                if set_to_none:
                    pc.grad = None
                else:
                    pc.grad.detach_().zero_()

    def refresh(self, root: nn.Module | None = None, average_buffers: bool = False) -> None:
        """Make every copy equal to its primary again (after an update or a restore).

        Parameters that share storage need nothing. Floating buffers (e.g. BatchNorm
        running statistics) are averaged over the computing replicas first when ``average_buffers``, and so are a
        Keras model's non-trainable variables (its BatchNormalization's moving statistics: torch parameters without
        gradients, which each replica's copy keeps apart), as TF's mirrored variables of aggregation MEAN.
        """
        with torch.no_grad():
            for ref, copies in self._roots:
                r = ref()
                if r is None or not copies or (root is not None and r is not root):
                    continue
                for p, *pcs in zip(r.parameters(), *(c.parameters() for c in copies)):
                    if average_buffers and _replica_state(r, p):
                        _average_into(p, [p, *pcs] if self._first else pcs)
                    for pc in pcs:
                        if pc.data_ptr() != p.data_ptr():
                            pc.copy_(p)
                for b, *bcs in zip(r.buffers(), *(c.buffers() for c in copies)):
                    if average_buffers and b.is_floating_point():
                        _average_into(b, [b, *bcs] if self._first else bcs)
                    for bc in bcs:
                        if bc.data_ptr() != b.data_ptr():
                            bc.copy_(b)


def _replica_state(root: nn.Module, param: torch.Tensor) -> bool:
    """Whether each replica's copy of ``param`` keeps its own values (averaged after each step): a Keras model's
    non-trainable variable, which its layers assign in the forward (a torch module's such state is a buffer)."""
    return not param.requires_grad and param.is_floating_point() and keras_models.is_keras_layer(root)


def _average_into(target: torch.Tensor, computed: Sequence[torch.Tensor]) -> None:
    """Set ``target`` to the mean of ``computed`` (the values the computing replicas hold)."""
    total = computed[0].detach().clone().to(target.device)
    for value in computed[1:]:
        total += value.detach().to(target.device)
    target.copy_(total / len(computed))


# --------------------------------------------------------------------------- optimizers


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter an optimizer updates, in group order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
