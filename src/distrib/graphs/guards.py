"""What a ``ds.function`` graph assumes beyond its input signature, checked where it can change.

A graph replays kernels on fixed memory with the host's values of its capture. Two kinds of assumption follow,
each checked here (torch's own anchors: the guards ``torch/_dynamo/guards.py`` installs on the objects a frame
reads, and the static-input pointer checks of ``torch/_inductor/cudagraph_trees.py``):

* **the host decides nothing inside the step** (:class:`HostWatch`, around the last warm-up call): a tensor's
  value read on the host (``.item()``, ``bool(t)``, ``float(t)``), a random draw on the host (Python's
  ``random``, numpy's global generator, a CPU ``torch.rand``) and an LR scheduler's ``step()`` would each be the
  capture's at every replay. Each is found with the line that did it, and the signature runs eagerly;
* **the objects and memory it reads and writes are still the step's** (:class:`StateWatch`, before each
  replay): the modules, optimizers, tensors and metric objects the step reaches (through its globals, closure
  variables, arguments and the attributes it names), each parameter, buffer and optimizer state tensor as the
  same object on the same storage. A model rebuilt and rebound, a buffer updated out of place
  (``self.ema = self.ema * m + x``), a metric whose ``reset()`` swaps in new tensors, ``p.data = ...`` or
  ``module.to(...)`` would otherwise leave the graph training the old objects, or writing into freed memory.
  Anything replaced means new warm-up calls and a new capture, with one warning naming what changed.

Both checks look at what the step *reaches*: a tensor reached another way (through a subscript of a container
the step does not name) is not seen; the module docstring of :mod:`~distrib.graphs.step_function` says so.
"""

from __future__ import annotations

import functools
import operator
import random
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.optim.lr_scheduler as lr_scheduler

from distrib import torch_patches
from distrib.graphs.cuda_graph import HOST_READS, backend, user_line

__all__ = ["HostWatch", "StateWatch", "reached_objects"]

_TORCH_OPTIM = torch.optim.__file__.rsplit("/", 1)[0]
_SCHEDULER_FILE = lr_scheduler.__file__
_GLOBAL_RANDOM: Any = getattr(random.random, "__self__", None)  # the module's functions are its methods
#: aten ops that draw random numbers (on the host, a CPU generator's draw is fixed at capture)
_RANDOM_OPS = ("rand", "bernoulli", "normal", "uniform", "multinomial", "exponential", "geometric", "cauchy",
               "log_normal", "random_", "poisson", "dropout")  # fmt: skip


class HostWatch(torch_patches.TorchDispatchMode):
    """Around the last warm-up call: notes where the step lets the host decide something a replay would repeat.

    A dispatch mode sees host reads of tensors and random ops on host memory; a profile function
    (``sys.setprofile``, this thread, only for this call) sees Python's ``random`` generators and LR schedulers'
    ``step``, which no dispatch mode can see; the states of Python's and numpy's global generators are compared
    before and after (numpy's compiled methods escape a profile function, and other threads escape both).
    :attr:`found` lists each as a sentence, with its line where known.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, None] = {}  # ordered, each once
        self._host_type = backend().host_type
        self._previous_profile: Any = None
        self._random_state: Any = None
        self._numpy_state: Any = None

    def __enter__(self) -> HostWatch:
        self._random_state = random.getstate()
        self._numpy_state = _numpy_state()
        self._previous_profile = sys.getprofile()
        if self._previous_profile is None:  # a profiler of the user's own is left alone (the state check remains)
            sys.setprofile(self._profile)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._previous_profile is None:
            sys.setprofile(None)
        if random.getstate() != self._random_state and not any("random module" in f for f in self.found):
            self.found["the step draws from Python's random module (on another thread)"] = None
        if _numpy_state() != self._numpy_state and not any("numpy" in f for f in self.found):
            self.found[  # numpy's generators are compiled methods, which a profile function does not see called
                "the step draws from numpy's global random generator (np.random.*): decided once at capture, then "
                "the same at every replay; draw on the device (torch.rand((), device=...)) and keep the choice "
                "there (torch.where), or decide outside the ds.function and pass the choice as an argument"
            ] = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if name.startswith(HOST_READS):
            caller = sys._getframe(1)
            if not _inside(caller, _TORCH_OPTIM):  # an optimizer's own read of a CPU step count: made capturable
                self.found[
                    f"the step reads a tensor's value on the host at {user_line(2)} (.item(), bool(t), float(t), an "
                    "`if` on a tensor): a graph would replay the value read at capture; keep the decision on the "
                    "device (torch.where) or move it out of the ds.function"
                ] = None
        elif self._host_type is not None and any(op in name for op in _RANDOM_OPS):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.device.type == self._host_type:
                self.found[
                    f"the step draws random numbers on the host at {user_line(2)} ({name}): a graph would replay the "
                    "capture's draw; draw them on the device (device=...)"
                ] = None
            return out
        return func(*args, **(kwargs or {}))

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_name == "step" and code.co_filename == _SCHEDULER_FILE:
                scheduler = type(frame.f_locals.get("self")).__name__
                self.found[
                    f"the step calls {scheduler}.step() at {user_line(2)}: a graph replays the rate of its capture "
                    "and the schedule stops; call scheduler.step() after the ds.function's call, outside it (the "
                    "rate stays live there)"
                ] = None
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, random.Random):
                what = "Python's random module" if owner is _GLOBAL_RANDOM else "a random.Random"
            elif type(owner).__module__.startswith("numpy.random"):
                what = "numpy's random generator"
            else:
                return
            self.found[
                f"the step draws from {what} at {user_line(2)}: decided once at capture, then the same at every "
                "replay; draw on the device (torch.rand((), device=...)) and keep the choice there (torch.where), "
                "or decide outside the ds.function and pass the choice as an argument"
            ] = None


def _numpy_state() -> Any:
    """numpy's global generator's state (None where numpy was never imported: nothing can have drawn from it)."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    _, key, position, has_gauss, gauss = numpy.random.get_state()
    return key.tobytes(), position, has_gauss, gauss


