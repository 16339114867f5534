"""Every change distrib makes to a torch object, and every torch private it reads: here and nowhere else.

distrib prefers torch's public extension points: modules are captured in a scope by
``torch.nn.modules.module.register_module_*_registration_hook`` (``strategies/capture.py``), a
restored module refreshes its copies through ``register_load_state_dict_post_hook``, and the
check that an optimizer stepped inside ``run`` belongs to the strategy is torch's global
``register_optimizer_step_pre_hook``. Where no public hook suffices, the patch is in this module,
with the reason beside it, and is applied only while something needs it:

========================================  =====================================  =========================================
patch                                     applied                                removed
========================================  =====================================  =========================================
``GradScaler.unscale_/step/update``       a strategy with several replicas in    its strategy is garbage-collected
(class attributes) and the global         sync, or one that merges an            (reference count: the last lease
optimizer step pre-hook (public, but      optimizer's steps, is created /        ends it)
process-wide)                             merges its first optimizer
``torch.optim.Optimizer.__init__``        the outermost ``strategy.scope()``     that scope closes (reference count
(class attribute)                         is entered                             over nested / threaded scopes)
``optimizer.step`` / ``zero_grad``        an optimizer is built in the scope     never: they live and die with
(instance attributes, not the class;      of a strategy that merges its steps    that one optimizer instance
and ``optimizer.load_state_dict`` under   (or of a parameter-server strategy)
parameter servers)
``module.forward`` (instance attribute)   a module is distributed by a strategy  never: it lives and dies with
and a Keras model's ``model.zero_grad``   with copies for other local replicas   that one module instance
a dispatch mode (``TorchDispatchMode``,   a ``ShardedStrategy`` scope with       that scope closes
this thread's only) and the global        several workers is entered
module forward pre/post hooks (public)    (``strategies/deferred_record.py``)
========================================  =====================================  =========================================

``import distrib`` applies none of them (``tests/test_torch_untouched.py``), and
``tests/test_torch_assumptions.py`` pins what each patch assumes of torch, so a torch
upgrade that breaks one fails a named test. This table is the list of patches: docs/architecture.md's
table has a row for each, with why no public hook suffices (``tests/test_docs.py`` checks that they agree).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _python_dispatch

__all__ = [
    "StrategyPatches",
    "patch_optimizer_init",
    "restore_optimizer_init",
    "wrap_optimizer",
    "torch_unscale_",
    "torch_scaler_step",
    "torch_scaler_update",
    "scale_tensor",
    "found_inf_per_device",
    "set_found_inf_per_device",
    "mark_metric_updated",
    "replay_scale_update",
    "set_scale",
    "all_found_inf",
    "scaler_device",
    "set_enabled",
    "forget_step",
    "replace_load_state_dict",
    "route_forward",
    "route_zero_grad",
    "has_load_state_dict_pre_hooks",
    "queue_backward_callback",
    "group_backend",
    "sparse_parts",
    "fake_tensor_mode",
    "DISABLED_TORCH_FUNCTION",
    "TorchDispatchMode",
    "wrapper_tensor",
    "apply_inplace_view",
    "in_backward",
    "op_schema",
    "clear_cublas_workspaces",
    "module_tables",
]

#: torch's own methods, taken when this module is imported (which patches nothing)
_TORCH_UNSCALE = GradScaler.unscale_
_TORCH_STEP = GradScaler.step
_TORCH_UPDATE = GradScaler.update

ScalerMethod = Callable[..., Any]
OptimizerHook = Callable[[torch.optim.Optimizer, Any, Any], Any]


# --------------------------------------------------------------------------- GradScaler + the global step hook


class StrategyPatches:
    """``GradScaler``'s strategy-aware methods and the global optimizer pre-hook, leased by strategies.

    Why a patch: ``torch.amp.GradScaler`` has no hook at all. Under a strategy that merges
    ``optimizer.step()``, every replica thread calls ``scaler.unscale_/step/update`` on one
    scaler that keeps one state per optimizer per step; the calls must become merge points
    (the replica threads meet, the gradients are summed *before* torch's ``unscale_`` checks
    them, the inf flag is agreed over the workers, ``update`` runs once). A step pre-hook
    on the optimizer runs inside ``scaler.step``, after the scaler has already unscaled
    one replica's gradients and decided alone, so it comes too late. The scaler is the user's
    object, built outside any scope, so only its class can be reached.

    The optimizer pre-hook is torch's public ``register_optimizer_step_pre_hook``; being
    process-wide, it too is registered only while leased, and its handle removed after.

    :meth:`acquire` returns a release function; the first lease applies both, the last
    release restores torch's methods and removes the hook. Leases are counted under a lock.
    """

    def __init__(self, scaler_methods: dict[str, ScalerMethod], step_pre_hook: OptimizerHook) -> None:
        unknown = set(scaler_methods) - {"unscale_", "step", "update"}
        if unknown:
            raise ValueError(f"GradScaler methods distrib does not patch: {sorted(unknown)}")
        self._methods = dict(scaler_methods)
        self._hook = step_pre_hook
        self._lock = threading.Lock()
        self._leases = 0
        self._handle: Any | None = None
        self._saved: dict[str, Any] = {}

    def acquire(self) -> Callable[[], None]:
        """Take a lease (applying the patches if it is the first); call the result once to give it back."""
        with self._lock:
            self._leases += 1
            if self._leases == 1:
                self._saved = {name: GradScaler.__dict__[name] for name in self._methods}
                for name, fn in self._methods.items():
                    setattr(GradScaler, name, fn)
                self._handle = register_optimizer_step_pre_hook(self._hook)
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            self._release()

        return release

    def _release(self) -> None:
        with self._lock:
            self._leases -= 1
            if self._leases:
                return
            for name, fn in self._saved.items():
                setattr(GradScaler, name, fn)
            self._saved = {}
            if self._handle is not None:
                self._handle.remove()
                self._handle = None


def torch_unscale_(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """torch's own ``GradScaler.unscale_``, whether or not the class is patched now."""
    _TORCH_UNSCALE(scaler, optimizer)


