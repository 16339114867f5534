"""Keras 3 optimizers, metrics and losses in a step that ``strategy.run`` runs (``KERAS_BACKEND=torch``).

They are not torch modules, so no scope sees them built; a strategy meets them in the step function itself:
:func:`prepare_step` looks at the objects the function names (its globals, closure, the attributes of a bound
method's object, the items of the dicts, lists and tuples among them, and the same of the functions it names, three
calls deep) and at ``run``'s arguments, before each ``run``, and

* a **Keras optimizer** becomes a merge point, as a ``torch.optim`` optimizer built in the scope: its ``apply`` /
  ``apply_gradients``, called by every replica as Keras' guide for custom loops on torch writes it
  (``loss.backward()``, ``grads = [v.value.grad for v in model.trainable_weights]``,
  ``optimizer.apply(grads, model.trainable_weights)``), sums the gradients of every replica and worker (the
  strategy's own gradient reduction) and applies them once. With several replicas in one process a replica's
  ``v.value.grad`` is replica 0's tensor, so the gradients it is given must be the variables' own (anything else is
  an error naming the fix); with one replica per process any gradients are summed over the workers, as TF's
  ``apply_gradients`` does;
* a **Keras metric** updated inside ``run`` counts every replica (its updates serialised), and its ``result()``,
  read in the training loop, is over every worker: each state variable is reduced as its ``aggregation`` says (a
  collective: every worker reads it). Read inside ``run`` it is an error, as in TF;
* a **Keras loss** whose reduction averages per replica (``"sum_over_batch_size"``, Keras' default) is TF's error:
  a strategy's custom loop takes ``reduction=None`` and ``ds.compute_average_loss``;
* a **Keras model** the step calls must be one the strategy distributed: built in its scope, with its input shape
  known when the scope closed.

Changes to the user's Keras objects (instance attributes only; the classes are untouched): a Keras optimizer's
``apply``, a Keras metric's ``update_state`` and ``result``, from the first ``run`` that names them, for as long as
the object lives. A Keras model's ``zero_grad`` is routed to the replica's copy (``torch_patches.route_zero_grad``);
under several workers its ``save`` and ``save_weights`` write from the chief alone (``keras_saving.route_saving``).
"""

from __future__ import annotations

import inspect
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from distrib import context
from distrib.integrations import keras_models, keras_saving

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["prepare_step", "named_objects"]

#: the Keras optimizers and metrics already routed through a strategy, and that strategy
_adopted: weakref.WeakKeyDictionary[Any, Strategy] = weakref.WeakKeyDictionary()
_adopting = threading.Lock()
#: how many calls deep :func:`named_objects` follows the functions a step names
SEARCH_DEPTH = 3
#: how many items of a dict, list or tuple the step names :func:`named_objects` looks at
CONTAINER_ITEMS = 64
#: the reductions a strategy's custom loop accepts (TF: NONE and SUM)
PER_EXAMPLE_REDUCTIONS = (None, "none", "sum")


def named_objects(fn: Callable[..., Any], extra: Sequence[Any] = (), depth: int = SEARCH_DEPTH) -> list[Any]:
    """The objects ``fn`` names: globals and closure cells it reads, a bound method's object and its attributes, the
    items of the dicts, lists and tuples among them (up to :data:`CONTAINER_ITEMS` each), and the same for the plain
    functions among them, ``depth`` calls deep; ``extra`` (``run``'s arguments) is looked at as a closure cell is.
    Each object once."""
    found: dict[int, Any] = {}
    visited: set[int] = set()

    def note(values: list[Any], level: int) -> None:
        for value in values:
            if id(value) in found:
                continue
            found[id(value)] = value
            if isinstance(value, dict):
                note(list(value.values())[:CONTAINER_ITEMS], -1)
            elif isinstance(value, (list, tuple)):
                note(list(value[:CONTAINER_ITEMS]), -1)
            elif level >= 0 and isinstance(value, (types.FunctionType, types.MethodType)):
                visit(value, level)

    def visit(f: Any, level: int) -> None:
        if isinstance(f, types.MethodType):
            owner = f.__self__
            note([owner, *getattr(owner, "__dict__", {}).values()], -1)
            f = f.__func__
        if not isinstance(f, types.FunctionType) or id(f.__code__) in visited:
            return
        visited.add(id(f.__code__))
        values = list(_cell_values(f))
        codes = [f.__code__]
        while codes:
            code = codes.pop()
            values += [f.__globals__[n] for n in code.co_names if n in f.__globals__]
            codes += [c for c in code.co_consts if inspect.iscode(c)]  # lambdas and nested functions
        note(values, level - 1)

    note(list(extra), -1)
    visit(fn, depth)
    return list(found.values())


