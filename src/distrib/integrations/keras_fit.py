"""A compiled Keras 3 model (``KERAS_BACKEND=torch``) in ``ds.fit``, ``ds.evaluate`` and ``ds.predict``.

TF's Keras tutorials build and compile the model in ``strategy.scope()`` and call ``model.fit``. Under distrib the
model is compiled the same way and trained with ``ds.fit(model, data, epochs=..., callbacks=[...])``: what
``model.compile`` was given (the optimizer, the loss, the metrics) is what ``ds.fit`` uses when it is not given them
itself. ``ds.fit`` is the loop because it already does what Keras' own torch trainer does not under a strategy: it
splits each global batch over the replicas and workers, scales the loss by the global batch, merges the metrics of
every replica and worker, runs the callbacks' writes on the chief alone and schedules steps on parameter-server
workers. Keras' trainer computes its loss, metrics and update from the one batch its process reads.

What is taken from ``model.compile``, with Keras' meaning kept:

* the **loss**: a Keras name, function or ``keras.losses.Loss`` computed per example (``Loss.call``) and averaged
  over the global batch, as Keras' default reduction ``"sum_over_batch_size"`` averages over one batch (a name
  such as ``"sparse_categorical_crossentropy"`` takes probabilities, as in Keras; distrib's own names take logits);
* the **optimizer**: a Keras optimizer is applied as Keras' torch trainer applies it
  (``optimizer.apply([v.value.grad ...], model.trainable_weights)``) to the gradients of every replica and worker
  summed; a ``torch.optim`` optimizer given to ``ds.fit`` is used instead when given;
* the **metrics**: Keras names (``"accuracy"``, ``"mae"``) and Keras metric objects of the classes ``ds.metrics``
  has (``SparseCategoricalAccuracy()``, ...), under the same names in the logs.

What Keras' ``compile`` takes and distrib cannot do right is an error naming the fix: several outputs' losses,
``loss_weights``, ``weighted_metrics``, a loss reduction other than ``"sum_over_batch_size"``, a Keras optimizer
with ``precision`` other than ``"32"`` (Keras' mixed precision policy wraps it in a ``LossScaleOptimizer``), a
model that adds losses (``add_loss``, regularisers), and Keras callback objects (``ds.callbacks`` has the same
names and TF's multi-worker file conventions).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distrib.integrations import keras_models

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = [
    "refuse_own_training",
    "FitParts",
    "fit_parts",
    "apply_keras_optimizer",
    "call_kwargs",
    "check_callbacks",
    "KerasPerExampleLoss",
    "refuse_added_losses",
]


@dataclass
class FitParts:
    """What a loop uses for one model: a torch optimizer or a Keras one (one of the two, or neither to evaluate),
    the loss (anything ``ds.losses.per_example_loss`` takes) and the metrics."""

    optimizer: torch.optim.Optimizer | None
    keras_optimizer: Any
    loss: Any
    metrics: Sequence[Any]


class KerasPerExampleLoss:
    """A Keras loss as ``fn(y_pred, y_true) -> per-example values``: ``Loss.call`` (no reduction) or Keras' loss
    function (``keras.losses.get(name)``), averaged over any
    dimension after the batch's, so the global mean is Keras' ``"sum_over_batch_size"`` of the global batch.

    A callable object rather than a function: the step that calls it names no Keras loss that averages per replica
    (which ``strategy.run`` refuses in a custom loop, as TF does)."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self.name = getattr(loss, "name", type(loss).__name__)

    def __call__(self, y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
        import keras

        per_example = self.loss.call if isinstance(self.loss, keras.losses.Loss) else self.loss
        values = torch.as_tensor(per_example(y_true, y_pred))
        return values.reshape(values.shape[0], -1).mean(dim=1) if values.dim() > 1 else values


def keras_loss(spec: Any, model_name: str) -> KerasPerExampleLoss:
    """The per-example form of the loss ``model.compile(loss=spec)`` was given.

    Raises:
        NotImplementedError: a loss per output (a list or dict) or a reduction other than Keras' default.
    """
    import keras

    if isinstance(spec, (list, tuple, dict)):
        raise NotImplementedError(
            f"model {model_name!r} was compiled with a loss per output ({type(spec).__name__}); ds.fit trains models "
            "with one output: give ds.fit(..., loss=fn) a function fn(y_pred, y_true) of per-example values that "
            "combines them, or write the step with strategy.run"
        )
    loss = keras.losses.get(spec)
    if isinstance(loss, keras.losses.Loss) and loss.reduction != "sum_over_batch_size":
        raise NotImplementedError(
            f"model {model_name!r} was compiled with a loss of reduction={loss.reduction!r}; ds.fit averages the "
            "per-example losses over the global batch (Keras' default 'sum_over_batch_size'): compile with the "
            "default reduction, or give ds.fit(..., loss=fn) a function of per-example values"
        )
    return KerasPerExampleLoss(loss)


def keras_metrics(specs: Any, model_name: str) -> list[Any]:
    """``ds.metrics`` for the metrics ``model.compile(metrics=...)`` was given (Keras names pass through as names).

    Raises:
        ValueError: a metric ``ds.metrics`` has no counterpart for (its fix: a ``ds.metrics`` object).
        NotImplementedError: metrics per output (a dict).
    """
    import keras

    from distrib import metrics as metrics_lib

    if specs is None:
        return []
    if isinstance(specs, dict):
        raise NotImplementedError(
            f"model {model_name!r} was compiled with metrics per output; give ds.fit(..., metrics=[...]) the metrics"
        )
    found: list[Any] = []
    for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
        if isinstance(spec, str) or isinstance(spec, metrics_lib.Metric):
            found.append(spec)
            continue
        if isinstance(spec, dict):  # a serialized Keras metric (get_compile_config)
            spec = keras.metrics.deserialize(spec)
        if isinstance(spec, keras.metrics.Metric):
            metric = None
            kind = type(spec).__name__
            for identifier in (kind, re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()):  # MeanAbsoluteError: its name
                try:
                    metric = metrics_lib.get(identifier)
                    break
                except ValueError:
                    continue
            if metric is not None:
                metric.name = spec.name
                found.append(metric)
                continue
        raise ValueError(
            f"metric {spec!r} of model {model_name!r}: ds.fit computes metrics over every replica and worker with "
            "ds.metrics; give ds.fit(..., metrics=[...]) Keras names ('accuracy', 'mae') or ds.metrics objects "
            "(ds.metrics.MeanMetricWrapper(fn, name=...) for a per-example function)"
        )
    return found


def fit_parts(
    model: torch.nn.Module, optimizer: Any, loss: Any, metrics: Sequence[Any] | None, precision: str | int, what: str
) -> FitParts:
    """The optimizer, loss and metrics a loop uses for ``model``: those given, else (a compiled Keras model)
    those of ``model.compile``.

    Args:
        model: the model (a Keras model or any torch module).
        optimizer: the optimizer given (a torch or Keras one), or None.
        loss: the loss given, or None.
        metrics: the metrics given, or None.
        precision: the loop's ``precision`` (a Keras optimizer takes ``"32"`` only).
        what: ``"fit"`` (an optimizer is needed) or ``"evaluate"``.

    Returns:
        The parts.

    Raises:
        ValueError: no optimizer or loss given and none compiled; a Keras optimizer with mixed precision.
        NotImplementedError: a compile argument ds.fit cannot honour (see the module docstring).
    """
    if not keras_models.is_keras_layer(model):
        if loss is None or (what == "fit" and optimizer is None):
            missing = "loss=" if loss is None else "optimizer="
            raise TypeError(
                f"{what}() needs {missing} for a torch module (only a compiled Keras model carries its own)"
            )
        return FitParts(optimizer, None, loss, list(metrics or ()))
    import keras

    keras_models.check_backend()
    name = getattr(model, "name", type(model).__name__)
    compiled = bool(getattr(model, "compiled", False))
    config: dict[str, Any] = model.get_compile_config() if compiled else {}  # type: ignore[operator]
    for unsupported in ("loss_weights", "weighted_metrics"):
        if config.get(unsupported) is not None:
            raise NotImplementedError(
                f"model {name!r} was compiled with {unsupported}=...; ds.fit does not apply it: compile without it "
                "and weight the per-example losses in a loss function given to ds.fit(..., loss=fn)"
            )
    if loss is None:
        if not compiled or getattr(model, "loss", None) is None:
            raise ValueError(f"{what}(model {name!r}): no loss; call model.compile(loss=...) or give {what}(loss=...)")
        loss = keras_loss(model.loss, name)
    elif isinstance(loss, keras.losses.Loss):
        loss = keras_loss(loss, name)
    if metrics is None:
        metrics = keras_metrics(config.get("metrics"), name)
    else:
        metrics = keras_metrics(list(metrics), name)
    if optimizer is None and what == "fit":
        optimizer = getattr(model, "optimizer", None) if compiled else None
        if optimizer is None:
            raise ValueError(
                f"fit(model {name!r}): no optimizer; call model.compile(optimizer=...) or give fit(optimizer=...)"
            )
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if str(precision) != "32" or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                f"fit(model {name!r}, precision={precision!r}) with the Keras optimizer {keras_models.describe(optimizer)}"
                ": mixed precision with a Keras optimizer is not supported by ds.fit; give ds.fit a torch.optim "
                "optimizer over model.parameters() built in the scope, or train in precision='32'"
            )
        return FitParts(None, optimizer, loss, metrics)
    return FitParts(optimizer, None, loss, metrics)