def torch_scaler_step(scaler: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """torch's own ``GradScaler.step`` (it calls ``scaler.unscale_``, patched or not, unless already unscaled)."""
    return _TORCH_STEP(scaler, optimizer, *args, **kwargs)


def torch_scaler_update(scaler: GradScaler, new_scale: float | torch.Tensor | None = None) -> None:
    """torch's own ``GradScaler.update``."""
    _TORCH_UPDATE(scaler, new_scale)


# GradScaler privates. torch exposes no public view of a step's inf checks; the merged unscale_ must
# sum them over the workers and write back the agreed flag before torch's step reads it.


def scale_tensor(scaler: GradScaler) -> torch.Tensor | None:
    """The scaler's scale as torch holds it (``_scale``: a tensor on the scaler's device, None before first use)."""
    return scaler._scale


def found_inf_per_device(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """The inf flags ``unscale_`` recorded for ``optimizer`` this step (``_per_optimizer_states``), one per device."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def awaits_unscale(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's ``GradScaler.step`` would call ``unscale_`` for ``optimizer`` now: the scale exists, the
    stage is READY (``_per_optimizer_states``: not unscaled nor stepped this step), and the optimizer does not
    unscale inside its own step (``_step_supports_amp_scaling``: the fused ones)."""
    if scaler._scale is None or getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY


def set_found_inf_per_device(
    scaler: GradScaler, optimizer: torch.optim.Optimizer, flags: dict[torch.device, torch.Tensor]
) -> None:
    """Replace the inf flags torch's ``step``/``update`` will read for ``optimizer`` this step."""
    scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = flags


# --------------------------------------------------------------------------- Optimizer.__init__


class _OptimizerInit:
    """``torch.optim.Optimizer.__init__`` wrapped while some scope is open (counted; nested scopes share it).

    Why a patch: torch has global hooks for module registrations but none for an optimizer's
    creation, and a strategy must own (and, when it merges, wrap) every optimizer built in its
    scope before the user's first ``step``. ``register_optimizer_step_pre_hook`` fires only at the
    first step, too late to refuse an optimizer over foreign parameters at its construction,
    and it cannot replace the step (see :func:`wrap_optimizer`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.original: Callable[..., None] | None = None


_optimizer_init = _OptimizerInit()


def patch_optimizer_init(after_init: Callable[[torch.optim.Optimizer], None]) -> None:
    """Call ``after_init(optimizer)`` after each optimizer's construction, until :func:`restore_optimizer_init`.

    Counted: the first call patches, and each call needs its own restore. ``after_init`` is the
    one given by the first call (it must find the current scope itself).
    """
    with _optimizer_init.lock:
        _optimizer_init.depth += 1
        if _optimizer_init.depth > 1:
            return
        original = torch.optim.Optimizer.__dict__["__init__"]
        _optimizer_init.original = original

        def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            after_init(self)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign]


def restore_optimizer_init() -> None:
    """Undo one :func:`patch_optimizer_init`; the last one puts torch's ``__init__`` back."""
    with _optimizer_init.lock:
        _optimizer_init.depth -= 1
        if _optimizer_init.depth > 0:
            return
        if _optimizer_init.original is not None:
            torch.optim.Optimizer.__init__ = _optimizer_init.original  # type: ignore[method-assign]
            _optimizer_init.original = None


# --------------------------------------------------------------------------- one optimizer's step / zero_grad

StepFn = Callable[[torch.optim.Optimizer, Callable[..., Any], tuple, dict], Any]
ZeroGradFn = Callable[[torch.optim.Optimizer, Callable[..., None], bool], None]


def wrap_optimizer(optimizer: torch.optim.Optimizer, step: StepFn, zero_grad: ZeroGradFn) -> None:
    """Route one optimizer's ``step`` and ``zero_grad`` through its strategy (instance attributes only).

    Why a patch: the replica threads must meet inside ``optimizer.step()``, and the step must
    run once on the summed gradients (or, under parameter servers, be sent to the servers instead
    of running here). ``register_step_pre_hook`` / ``register_step_post_hook`` run around the
    original step on each calling thread; they can neither make it run once nor skip it.
    ``zero_grad`` must also clear the replicas' copies' gradients, which the optimizer does not
    hold. The class is untouched; the change lives and dies with this one instance.

    The replacements are bound methods so that ``torch.optim.lr_scheduler``, which re-wraps
    ``optimizer.step.__func__``, keeps working.
    """
    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad

    def distributed_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return step(self, original_step, args, kwargs)

    def distributed_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        zero_grad(self, original_zero_grad, set_to_none)

    optimizer.step = types.MethodType(distributed_step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(distributed_zero_grad, optimizer)  # type: ignore[method-assign]


def replace_load_state_dict(
    optimizer: torch.optim.Optimizer, load: Callable[[torch.optim.Optimizer, dict], None]
) -> None:
    """Make ``optimizer.load_state_dict(sd)`` call ``load(optimizer, sd)`` instead (this instance only).

    Why a patch: under parameter servers the optimizer's state lives on the servers; a load must
    send it there and update the groups' options in place, leaving ``optimizer.state`` empty.
    ``register_load_state_dict_pre_hook`` could send it and hand torch an empty state, but torch
    would then still replace every param group by a deep copy of the saved one (a different group
    dict, and saved tensors copied), which is not what distrib's load does. (``state_dict`` needs no
    patch: ``register_state_dict_post_hook`` fills in the servers' state.)
    """
    optimizer.load_state_dict = types.MethodType(load, optimizer)  # type: ignore[method-assign]


# --------------------------------------------------------------------------- one module's forward


def route_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    """Make calls of ``module`` (and ``module.forward``) run ``forward(module, ...)`` (this instance only).

    Why a patch: inside ``run`` each replica thread must compute on its own copy of the module.
    ``register_forward_pre_hook`` can change the inputs and ``register_forward_hook`` the output,
    but torch would still run the primary's own forward on every replica thread (each replica's
    gradient would land on the primary, and the work would be done twice). ``forward`` falls back
    to the class's forward outside ``run`` (and on replica 0 when it computes on the primary).
    """
    module.forward = types.MethodType(forward, module)


def route_zero_grad(module: torch.nn.Module, zero_grad: Callable[..., None]) -> None:
    """Make ``module.zero_grad(set_to_none)`` run ``zero_grad(module, set_to_none)`` (this instance only).

    Why a patch: Keras' guide for custom loops on torch clears gradients with ``model.zero_grad()`` in the step,
    which every replica thread runs; torch's would clear replica 0's parameters from every thread (one replica's
    call could erase another's fresh gradients) and never the replicas' copies. Modules have no zero_grad hook.
    """
    module.zero_grad = types.MethodType(zero_grad, module)  # type: ignore[method-assign]


def has_load_state_dict_pre_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule has a ``load_state_dict`` pre-hook (``_load_state_dict_pre_hooks``).

    Such a hook may rename or convert keys, so a checkpoint cannot check the keys beforehand; torch has
    no public view of a module's hooks.
    """
    return any(m._load_state_dict_pre_hooks for m in module.modules())


def optimizer_load_replaces_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.load_state_dict`` builds a new ``state`` from the tensors it is given and leaves the
    old state's tensors as they were (torch's own ``Optimizer.load_state_dict``, no load hooks registered).

    Then the old state's tensors are a rollback without a copy: a restore that fails later loads them back.
    A subclass's own ``load_state_dict``, one replaced on the instance (:func:`replace_load_state_dict`, the
    parameter servers') or a hook may write into the old tensors, so those are copied.
    torch has no public view of an optimizer's load hooks (``tests/test_torch_assumptions.py`` pins this).
    """
    load = getattr(optimizer.load_state_dict, "__func__", None)  # this instance's: replace_load_state_dict's too
    return (
        load is torch.optim.Optimizer.load_state_dict
        and not getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", True)
        and not getattr(optimizer, "_optimizer_load_state_dict_post_hooks", True)
    )


# --------------------------------------------------------------------------- torchmetrics privates


def mark_metric_updated(metric: Any) -> None:
    """Count one update on a torchmetrics ``Metric`` whose state was set from elsewhere.

    torchmetrics warns in ``compute()`` when ``_update_count`` is 0 ("called before update");
    a metric whose state arrived from the workers has seen updates there. No public setter exists.
    """
    if hasattr(metric, "_update_count"):
        metric._update_count += 1


# --------------------------------------------------------------------------- GradScaler state for parameter servers
# A coordinator's scaler replays its workers' update() outcomes with torch's own arithmetic, and a worker's copy
# starts each call from the coordinator's state; GradScaler offers no public setter for either.


def replay_scale_update(scaler: GradScaler, found_inf: float) -> None:
    """One ``update()`` with an inf count of ``found_inf`` (0: clean), as torch computes it.

    ``torch._amp_update_scale_`` backs the scale off, or counts a clean step and grows it every
    ``growth_interval`` clean steps, on the scaler's ``_scale`` and ``_growth_tracker`` (created first
    if the scaler has not scaled anything yet).
    """
    scale, tracker = _scale_and_tracker(scaler)
    flag = torch.full((), found_inf, dtype=torch.float32, device=scale.device)
    torch._amp_update_scale_(
        scale, tracker, flag, scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval
    )


def set_scale(scaler: GradScaler, value: float) -> None:
    """``update(new_scale=value)`` replayed: the scale tensor set in place."""
    scale, _ = _scale_and_tracker(scaler)
    scale.fill_(value)


def _scale_and_tracker(scaler: GradScaler) -> tuple[torch.Tensor, torch.Tensor]:
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(torch.device(scaler._device))
    scale, tracker = scaler._scale, scaler._growth_tracker
    assert scale is not None and tracker is not None, "initialized just above"
    return scale, tracker


def all_found_inf(scaler: GradScaler) -> list[torch.Tensor]:
    """Every inf flag ``unscale_`` recorded this step, over all optimizers and devices (none: not unscaled)."""
    return [f for state in scaler._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]


def scaler_device(scaler: GradScaler) -> str:
    """The device type the scaler was built for (``"cpu"``, ``"cuda"``): its copies on the workers are built alike."""
    return scaler._device


def set_enabled(scaler: GradScaler, enabled: bool) -> None:
    """Enable or disable a worker's copy as the coordinator's scaler is (no public setter exists)."""
    scaler._enabled = enabled


def forget_step(scaler: GradScaler) -> None:
    """Drop the per-optimizer state of a step a failed call left half done (``update()`` clears it normally)."""
    scaler._per_optimizer_states.clear()


# --------------------------------------------------------------------------- autograd, process groups, sparse tensors


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (on the thread that ran it).

    torch has no public API for "at the end of this backward": DDP's reducer and FSDP use the same
    engine call (``Variable._execution_engine.queue_callback``). Only valid while a backward runs.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def group_backend(group: Any, device: torch.device) -> Any:
    """The backend object (``ProcessGroupGloo``, ...) of ``group`` for ``device``.

    Setting one barrier's timeout needs the backend itself (``set_timeout``); ``torch.distributed``
    exposes only its name (``get_backend``).
    """
    return group._get_backend(device)


def sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values of a sparse COO ``tensor`` as stored, coalesced or not.

    The public ``indices()``/``values()`` refuse an uncoalesced tensor, and coalescing just to count
    its bytes would copy it.
    """
    return tensor._indices(), tensor._values()


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode``: tensors built under it have a dtype and a shape but no storage.

    ``sharded_export.consolidate`` writes the skeleton of a whole-model file with them under the
    public ``torch.serialization.skip_data(materialize_fake_tensors=True)`` (bytes filled in
    afterwards, tensor by tensor), so the export never holds the whole model; the mode itself
    lives in the private ``torch._subclasses``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


# --------------------------------------------------------------------------- deferred initialisation (sharded builds)

#: the ``__torch_function__`` a tensor subclass that works at the dispatch level sets, so torch's Python-level
#: functions (``nn.init.*``) see it as a plain tensor and its ``__torch_dispatch__`` receives the aten ops
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl

#: torch's base class of a dispatch mode (every aten op of this thread passes through it while entered); torch
#: documents it in its extending guide, but it lives in the private ``torch.utils._python_dispatch``
TorchDispatchMode = _python_dispatch.TorchDispatchMode


def wrapper_tensor(cls: type, like: torch.Tensor, device: torch.device, requires_grad: bool) -> Any:
    """A tensor of class ``cls`` with ``like``'s size, strides, offset and dtype on ``device``, and no data.

    ``strategies/deferred_record.py`` builds a sharded model's tensors as these: they report the device the
    plain build would have used (``nn.init`` skips meta tensors: ``if tensor.is_meta: return``), while their
    ``__torch_dispatch__`` records the ops. ``Tensor._make_wrapper_subclass`` is how torch's own DTensor and
    FakeTensor are made.
    """
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.size(),
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=like.dtype,
        device=device,
        requires_grad=requires_grad,
    )


def apply_inplace_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run an in-place view op (``t_``, ``transpose_``, ``unsqueeze_``: ``torch.Tag.inplace_view``) on a wrapper
    tensor's own metadata, dispatching nowhere: how ``torch.utils._python_dispatch.return_and_correct_aliasing``
    keeps a wrapper subclass's size and strides those of the tensor it stands for."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass (torch has no public way to ask)."""
    return torch._C._current_graph_task_id() != -1


def op_schema(func: Any) -> Any:
    """An aten op's ``FunctionSchema`` (which arguments it writes, what it returns); torch's own tensor subclasses
    read it the same way (``torch.utils._python_dispatch``), and ``OpOverload`` has no public name for it."""
    return func._schema


# --------------------------------------------------------------------------- CUDA graphs (ds.function)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces (torch keeps one per handle and stream, from the caching allocator).

    ``ds.function`` calls it right before and right after each capture (``graphs/cuda_graph.py``), as torch's own
    ``torch.compile`` CUDA graphs do (``torch/_inductor/cudagraph_trees.py``): a graph bakes in the address of
    the workspace its matmuls used. Captured with a workspace that eager work made on the same stream, the graph
    writes into memory the caching allocator later frees or hands to other tensors (the next capture frees
    cached memory first): an illegal memory access, or a segmentation fault, at a later replay.
    Cleared before, the capture allocates its own workspace inside the graph's private pool; cleared after, no
    eager matmul shares it. torch has no public name for it; a no-op where torch has no CUDA."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


def module_tables(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The dicts ``module`` keeps its own parameters, buffers and submodules in (``_parameters``, ``_buffers``,
    ``_modules``). ``ds.function``'s guard (``graphs/guards.py``) compares their entries by identity before every
    replay, in one pipeline of C calls; ``named_parameters(recurse=False)`` would be a Python generator per module."""
    return module._parameters, module._buffers, module._modules