def _cell_values(f: types.FunctionType) -> list[Any]:
    values = []
    for cell in f.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet assigned
            continue
    return values


def prepare_step(strategy: Strategy, fn: Callable[..., Any], arguments: Sequence[Any] = ()) -> None:
    """Check and route the Keras objects ``fn`` names (or is given in ``arguments``) before ``strategy`` runs it (see
    the module docstring).

    Raises:
        RuntimeError: keras runs on another backend than torch.
        ValueError: a Keras loss averages per replica; a Keras model was not distributed by ``strategy``.
        NotImplementedError: a Keras metric under a strategy that does not support it yet.
    """
    if not keras_models.keras_loaded():
        return
    import keras

    kinds = (keras.layers.Layer, keras.optimizers.Optimizer, keras.metrics.Metric, keras.losses.Loss)
    objects = [obj for obj in named_objects(fn, arguments) if isinstance(obj, kinds)]
    if not objects:
        return
    keras_models.check_backend()
    if strategy is context.default_strategy():
        return  # no strategy in use: Keras' objects as they are
    for obj in objects:
        if isinstance(obj, keras.losses.Loss):
            _check_reduction(obj)
        elif isinstance(obj, keras.layers.Layer):
            _check_model(strategy, obj)
            keras_saving.route_saving(strategy, obj)
    for obj in objects:
        if isinstance(obj, (keras.optimizers.Optimizer, keras.metrics.Metric)):
            with _adopting:
                owner = _adopted.get(obj)
                if owner is None:
                    _adopt(strategy, obj, isinstance(obj, keras.optimizers.Optimizer))
                elif owner is not strategy:
                    raise ValueError(
                        f"{keras_models.describe(obj)} is used under {type(owner).__name__} already; build one per "
                        "strategy, inside that strategy's scope"
                    )


def _check_reduction(loss: Any) -> None:
    if loss.reduction in PER_EXAMPLE_REDUCTIONS:
        return
    raise ValueError(
        f"Please use reduction=None ('none') or 'sum' for loss reduction when losses are used with a ds.Strategy "
        f"(got {loss.reduction!r} for {keras_models.describe(loss)}), as TF's tf.distribute does: "
        f"{loss.reduction!r} averages over one replica's batch, and the replicas' gradients are summed. Fix: "
        f"{type(loss).__name__}(..., reduction=None) and loss = ds.compute_average_loss(per_example_loss, "
        "global_batch_size=GLOBAL_BATCH_SIZE)"
    )


def _check_model(strategy: Strategy, layer: Any) -> None:
    owner = context.owner_of(layer)
    if owner is strategy or not any(True for _ in layer.parameters()) and layer.built:
        return  # distributed by this strategy, or a layer without variables (nothing to distribute)
    name = keras_models.describe(layer)
    if owner is not None:
        raise ValueError(f"Keras model {name} is distributed by another strategy; build it in this strategy's scope")
    if not layer.built:
        raise ValueError(
            f"Keras model {name} had no variables when {type(strategy).__name__}.scope() closed, so no replica and "
            "no worker has a copy of them: give its input shape inside the scope, with keras.Input(shape) as its "
            "first layer or model.build((None, *input_shape))"
        )
    raise ValueError(
        f"Keras model {name} was built outside {type(strategy).__name__}.scope() and is used inside strategy.run; "
        "as in TF, a model's variables must be created under the strategy's scope: build the model (and its "
        "optimizer and metrics) inside `with strategy.scope():`"
    )


def _adopt(strategy: Strategy, obj: Any, is_optimizer: bool) -> None:
    from distrib.strategies.replica_engine import ReplicaEngine

    # whole copies per replica, gradients merged by a replica engine: OneDevice, Mirrored, MultiWorkerMirrored
    replicated = isinstance(strategy.gradient_merge, ReplicaEngine)
    alone = strategy.num_replicas_in_sync == 1 and strategy.num_workers == 1
    if is_optimizer:
        if replicated:
            _route_optimizer(strategy, obj)
        # else the strategy sums gradients in backward itself (a MeshStrategy from keras.distribution); the Keras
        # models a strategy cannot distribute are refused when it distributes them
    elif replicated or alone:
        _route_metric(strategy, obj)
    else:
        raise NotImplementedError(
            f"{keras_models.describe(obj)}: Keras metrics are not supported under {type(strategy).__name__} yet "
            "(its workers would each count their own examples); use ds.metrics (ds.metrics.Mean, "
            "ds.metrics.SparseCategoricalAccuracy), or MirroredStrategy / MultiWorkerMirroredStrategy"
        )
    _adopted[obj] = strategy


# --------------------------------------------------------------------------- optimizers


