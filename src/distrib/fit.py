"""``ds.fit``, ``ds.evaluate``, ``ds.predict``: Keras' high-level loop, under any strategy.

The model and optimizer are built under the strategy's scope as usual; these
functions find the strategy from the model, distribute the data, scale the loss by
the true global batch size of every step (so a short last batch counts right), keep
the loss and metrics over every replica and worker, and drive callbacks and the
progress display (the chief alone prints). Under ``ParameterServerStrategy`` each
step is a function scheduled through a ``ClusterCoordinator``, as Keras does.

Example::

    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    history = ds.fit(model, batches, optimizer=optimizer, loss="mse", epochs=5)
    ds.evaluate(model, eval_batches, loss="mse")   # {'loss': ...}
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from distrib import context, metrics as metrics_lib
from distrib.callbacks import Callback, CallbackList, History
from distrib.losses import compute_average_loss
from distrib.progress import Progbar
from distrib.strategies.base import Strategy

__all__ = ["fit", "evaluate", "predict", "Loop", "per_example_loss"]

LossLike = Union[str, torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _reduce_example_dims(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(values.shape[0], -1).mean(1) if values.dim() > 1 else values


def per_example_loss(loss: LossLike) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(y_pred, y_true) -> losses of shape [batch]`` from a Keras name, a torch loss module or a function."""
    names: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "mse": lambda p, y: F.mse_loss(p, y.to(p.dtype), reduction="none"),
        "mean_squared_error": lambda p, y: F.mse_loss(p, y.to(p.dtype), reduction="none"),
        "mae": lambda p, y: F.l1_loss(p, y.to(p.dtype), reduction="none"),
        "mean_absolute_error": lambda p, y: F.l1_loss(p, y.to(p.dtype), reduction="none"),
        "sparse_categorical_crossentropy": lambda p, y: F.cross_entropy(p, y.reshape(-1).long(), reduction="none"),
        "cross_entropy": lambda p, y: F.cross_entropy(p, y.long(), reduction="none"),
        "binary_crossentropy": lambda p, y: F.binary_cross_entropy_with_logits(p, y.to(p.dtype), reduction="none"),
    }
    if isinstance(loss, str):
        if loss.lower() not in names:
            raise ValueError(f"unknown loss {loss!r}: use one of {sorted(names)}, a torch loss module or a function")
        fn = names[loss.lower()]
    elif isinstance(loss, torch.nn.modules.loss._Loss):
        module = loss

        def fn(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            saved, module.reduction = module.reduction, "none"
            try:
                return module(p, y)
            finally:
                module.reduction = saved
    elif callable(loss):
        fn = loss
    else:
        raise TypeError(f"loss must be a name, a torch loss module or a function, got {type(loss).__name__}")

    def checked(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        values = fn(p, y)
        if values.dim() == 0:
            raise ValueError("the loss returned a scalar; fit needs per-example losses to scale them by the "
                             "global batch (use reduction='none')")
        return _reduce_example_dims(values)

    return checked


@dataclass
class Loop:
    """What callbacks see of a running ``fit``."""

    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    strategy: Strategy
    steps_per_epoch: Optional[int] = None
    epoch: torch.Tensor = field(default_factory=lambda: torch.tensor(0))
    step_in_epoch: torch.Tensor = field(default_factory=lambda: torch.tensor(0))
    stop_training: bool = False
    resumed_from: Optional[str] = None

    @property
    def is_chief(self) -> bool:
        return self.strategy.is_chief


def _strategy_of(model: torch.nn.Module) -> Strategy:
    return getattr(model, "_distrib_owner", None) or context.get_strategy()


def _is_parameter_server(strategy: Strategy) -> bool:
    return type(strategy).__name__ == "ParameterServerStrategy"


class _Batches:
    """Global batches of ``data`` from a position, each as ``(x, y, global_batch_size)``.

    Position p is the p-th batch since the start, cycling through ``data`` again (and calling
    its ``set_epoch(pass)`` when it has one) when ``cycle``; so a resumed run replays the
    same batches from the same place.
    """

    def __init__(self, data: Iterable[Any], start: int, cycle: bool) -> None:
        self.data, self.start, self.cycle = data, start, cycle

    def __iter__(self) -> Iterator[Any]:
        skip = self.start
        for n_pass in itertools.count() if self.cycle else [None]:
            if n_pass is not None and hasattr(self.data, "set_epoch"):
                self.data.set_epoch(n_pass)
            for batch in self.data:
                if skip > 0:
                    skip -= 1
                    continue
                x, y = batch[0], batch[1]
                yield x, y, len(x)


def _logs(loss_metric: metrics_lib.Metric, metric_objs: Sequence[metrics_lib.Metric], prefix: str = "",
          synced: bool = True) -> dict[str, float]:
    get = (lambda m: m.result()) if synced else (lambda m: m.local_result())
    logs = {prefix + "loss": float(get(loss_metric))}
    logs.update({prefix + m.name: float(get(m)) for m in metric_objs})
    return logs


def _make_metrics(strategy: Strategy, metrics: Sequence[Any]) -> tuple[metrics_lib.Mean, list[metrics_lib.Metric]]:
    with strategy.scope():
        return metrics_lib.Mean(name="loss"), [metrics_lib.get(m) for m in metrics]


def fit(model: torch.nn.Module, data: Iterable[Any], *, optimizer: torch.optim.Optimizer, loss: LossLike,
        epochs: int = 1, steps_per_epoch: Optional[int] = None, validation_data: Optional[Iterable[Any]] = None,
        validation_steps: Optional[int] = None, metrics: Sequence[Any] = (), callbacks: Sequence[Callback] = (),
        verbose: Union[str, int] = "auto") -> History:
    """Train ``model`` on ``data`` (an iterable of global ``(x, y)`` batches); return the History.

    ``steps_per_epoch``: steps per epoch, cycling through ``data`` (default: one pass).
    Required under ParameterServerStrategy, where ``data`` may also be a function
    ``dataset_fn(input_context)`` returning an iterator, built on every worker.
    """
    strategy = _strategy_of(model)
    loss_fn = per_example_loss(loss)
    loss_metric, metric_objs = _make_metrics(strategy, metrics)
    history = History()
    loop = Loop(model, optimizer, strategy, steps_per_epoch)
    cbs = CallbackList([history, *callbacks])
    cbs.set_loop(loop)
    verbosity = (1 if verbose == "auto" else int(verbose)) if strategy.is_chief else 0
    if _is_parameter_server(strategy):
        from distrib.fit_ps import fit_parameter_server

        fit_parameter_server(loop, data, loss_fn, loss_metric, metric_objs, cbs, epochs, validation_data,
                             validation_steps, verbosity)
        return history

    def train_step(x: torch.Tensor, y: torch.Tensor, n: int) -> None:
        model.train()
        pred = model(x)
        per_example = loss_fn(pred, y)
        compute_average_loss(per_example, global_batch_size=n).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_metric.update_state(per_example.detach())
        for m in metric_objs:
            m.update_state(y, pred.detach())

    cbs.on_train_begin()
    while int(loop.epoch) < epochs and not loop.stop_training:
        epoch = int(loop.epoch)
        cbs.on_epoch_begin(epoch)
        loss_metric.reset_state()
        for m in metric_objs:
            m.reset_state()
        if verbosity:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
        bar = Progbar(steps_per_epoch or _len(data), verbosity)
        if steps_per_epoch:
            batches = _Batches(data, epoch * steps_per_epoch + int(loop.step_in_epoch), cycle=True)
        else:
            if hasattr(data, "set_epoch"):
                data.set_epoch(epoch)
            batches = _Batches(data, int(loop.step_in_epoch), cycle=False)
        for x in itertools.islice(strategy.experimental_distribute_dataset(batches),
                                  (steps_per_epoch - int(loop.step_in_epoch)) if steps_per_epoch else None):
            cbs.on_train_batch_begin(int(loop.step_in_epoch))
            strategy.run(train_step, args=x)
            loop.step_in_epoch += 1
            logs = _logs(loss_metric, metric_objs, synced=False)
            cbs.on_train_batch_end(int(loop.step_in_epoch) - 1, logs)
            bar.update(int(loop.step_in_epoch), logs)
        logs = _logs(loss_metric, metric_objs)
        if validation_data is not None:
            logs.update(evaluate(model, validation_data, loss=loss, steps=validation_steps, metrics=metrics,
                                 verbose=0, _prefix="val_", _callbacks=cbs))
        bar.update(int(loop.step_in_epoch), logs, finalize=True)
        loop.epoch += 1
        loop.step_in_epoch.zero_()
        cbs.on_epoch_end(epoch, logs)
    cbs.on_train_end({k: v[-1] for k, v in history.history.items()})
    return history


def _len(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:
        return None


def evaluate(model: torch.nn.Module, data: Iterable[Any], *, loss: LossLike, steps: Optional[int] = None,
             metrics: Sequence[Any] = (), return_dict: bool = True, verbose: Union[str, int] = 0,
             callbacks: Sequence[Callback] = (), _prefix: str = "", _callbacks: Optional[CallbackList] = None) -> Any:
    """The loss and metrics of ``model`` over ``data`` (``steps`` batches, or all), over every replica."""
    strategy = _strategy_of(model)
    loss_fn = per_example_loss(loss)
    loss_metric, metric_objs = _make_metrics(strategy, metrics)
    cbs = _callbacks or CallbackList(list(callbacks))
    if _callbacks is None:
        cbs.set_loop(Loop(model, None, strategy))
    if _is_parameter_server(strategy):
        from distrib.fit_ps import evaluate_parameter_server

        logs = evaluate_parameter_server(strategy, model, data, loss_fn, loss_metric, metric_objs, steps, _prefix)
    else:
        def test_step(x: torch.Tensor, y: torch.Tensor, n: int) -> None:
            model.eval()
            pred = model(x)
            loss_metric.update_state(loss_fn(pred, y))
            for m in metric_objs:
                m.update_state(y, pred)

        cbs.on_test_begin()
        verbosity = (1 if verbose == "auto" else int(verbose)) if strategy.is_chief else 0
        bar = Progbar(steps or _len(data), verbosity)
        done = 0
        with torch.no_grad():
            batches = _Batches(data, 0, cycle=steps is not None)
            for x in itertools.islice(strategy.experimental_distribute_dataset(batches), steps):
                cbs.on_test_batch_begin(done)
                strategy.run(test_step, args=x)
                done += 1
                cbs.on_test_batch_end(done - 1)
                bar.update(done, _logs(loss_metric, metric_objs, synced=False))
        logs = _logs(loss_metric, metric_objs, _prefix)
        bar.update(done, logs, finalize=True)
        cbs.on_test_end(logs)
    return logs if return_dict else [logs[k] for k in logs]


def predict(model: torch.nn.Module, data: Iterable[Any], steps: Optional[int] = None) -> torch.Tensor:
    """``model``'s outputs for every example of ``data`` (batches of ``x`` or ``(x, y)``), in order, on every worker."""
    strategy = _strategy_of(model)

    def predict_step(x: torch.Tensor) -> torch.Tensor:
        model.eval()
        return model(x)

    def inputs(batches: Iterable[Any]) -> Iterator[torch.Tensor]:
        for b in batches:
            yield b[0] if isinstance(b, (tuple, list)) else b

    outputs = []
    with torch.no_grad():
        if _is_parameter_server(strategy):
            return torch.cat([model(x) for x in itertools.islice(inputs(data), steps)])
        for x in itertools.islice(strategy.experimental_distribute_dataset(list(inputs(data))), steps):
            outputs.append(strategy.gather(strategy.run(predict_step, args=(x,)), axis=0))
    return torch.cat(outputs)
