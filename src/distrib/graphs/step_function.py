"""``ds.function``: tf.function's counterpart. The whole step (forward, backward, the gradients' reduction, the
optimizer's update, metric updates, ``strategy.reduce``) is captured once as a CUDA graph and replayed.

As the seeds write it::

    @ds.function
    def distributed_train_step(batch):
        per_replica = strategy.run(train_step, args=(batch,))
        return strategy.reduce("sum", per_replica, axis=None)

What happens at each call (tf.function's words in brackets):

* the arguments' **signature** decides (:mod:`~distrib.graphs.signature`): tensors by shape, dtype and device,
  other arguments by value. A new signature is a new graph [a retrace]: the last, shorter batch of an epoch
  gets its own;
* a signature's first ``warmup_steps`` calls run **eagerly**, as real steps (they create the optimizer's
  state and let cuDNN and cuBLAS settle, as PyTorch's capture recipe asks). The next call is **captured**
  [traced] and replayed; every later call copies its tensors into the graph's buffers and **replays** it;
* **Python side effects** (``print``, appending to a list, a counter) run at the warm-up calls and at the
  capture, then never again [TF: "Python side effects only happen once, when the function is traced"];
  tensors are recomputed at every call. Python values the step reads (a float attribute, ``len(list)``)
  are those of the capture [TF: captured Python values are constants]. Module ``train()``/``eval()``
  modes, ``requires_grad`` of every parameter, the ``.grad`` state, optimizer hyperparameters and the loads of
  optimizer state are the graph's **guard**: a change picks or makes another graph; learning rates stay live
  (:mod:`~distrib.graphs.capturable`). A baked-in value that changes at nearly every call (SGD's rate under a
  per-step schedule, Adam's betas under ``OneCycleLR``) makes the signature eager, naming it;
* before each replay the graph checks that the modules, optimizers, metrics and tensors the step reaches are
  the objects and storages it captured (:mod:`~distrib.graphs.guards`): a model rebuilt and rebound, a metric
  whose ``reset()`` swaps its tensors, ``p.data = ...`` or ``module.to(...)`` means new warm-up calls and a new
  capture, with one warning naming what changed;
* where a graph cannot be captured (CPU, gloo, several replicas in one process, a host sync in the step, a
  host read or host random choice, an LR scheduler's ``step()`` or an out-of-place update of state inside the
  step) the signature runs **eagerly**, and the first call logs why once, with the line
  (:mod:`~distrib.graphs.paths`, :mod:`~distrib.graphs.guards`). ``max_captures`` bounds the graphs one
  function holds; past it, a call that needs another graph runs eagerly, with a warning naming what changed
  [TF warns about frequent retracing], and ``paths()`` says so. ``reduce_retracing=True`` captures one graph
  per structure and dtypes: other shapes (the last batch) run eagerly. The graphs of one function share one
  memory pool (:mod:`~distrib.graphs.cuda_graph`).

The guards look at what the step names (its globals, closure variables, arguments and their attributes); state
reached in other ways (an element of a list or dict the step indexes) is not seen, which is why ``fit``'s
``jit_compile="auto"`` and ``distrib train`` leave ``ds.function`` off unless asked for.

Inside ``strategy.run`` (``ds.function`` on the replica function, as TF allows) or inside another
``ds.function`` the function is simply called: it is part of the outer step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, overload

import torch
import torch.utils._pytree as pytree

from distrib import context
from distrib.graphs import capturable, cuda_graph, guards, paths
from distrib.graphs.cuda_graph import CapturedGraph, CaptureError
from distrib.graphs.signature import Inputs, describe, flatten_inputs, quick_key
from distrib.graphs.touched import Touched

__all__ = ["Function", "function"]

log = logging.getLogger("distrib.function")
F = TypeVar("F", bound=Callable[..., Any])
_said: set[str] = set()  # the messages logged so far (each once per process)
_tracing = [0]  # >0 while a ds.function warms up or captures on this process: nested ones are called as they are
_MISSED = object()  # no graph of a signature fits the call's state: warm up, capture or run eagerly instead
_training = operator.attrgetter("training")


#: a graph's guard: the modules' train/eval modes, the optimizers' baked hyperparameters, grad mode, requires_grad
Guard = tuple[tuple[bool, ...], Hashable, bool, tuple[bool, ...]]
_requires_grad = operator.attrgetter("requires_grad")
#: a baked value that changes again within this many replays of its graph, twice in a row, makes the signature eager
_CHURN_REPLAYS, _CHURN_TIMES = 2, 2


class _Signature:
    """One input signature of a :class:`Function` (tf.function's concrete function): its path and graphs."""

    def __init__(self, owner: Function, inputs: Inputs) -> None:
        self.owner = owner
        self.description = describe(inputs)
        self.warmups_left = owner.warmup_steps
        self.eager_reason: str | None = paths.input_blocker(inputs) if owner.mode != "eager" else "mode='eager'"
        #: why the last call ran eagerly although this signature holds graphs (max_captures, reduce_retracing)
        self.fallback: str | None = None
        #: (guard at entry, the graph, the modules' train/eval modes it leaves where they differ from the entry's)
        self.graphs: list[tuple[Guard, CapturedGraph, tuple[bool, ...] | None]] = []
        self.last: tuple[Guard, CapturedGraph] | None = None  # the latest capture
        self.churn = 0  # captures in a row whose predecessor was replaced almost at once
        self.seen = Touched()
        self.device: torch.device | None = None
        self.watch: capturable.OptimizerWatch | None = None
        self.state: guards.StateWatch | None = None
        self.modules: list[torch.nn.Module] = []
        self.params: list[torch.Tensor] = []
        #: whether a warm-up call left other .grad tensors than it found (new ones): its graphs get a private memory
        #: pool, since tensors they leave behind could sit where another graph keeps its temporaries (cuda_graph)
        self.leaves_new_grads = False

    def call(self, inputs: Inputs) -> Any:
        if self.eager_reason is not None:
            return self.owner.eager(inputs)
        if self.warmups_left > 0:
            return self._warm_up(inputs)
        return self._graph_call(inputs)

    def _warm_up(self, inputs: Inputs) -> Any:
        self.warmups_left -= 1
        last = self.warmups_left == 0
        graphs = cuda_graph.backend()
        device = paths.capture_device(inputs, self.seen.strategies, self.seen.params()) if graphs.available() else None
        syncs: list[str] = []
        known = self.seen.params()
        entry = {id(p): p.grad for p in known}
        watch = guards.HostWatch() if last and graphs.available() else None
        before = self._reached(inputs) if last and known else None
        _tracing[0] += 1
        try:
            with contextlib.ExitStack() as stack:
                if device is not None:  # PyTorch's recipe: warm up on a side stream, lazy set-up off the captured one
                    stack.enter_context(graphs.side_stream(device))
                    stack.enter_context(paths.host_syncs(syncs, watch=last))
                if watch is not None:
                    stack.enter_context(watch)
                result = self.seen.run(self.owner.python_function, *inputs_args(inputs))
        finally:
            _tracing[0] -= 1
        params = self.seen.params()
        self.leaves_new_grads |= any(p.grad is not None and p.grad is not entry.get(id(p)) for p in params)
        reason = paths.strategy_blocker(inputs, self.seen.strategies, params) or paths.sync_blocker(syncs)
        if reason is None and watch is not None and watch.found:
            reason = "; ".join(watch.found)
        if reason is None and before is not None:
            replaced = before.replaced()
            if replaced is not None:
                reason = _out_of_place(replaced)
        if reason is not None:  # known at the first call: say it then
            self._run_eagerly(reason)
            if not graphs.available():
                self.owner.always_eager = True
        elif last:
            self._prepare_capture(inputs, params)
        return result

    def _reached(self, inputs: Inputs) -> guards.StateWatch:
        """The state the step reaches now (its globals, closure, arguments; the modules and optimizers it ran)."""
        slots = guards.reached_objects(self.owner.python_function, inputs.leaves)
        return guards.StateWatch(slots, list(self.seen.modules), list(self.seen.optimizers))

    def _prepare_capture(self, inputs: Inputs, params: list[torch.Tensor]) -> None:
        # the warm-up calls stepped the optimizers as built; from the capture on they count on the device
        for optimizer in self.seen.optimizers:
            changed = capturable.make_capturable(optimizer)
            if changed:
                log.info("ds.function: %s, so that its step can be captured", ", ".join(changed))
        self.device = paths.capture_device(inputs, self.seen.strategies, params)
        self.watch = capturable.OptimizerWatch(list(self.seen.optimizers))
        self.modules = list(self.seen.modules)
        self.params = params
        self.state = self._reached(inputs)

    def _run_eagerly(self, reason: str) -> None:
        if self.owner.mode == "cuda_graph":
            raise CaptureError(
                f"ds.function({self.owner.name}, mode='cuda_graph'): cannot capture the signature "
                f"{self.description}: {reason}"
            )
        self.eager_reason = reason
        self.graphs, self.last = [], None
        self.owner.say_once(f"ds.function({self.owner.name}): runs eagerly for {self.description}: {reason}")
        if self.owner.captures == 0:  # no graph of this function steps them: they train as they were built
            for optimizer in self.seen.optimizers:
                capturable.undo_capturable(optimizer)

    def _restart(self, replaced: str) -> None:
        """The state the graphs were captured on was replaced: drop them, warm up and capture again (the new
        objects may have no optimizer state yet), saying once what changed."""
        short = self.last is not None and self.last[1].replays < _CHURN_REPLAYS
        self.churn = self.churn + 1 if short else 0
        if self.churn >= _CHURN_TIMES:
            self._run_eagerly(
                f"{replaced} is replaced at every call: each time is new warm-up calls and a new capture, so this "
                "signature runs eagerly from now on (update that state in place: tensor.copy_(...), "
                "metric.reset_state())"
            )
            return
        self.owner.say_once(
            f"ds.function({self.owner.name}): {replaced} changed since the capture for {self.description}: the "
            "graphs are dropped and the step is warmed up and captured again on the new state"
        )
        self.graphs, self.last = [], None
        self.warmups_left = self.owner.warmup_steps
        self.seen = Touched()
        self.state = None

    def _guard(self) -> Guard:
        assert self.watch is not None
        self.watch.sync()
        return (
            tuple(map(_training, self.modules)),
            self.watch.current_guard(),
            torch.is_grad_enabled(),
            tuple(map(_requires_grad, self.params)),
        )

    def replay(self, leaves: list[Any]) -> Any:
        """Replay the graph made for the current state with these tensor leaves; ``_MISSED`` where none is (then
        :meth:`call` warms up, captures or runs eagerly). The hot path of every call: a small step's graph replays
        in ~0.3 ms, and each microsecond here is a third of a percent of it."""
        if self.eager_reason is not None or self.warmups_left > 0:
            return _MISSED
        guard = self._guard()
        for graph_guard, graph, modes in self.graphs:
            if graph_guard == guard and graph.matches():
                assert self.state is not None
                replaced = self.state.replaced()
                if replaced is not None:
                    self._restart(replaced)
                    return _MISSED
                result = graph.replay(leaves)
                if self.fallback is not None:
                    self.fallback = None
                if modes is not None:  # a model.train() inside runs at capture only: its Python effect is put
                    for module, training in zip(self.modules, modes):  # back, as .grad's (nn.Module's
                        if module.training is not training:  # __setattr__ costs ~2 us: only where it changed)
                            module.training = training
                return result
        return _MISSED

    def _graph_call(self, inputs: Inputs) -> Any:
        result = self.replay(inputs.leaves)
        if result is not _MISSED:
            return result
        if self.eager_reason is not None or self.warmups_left > 0:
            return self.call(inputs)
        assert self.state is not None
        replaced = self.state.replaced()
        if replaced is not None:
            self._restart(replaced)
            return self.call(inputs)
        guard = self._guard()
        change = self._change(guard)
        if change is not None:
            short = self.last is not None and self.last[1].replays < _CHURN_REPLAYS
            self.churn = self.churn + 1 if short else 0
            if self.churn >= _CHURN_TIMES:
                self._run_eagerly(_baked_reason(change))
                return self.owner.eager(inputs)
        cause = change or ("the .grad state" if self.graphs else f"the signature {self.description}")
        refused = self.owner.capture_refusal(inputs, cause)
        if refused is not None:
            self.fallback = refused
            return self.owner.eager(inputs)
        return self._capture(inputs, guard)

    def _change(self, guard: Guard) -> str | None:
        """What of ``guard`` differs from the latest capture's, in words; None if nothing (or no capture yet)."""
        if self.last is None or self.last[0] == guard:
            return None
        old = self.last[0]
        parts: list[str] = []
        if old[0] != guard[0]:
            parts.append("a module's train()/eval() mode")
        if old[1] != guard[1]:
            assert self.watch is not None
            parts.extend(self.watch.difference(old[1], guard[1]))
        if old[2] != guard[2]:
            parts.append("torch.is_grad_enabled()")
        if old[3] != guard[3]:
            names = _parameter_names(self.modules)
            flipped = [names.get(id(p), f"a parameter of shape {list(p.shape)}") for p, a, b in
                       zip(self.params, old[3], guard[3]) if a != b]  # fmt: skip
            parts.append(f"requires_grad of {', '.join(flipped[:4])}{' and more' if len(flipped) > 4 else ''}")
        return ", ".join(parts) or None

    def _capture(self, inputs: Inputs, guard: Guard) -> Any:
        assert self.device is not None and self.watch is not None
        # graphs of other optimizer states (a load_state_dict since, other hyperparameters) are dropped
        self.graphs = [entry for entry in self.graphs if entry[0][1] == guard[1]]
        change = self._change(guard)
        if change is not None and self.graphs:
            log.info("ds.function(%s): a new graph for %s: %s changed", self.owner.name, self.description, change)
        pool = None if self.leaves_new_grads else self.owner.pool()
        self.state = self._reached(inputs)  # as this graph finds it (a load_state_dict since gave new state tensors)
        _tracing[0] += 1
        try:
            graph, result = CapturedGraph.capture(
                self.owner.python_function, inputs, self.device, self.params, pool, self.watch.host_set()
            )
        except CaptureError as e:
            self._run_eagerly(f"the step could not be captured as a CUDA graph: {e}")
            return self.owner.eager(inputs)
        finally:
            _tracing[0] -= 1
        self.owner.captures += 1
        replaced = self.state.replaced()
        if replaced is not None:  # the capture itself rebound state: the graph would read the old tensors
            self._run_eagerly(_out_of_place(replaced))
            return result
        modes = tuple(map(_training, self.modules))  # as the capture left them: None where it changed none
        self.graphs.append((guard, graph, modes if modes != guard[0] else None))
        self.last = (guard, graph)
        if self.owner.captures == 1:
            log.info(
                "ds.function(%s): the step is captured as a CUDA graph for %s and replayed from now on",
                self.owner.name,
                self.description,
            )
        return result


def _out_of_place(replaced: str) -> str:
    return (
        f"the step itself replaces {replaced} (an out-of-place update such as self.ema = self.ema * m + x, "
        "or p.data = ...): a CUDA graph would read the captured tensor at every replay. Update it in place "
        "(self.ema.mul_(m).add_(x)) or outside the ds.function"
    )


def _baked_reason(change: str) -> str:
    hint = ""
    if "'s lr" in change:
        hint = (
            " For a graph under a per-step schedule, use an optimizer that takes its rate as a tensor (Adam, AdamW, "
            "RMSprop, ...: ds.function keeps that rate live on the device)."
        )
    if "betas" in change or "momentum" in change:
        hint += " Betas and momentum are baked in: OneCycleLR(cycle_momentum=False) keeps them fixed."
    return (
        f"{change} changes at nearly every call (a per-step schedule: LambdaLR, OneCycleLR, a hand-written one), "
        f"and a CUDA graph bakes it in: each change would be a new capture, so this signature runs eagerly from "
        f"now on.{hint}"
    )


def _parameter_names(modules: list[torch.nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for m in modules:
        for name, p in m.named_parameters(recurse=False):
            names.setdefault(id(p), f"{type(m).__name__}.{name}")
    return names


def inputs_args(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's ``(args, kwargs)`` back from its leaves."""
    args, kwargs = pytree.tree_unflatten(inputs.leaves, inputs.spec)
    return tuple(args), dict(kwargs)


class Function:
    """A step decorated with :func:`function`: call it as the function itself (see the module docstring).

    ``warmup_steps``: eager calls of a new signature before its capture; ``max_captures``: graphs this
    function may hold; ``reduce_retracing``: one graph per structure and dtypes, other shapes eager;
    ``mode``: ``"auto"``, ``"eager"`` (never capture) or ``"cuda_graph"`` (a failure to capture raises).
    """

    def __init__(
        self,
        python_function: Callable[..., Any],
        *,
        warmup_steps: int = 2,
        max_captures: int = 8,
        reduce_retracing: bool = False,
        mode: str = "auto",
    ) -> None:
        if mode not in paths.MODES:
            raise ValueError(f"ds.function(mode={mode!r}): use one of {', '.join(map(repr, paths.MODES))}")
        if warmup_steps < 1:
            raise ValueError(
                f"ds.function(warmup_steps={warmup_steps}): at least 1 eager call must come before a "
                "capture (it creates the optimizer's state)"
            )
        if max_captures < 1:
            raise ValueError(
                f"ds.function(max_captures={max_captures}): must be at least 1 (mode='eager' captures nothing)"
            )
        self.python_function = python_function
        self.warmup_steps = warmup_steps
        self.max_captures = max_captures
        self.reduce_retracing = reduce_retracing
        self.mode = mode
        self.captures = 0
        self.name = getattr(python_function, "__qualname__", repr(python_function))
        self._signatures: dict[Hashable, _Signature] = {}
        #: the same signatures by :func:`quick_key`, for the calls it covers (with a template of their inputs)
        self._quick: dict[Hashable, tuple[_Signature, Inputs]] = {}
        self._first_captured: dict[Hashable, Hashable] = {}
        self._pool: Any = None  # the graphs' shared memory pool, made at the first capture
        #: True once a call has found that no graph can be captured in this process (no CUDA): calls go straight
        #: to the Python function, without taking their arguments apart
        self.always_eager = False
        functools.update_wrapper(self, python_function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.always_eager or _tracing[0] or context.current_replica() is not None:
            return self.python_function(*args, **kwargs)  # no CUDA here, or part of an outer step
        quick = quick_key(args, kwargs)
        if quick is not None:
            known = self._quick.get(quick[0])
            if known is not None:  # the common call, seen before: no pytree walk
                result = known[0].replay(quick[1])
                if result is not _MISSED:
                    return result
                return known[0].call(known[1].with_leaves(quick[1]))
        inputs = flatten_inputs(args, kwargs)
        signature = self._signatures.get(inputs.key)
        if signature is None:
            signature = self._signatures[inputs.key] = _Signature(self, inputs)
        if quick is not None:
            self._quick[quick[0]] = (signature, inputs)
        return signature.call(inputs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self.__call__, instance)

    def eager(self, inputs: Inputs) -> Any:
        """Run the call as it is."""
        args, kwargs = inputs_args(inputs)
        return self.python_function(*args, **kwargs)

    def held(self) -> int:
        """How many graphs this function holds (what ``max_captures`` bounds)."""
        return sum(len(s.graphs) for s in self._signatures.values())

    def pool(self) -> Any:
        """The memory pool the graphs of this function share (see :mod:`~distrib.graphs.cuda_graph`)."""
        if self._pool is None:
            self._pool = cuda_graph.backend().new_pool()
        return self._pool

    def capture_refusal(self, inputs: Inputs, cause: str) -> str | None:
        """Why no other graph may be captured for ``inputs`` (``max_captures``, ``reduce_retracing``), in words,
        with ``cause``, what made this capture necessary; None when one may."""
        if self.held() >= self.max_captures:
            reason = (
                f"ds.function({self.name}) holds {self.held()} graphs (max_captures={self.max_captures}), so a "
                f"change of {cause} runs eagerly"
            )
            if cause.startswith("the signature"):  # TF's advice about retracing fits new signatures only
                reason += (
                    ". Frequent new signatures come from changing shapes (pad the batches, drop the last one) or "
                    "Python arguments that change at each call (pass them as tensors) [TF: 'triggered "
                    "tf.function retracing']"
                )
            self.say_once(reason)
            return reason
        if self.reduce_retracing:
            shapeless = (inputs.spec, tuple((t.dtype, t.device) for t in inputs.tensors))
            first = self._first_captured.setdefault(shapeless, inputs.key)
            if first != inputs.key:
                reason = (
                    f"ds.function({self.name}, reduce_retracing=True): other shapes than the captured "
                    "signature's run eagerly"
                )
                self.say_once(reason)
                return reason
        return None

    def say_once(self, message: str) -> None:
        """Log ``message`` as a warning the first time this process meets it (fit's validation makes a function per
        epoch: its reason is said once, not every epoch)."""
        if message not in _said:
            _said.add(message)
            log.warning(message)

    def paths(self) -> dict[str, str]:
        """Each signature seen and its path: ``"cuda_graph (N graphs)"``, ``"warming up"`` or ``"eager: why"``."""
        out = {}
        for s in self._signatures.values():
            if s.eager_reason is not None:
                out[s.description] = f"eager: {s.eager_reason}"
            elif s.fallback is not None:  # the last call ran eagerly although graphs are held for other states
                out[s.description] = f"eager: {s.fallback}"
            elif s.graphs:
                out[s.description] = f"cuda_graph ({len(s.graphs)} graph{'s' if len(s.graphs) > 1 else ''})"
            else:
                out[s.description] = "warming up"
        return out


@overload
def function(
    python_function: F,
    *,
    warmup_steps: int = ...,
    max_captures: int = ...,
    reduce_retracing: bool = ...,
    mode: str = ...,
) -> F: ...


@overload
def function(
    python_function: None = None,
    *,
    warmup_steps: int = ...,
    max_captures: int = ...,
    reduce_retracing: bool = ...,
    mode: str = ...,
) -> Callable[[F], F]: ...


def function(
    python_function: Callable[..., Any] | None = None,
    *,
    warmup_steps: int = 2,
    max_captures: int = 8,
    reduce_retracing: bool = False,
    mode: str = "auto",
) -> Callable[..., Any] | Callable[[F], F]:
    """Capture the decorated step once per signature as a CUDA graph and replay it (``tf.function``).

    A step of many small kernels (a small model, or many layers at a small batch) spends its time
    launching them from Python; replayed as one CUDA graph, the whole step (forward, backward, the gradients'
    reduction, the optimizer's update) is a single launch. See :mod:`distrib.graphs.step_function` for what a
    call does: a signature's first ``warmup_steps`` calls run eagerly, the next is captured and later ones
    replay it; a step that cannot be captured runs eagerly, and its first call logs why once. Use it as
    ``@ds.function`` or ``@ds.function(warmup_steps=3, ...)``.

    Args:
        python_function: the step to decorate; None when called with options only
            (``@ds.function(mode="eager")``).
        warmup_steps: eager calls of each new signature before its capture (at least 1: they create the
            optimizer's state and let cuDNN and cuBLAS settle).
        max_captures: the most graphs this function may hold; past it, a call that needs another graph runs
            eagerly, with a warning naming what changed.
        reduce_retracing: capture one graph per structure and dtypes of the arguments: calls of other shapes
            (the last, shorter batch) run eagerly instead of capturing graphs of their own.
        mode: ``"auto"`` (capture where possible, else eager), ``"eager"`` (never capture) or ``"cuda_graph"``
            (a step that cannot be captured raises instead of running eagerly).

    Returns:
        With ``python_function``, a ``Function`` that is called as the step itself (``paths()`` says each
        signature's path: captured, warming up, or eager and why); without it, a decorator that makes one.

    Raises:
        ValueError: ``mode`` is not one of the three, or ``warmup_steps`` or ``max_captures`` is below 1.

    Examples:
        On a CPU the step runs eagerly, and the first call says so once:

        >>> import distrib as ds, torch
        >>> @ds.function
        ... def double(x):
        ...     return x * 2
        >>> double(torch.tensor([1.0, 2.0]))
        tensor([2., 4.])
        >>> import torch
        >>> list(double.paths().values())[0] if not torch.cuda.is_available() else "eager: CUDA is not available"
        'eager: CUDA is not available here, and CUDA graphs need a CUDA device'
    """

    def wrap(fn: Callable[..., Any]) -> Any:
        return Function(
            fn, warmup_steps=warmup_steps, max_captures=max_captures, reduce_retracing=reduce_retracing, mode=mode
        )

    return wrap(python_function) if python_function is not None else wrap