class _GradientHolder:
    """The parameters of one Keras ``apply`` call, shaped as the strategy's gradient reduction reads an optimizer."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.param_groups = [{"params": list(params)}]


def _route_optimizer(strategy: Strategy, optimizer: Any) -> None:
    original_apply = optimizer.apply
    holders: weakref.WeakValueDictionary[tuple[int, ...], _GradientHolder] = weakref.WeakValueDictionary()
    keep: list[_GradientHolder] = []  # one holder per set of variables, for the optimizer's life

    def holder_for(params: list[torch.Tensor]) -> _GradientHolder:
        key = tuple(id(p) for p in params)
        holder = holders.get(key)
        if holder is None:
            holder = _GradientHolder(params)
            holders[key] = holder
            keep.append(holder)
        return holder

    def apply(grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        ctx = context.current_replica()
        if ctx is None or ctx.strategy is not strategy:
            return original_apply(grads, trainable_variables)
        if trainable_variables is None:
            raise ValueError(
                f"{keras_models.describe(optimizer)}.apply(grads) inside strategy.run needs the variables too: "
                "optimizer.apply(grads, model.trainable_weights)"
            )
        grads, variables = list(grads), list(trainable_variables)
        params = [v.value for v in variables]
        several = strategy.num_local_replicas > 1
        if several and any(g is not None and g is not p.grad for g, p in zip(grads, params)):
            raise ValueError(
                f"{keras_models.describe(optimizer)}.apply was given gradients that are not the variables' own "
                f"(v.value.grad) with {strategy.num_local_replicas} replicas in this process: each replica's "
                "gradients sit in its own copy of the model, and distrib sums them itself. Pass "
                "[v.value.grad for v in model.trainable_weights], or transform gradients with one replica per "
                "process (MultiWorkerMirroredStrategy, `distrib launch`)"
            )

        def merged(_: Any, per_replica: Any) -> Any:
            if not several:
                for g, p in zip(grads, params):
                    if g is not None and g is not p.grad:
                        p.grad = g.detach()
            holder = holder_for(params)
            fake = cast(torch.optim.Optimizer, holder)
            try:
                return strategy.extended.reduce_gradients_then(
                    fake, lambda: original_apply([p.grad for p in params], variables)
                )
            finally:
                strategy.extended.end_gradient_reduction(fake)

        return ctx.merge_call(merged, args=(None,))

    def apply_gradients(grads_and_vars: Any) -> Any:
        pairs = list(grads_and_vars)
        return apply([g for g, _ in pairs], [v for _, v in pairs])

    optimizer.apply = apply
    optimizer.apply_gradients = apply_gradients


# --------------------------------------------------------------------------- metrics


def _route_metric(strategy: Strategy, metric: Any) -> None:
    original_update, original_result = metric.update_state, metric.result
    lock = threading.Lock()

    def update_state(*args: Any, **kwargs: Any) -> Any:
        with lock:  # the replica threads update one metric: Keras' assign_add is not atomic
            return original_update(*args, **kwargs)

    def result() -> Any:
        ctx = context.current_replica()
        if ctx is not None and ctx.strategy is strategy and strategy.num_replicas_in_sync > 1:
            raise RuntimeError(
                f"{keras_models.describe(metric)}.result() was read inside strategy.run, where it would be one "
                "replica's view while the others still update it; as in TF's custom loop, update the metric in the "
                "step and read metric.result() in the training loop, after run returns (metric(y, p) reads it too: "
                "call metric.update_state(y, p))"
            )
        if strategy.num_workers == 1:
            return original_result()
        with lock:
            saved = [v.value.detach().clone() for v in metric.variables]
            reduced = _reduced_over_workers(strategy, metric, saved)
            try:
                with torch.no_grad():
                    for v, value in zip(metric.variables, reduced):
                        v.value.copy_(value)
                return original_result()
            finally:
                with torch.no_grad():
                    for v, value in zip(metric.variables, saved):
                        v.value.copy_(value)

    metric.update_state = update_state
    metric.result = result


def _reduced_over_workers(strategy: Strategy, metric: Any, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each state variable of ``metric`` reduced over the workers as its Keras ``aggregation`` says."""
    out = [v.clone() for v in values]
    for v, value in zip(metric.variables, out):
        aggregation = getattr(v, "aggregation", "sum")
        if aggregation == "only_first_replica" and not strategy.is_chief:
            value.zero_()
        elif aggregation not in ("sum", "mean", "only_first_replica"):
            raise ValueError(
                f"{keras_models.describe(metric)}: its variable {v.path!r} has aggregation {aggregation!r}, which "
                "cannot be combined over workers; use a metric whose state adds up (or ds.metrics)"
            )
    strategy.communicator.all_reduce(out)
    for v, value in zip(metric.variables, out):
        if getattr(v, "aggregation", "sum") == "mean":
            value /= strategy.num_workers
    return out