def _inside(frame: types.FrameType | None, folder: str) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(folder):
            return True
        frame = frame.f_back
    return False


# ---------------------------------------------------------------------------------------------- reached objects
def _stateful(value: Any) -> bool:
    """An object whose tensors a graph reads or writes: a module, an optimizer, a tensor, or a user object (a
    metric, a trainer) holding tensors or modules (torch's and distrib's own helpers are left out: their internal
    tensors, a GradScaler's per-step flags, change by design; distrib's metrics are in)."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
        return True
    if isinstance(value, (type, types.ModuleType, types.FunctionType)) or not hasattr(value, "__dict__"):
        return False
    owner = type(value).__module__
    if owner.startswith(("torch", "distrib.")) and not owner.startswith("distrib.metrics"):
        return False
    try:
        attributes = vars(value)
    except TypeError:
        return False
    return any(_holds_tensors(v) for v in attributes.values())


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return True
    return isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values())


def _names_of(code: types.CodeType) -> set[str]:
    """Every global and attribute name a code object (and the functions defined in it) loads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_of(const)
    return names


#: a place that holds a reached object: (a dict and its key) or (a closure cell, None), with the object's name
Slot = tuple[Any, Any, Any, str]


def reached_objects(fn: Callable[..., Any], arguments: Iterable[Any] = ()) -> list[Slot]:
    """Where the step finds its stateful objects: ``(container, key, object, name)`` for each global, closure
    variable and attribute it names that holds one (following the functions it names, three levels deep), and for
    its arguments' attributes (a method's ``self``)."""
    slots: list[Slot] = []
    seen_functions: set[int] = set()
    seen_objects: set[int] = set()
    pending_objects: list[tuple[Any, str]] = []
    names: set[str] = set()

    def visit(f: Any, depth: int) -> None:
        inner = getattr(f, "python_function", None)  # a ds.function inside the step
        if inner is not None and callable(inner):
            f = inner
        if isinstance(f, functools.partial):
            for a in f.args:
                visit(a, depth)
            f = f.func
        if isinstance(f, types.MethodType):
            pending_objects.append((f.__self__, type(f.__self__).__name__))
            f = f.__func__
        if not isinstance(f, types.FunctionType) or id(f) in seen_functions or depth > 3:
            return
        seen_functions.add(id(f))
        own = _names_of(f.__code__)
        names.update(own)
        for name in own:
            if name in f.__globals__:
                take(f.__globals__, name, f.__globals__[name], name, depth)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not assigned yet
                continue
            take(cell, None, value, name, depth)

    def take(container: Any, key: Any, value: Any, name: str, depth: int) -> None:
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)) or hasattr(
            value, "python_function"
        ):
            visit(value, depth + 1)
        elif _stateful(value):
            slots.append((container, key, value, name))
            if not isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
                pending_objects.append((value, name))

    visit(fn, 0)
    for arg in arguments:
        if not isinstance(arg, torch.Tensor) and hasattr(arg, "__dict__") and not isinstance(arg, type):
            pending_objects.append((arg, type(arg).__name__))
    while pending_objects:  # the attributes the step names, of the objects it reaches
        obj, name = pending_objects.pop()
        if id(obj) in seen_objects or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            continue
        seen_objects.add(id(obj))
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        for attr in names & attributes.keys():
            take(attributes, attr, attributes[attr], f"{name}.{attr}", 1)
    return slots