def call_kwargs(model: torch.nn.Module, training: bool) -> dict[str, Any]:
    """How a loop calls ``model``: a Keras model with ``training=`` (as Keras' trainer: its Dropout and
    BatchNormalization read it, not torch's ``model.train()``), any other module with nothing."""
    return {"training": training} if keras_models.is_keras_layer(model) else {}


def refuse_added_losses(model: Any) -> None:
    """Refuse a Keras model that adds losses (``add_loss``, a kernel or activity regulariser), after its first
    forward: ``ds.fit`` computes the compiled loss only, so it would train without them, silently."""
    if not keras_models.is_keras_layer(model):
        return
    added = model.losses
    if added:
        name = getattr(model, "name", type(model).__name__)
        raise NotImplementedError(
            f"model {name!r} adds {len(added)} loss term(s) of its own (add_loss, a kernel or activity "
            "regulariser), which ds.fit does not add to the compiled loss: it would train without them. Remove "
            "them, or train with a custom loop under strategy.run that adds them as TF's guide does: "
            "loss = ds.losses.compute_average_loss(per_example, global_batch_size=N) + "
            "ds.losses.scale_regularization_loss(model.losses)"
        )


def apply_keras_optimizer(loss: torch.Tensor, model: Any, optimizer: Any) -> None:
    """One update as Keras' torch trainer makes it: backward, then ``optimizer.apply`` of the variables' own
    gradients (inside ``strategy.run`` the strategy sums them over every replica and worker first), then the
    gradients cleared."""
    loss.backward()
    weights = model.trainable_weights
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in weights], weights)
    model.zero_grad()