# ------------------------------------------------------------------------------------------------ the state watch
class StateWatch:
    """The objects and storages one signature's graphs read and write, as they were at capture.

    :meth:`replaced` runs before every replay: one identity compare per place (a ``_parameters`` entry, an
    optimizer's state tensor, a metric's state, a global), as one pipeline of C calls, then the modules'
    tensors' ``data_ptr``; the names are only built when something changed.
    """

    def __init__(self, slots: list[Slot], modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]) -> None:
        named: list[tuple[Any, Any, Any, str]] = []
        roots: dict[int, str] = {}
        for container, key, value, name in slots:
            named.append((container, key, value, f"`{name}`"))
            roots.setdefault(id(value), name)
        module_list = list(modules) + [v for _, _, v, _ in slots if isinstance(v, torch.nn.Module)]
        named_modules = _module_names(module_list, roots)
        for module, prefix in named_modules.items():
            for container in torch_patches.module_tables(module):
                for key, value in container.items():
                    if value is not None:
                        named.append((container, key, value, f"{prefix}{key}"))
            for key, value in vars(module).items():  # plain tensor attributes (torchmetrics' states)
                if isinstance(value, torch.Tensor):
                    named.append((vars(module), key, value, f"{prefix}{key}"))
        param_names = {
            id(p): f"{prefix}{k}" for m, prefix in named_modules.items() for k, p in m.named_parameters(recurse=False)
        }
        optimizer_list = list(optimizers) + [v for _, _, v, _ in slots if isinstance(v, torch.optim.Optimizer)]
        for optimizer in dict.fromkeys(optimizer_list):
            label = roots.get(id(optimizer), type(optimizer).__name__)
            named.append((vars(optimizer), "state", optimizer.state, f"{label}.state"))
            for p, state in optimizer.state.items():
                pname = param_names.get(id(p), f"a parameter of shape {list(p.shape)}")
                named.append((optimizer.state, p, state, f"{label}'s state of {pname}"))
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        named.append((state, key, value, f"{label}'s {key} of {pname}"))
        for _, _, value, name in slots:  # a metric's or trainer's tensors, and those in its dict attributes
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
                continue
            for key, item in vars(value).items():
                if isinstance(item, torch.Tensor):
                    named.append((vars(value), key, item, f"{name}.{key}"))
                elif isinstance(item, dict):
                    for k, v in item.items():
                        if isinstance(v, torch.Tensor):
                            named.append((item, k, v, f"{name}.{key}[{k!r}]"))
        self._named = named
        # one flat pipeline of C calls at each replay: operator.getitem over (container, key) pairs, operator.is_
        # against the captured objects (a Python loop per container cost ~0.5 us each, 16 of them for a small CNN)
        pairs = [(c, k, v) for c, k, v, _ in named if k is not None]
        self._containers = [c for c, _, _ in pairs]
        self._keys = [k for _, k, _ in pairs]
        self._values = [v for _, _, v in pairs]
        self._cells = [(c, v) for c, k, v, _ in named if k is None]
        # storages: the modules' parameters and buffers (what p.data = ... and module.to(...) swap); optimizer and
        # metric state objects are replaced, not given new storage, and the identity check sees that
        tensors: dict[int, tuple[torch.Tensor, str]] = {}
        for module, prefix in named_modules.items():
            for table in torch_patches.module_tables(module)[:2]:
                for key, value in table.items():
                    if value is not None:
                        tensors.setdefault(id(value), (value, f"{prefix}{key}"))
        self._tensors = [t for t, _ in tensors.values()]
        self._tensor_names = [n for _, n in tensors.values()]
        self._ptrs = list(map(_data_ptr, self._tensors))

    def replaced(self) -> str | None:
        """None while every reached object and storage is the captured one; else what changed, in words."""
        try:
            if not all(map(operator.is_, map(operator.getitem, self._containers, self._keys), self._values)):
                return self._describe()
        except KeyError:
            return self._describe()
        for cell, value in self._cells:
            if cell.cell_contents is not value:
                return self._describe()
        if list(map(_data_ptr, self._tensors)) != self._ptrs:
            return self._describe()
        return None

    def _describe(self) -> str:
        changed: list[str] = []
        for container, key, value, name in self._named:
            try:
                current = container.cell_contents if key is None else container[key]
            except (KeyError, ValueError):
                changed.append(f"{name} (removed)")
                continue
            if current is not value:
                changed.append(f"{name} (another {type(current).__name__})")
        for tensor, name, ptr in zip(self._tensors, self._tensor_names, self._ptrs):
            if _data_ptr(tensor) != ptr:
                changed.append(f"{name} (another storage: p.data = ..., module.to(...))")
        if not changed:
            return "the reached state"
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        return ", ".join(changed[:4]) + more


_data_ptr = torch.Tensor.data_ptr


def _module_names(modules: Iterable[torch.nn.Module], roots: dict[int, str]) -> dict[torch.nn.Module, str]:
    """Every module reached and every submodule, with a dotted prefix for messages (``model.0.``)."""
    names: dict[torch.nn.Module, str] = {}
    for module in modules:
        if module in names:
            continue
        root = roots.get(id(module), type(module).__name__)
        for sub_name, sub in module.named_modules():
            names.setdefault(sub, f"{root}.{sub_name}." if sub_name else f"{root}.")
    return names