def check_callbacks(callbacks: Sequence[Any]) -> None:
    """Refuse Keras callback objects, naming ``ds.callbacks``' one of the same name.

    Raises:
        TypeError: a ``keras.callbacks.Callback`` among ``callbacks``.
    """
    if not keras_models.keras_loaded():
        return
    import keras

    for cb in callbacks:
        if isinstance(cb, keras.callbacks.Callback):
            kind = type(cb).__name__
            raise TypeError(
                f"keras.callbacks.{kind} given to ds.fit: Keras' callbacks write on every worker and read this "
                f"process's logs only; use ds.callbacks.{kind}(...) with the same arguments (it writes on the chief, "
                "with TF's multi-worker file conventions), or subclass ds.callbacks.Callback"
            )


#: Keras' own training methods, wrong under a strategy with several replicas (each process trains on its batch alone)
KERAS_TRAINING_METHODS = ("fit", "train_on_batch")


def refuse_own_training(strategy: Strategy, model: Any) -> None:
    """Make Keras' own ``model.fit`` and ``train_on_batch`` an error naming ``ds.fit``, for a Keras model ``strategy``
    distributed over several replicas (or workers): Keras' trainer reads one process's batch, computes its gradient
    on the model itself and applies it there, so the batch is not split and the workers drift apart.

    An instance attribute each (the class is untouched); ``model.evaluate`` and ``model.predict`` stay Keras' own
    (each process's result over the data it is given). One replica in all: nothing changes.
    """
    if strategy.num_replicas_in_sync <= 1 or not keras_models.is_keras_layer(model):
        return
    import keras

    if not isinstance(model, keras.Model):
        return
    name, kind = getattr(model, "name", ""), type(strategy).__name__
    for method in KERAS_TRAINING_METHODS:

        def refused(*args: Any, _method: str = method, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"model.{_method}() of Keras model {name!r}, distributed by {kind} over "
                f"{strategy.num_replicas_in_sync} replicas: Keras' own trainer does not split the global batch over "
                "the replicas and workers (each would train on its batch alone). Train with ds.fit(model, dataset, "
                "epochs=..., callbacks=[...]): it takes the model.compile'd loss, optimizer and metrics; the dataset "
                "gives global (x, y) batches, e.g. a DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH)"
            )

        object.__setattr__(model, method, refused)
