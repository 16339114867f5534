"""``fit``/``evaluate`` under ``ParameterServerStrategy``: steps scheduled through a ClusterCoordinator.

As Keras does for parameter-server training: ``data`` becomes a per-worker dataset
(each worker cycles through it), every step is a function scheduled on whichever
worker is free, and an epoch ends with ``join()``. Steps return the *deltas* of the
loss and metric states, which the coordinator adds into its own metrics, so the
epoch's logs count every step exactly once.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from distrib import metrics as metrics_lib
from distrib.losses import compute_average_loss
from distrib.progress import Progbar

if TYPE_CHECKING:
    from distrib.callbacks import CallbackList
    from distrib.fit import Loop
    from distrib.strategies.base import Strategy

__all__ = ["fit_parameter_server", "evaluate_parameter_server", "coordinator_for"]

_coordinators: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def coordinator_for(strategy: "Strategy") -> Any:
    """One ClusterCoordinator per strategy, made on first use."""
    if strategy not in _coordinators:
        from distrib.parameter_server import coordinator

        _coordinators[strategy] = coordinator.ClusterCoordinator(strategy)
    return _coordinators[strategy]


def _dataset_fn(data: Any) -> Callable[[Any], Iterator[Any]]:
    """``data`` as a per-worker dataset function: a function of the input context, or an iterable to cycle."""
    if callable(data) and not hasattr(data, "__iter__"):
        return data

    def cycle(input_context: Any) -> Iterator[Any]:
        while True:
            yield from data

    return cycle


def _merge(values: Sequence[Any], loss_metric: metrics_lib.Metric, metric_objs: Sequence[metrics_lib.Metric]) -> None:
    for value in values:
        deltas = value.fetch()
        for metric, d in zip([loss_metric, *metric_objs], deltas):
            metric.merge_deltas(d)


def _logs(loss_metric: metrics_lib.Metric, metric_objs: Sequence[metrics_lib.Metric], prefix: str = "") -> dict[str, float]:
    # the coordinator is the only client: its metrics already hold every step
    return {prefix + m.name: float(m.local_result()) for m in [loss_metric, *metric_objs]}


def fit_parameter_server(loop: "Loop", data: Any, loss_fn: Callable[..., torch.Tensor],
                         loss_metric: metrics_lib.Metric, metric_objs: Sequence[metrics_lib.Metric],
                         cbs: "CallbackList", epochs: int, validation_data: Optional[Iterable[Any]],
                         validation_steps: Optional[int], verbosity: int) -> None:
    strategy, model, optimizer = loop.strategy, loop.model, loop.optimizer
    if not loop.steps_per_epoch:
        raise ValueError("fit under ParameterServerStrategy needs steps_per_epoch: workers cycle through "
                         "their data, so an epoch is a number of steps (as in TF)")
    coordinator = coordinator_for(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(data)))

    def replica_fn(x: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        model.train()
        pred = model(x)
        per_example = loss_fn(pred, y)
        compute_average_loss(per_example, global_batch_size=len(x)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return [loss_metric.deltas(per_example.detach())] + [m.deltas(y, pred.detach()) for m in metric_objs]

    def train_step(it: Iterator[Any]) -> Any:
        x, y = next(it)[:2]
        return strategy.run(replica_fn, args=(x, y))

    cbs.on_train_begin()
    while int(loop.epoch) < epochs and not loop.stop_training:
        epoch = int(loop.epoch)
        cbs.on_epoch_begin(epoch)
        for m in [loss_metric, *metric_objs]:
            m.reset_state()
        if verbosity:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
        bar = Progbar(loop.steps_per_epoch, min(verbosity, 2) and 2)
        values = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(loop.steps_per_epoch)]
        coordinator.join()
        _merge(values, loss_metric, metric_objs)
        loop.step_in_epoch.fill_(loop.steps_per_epoch)
        logs = _logs(loss_metric, metric_objs)
        if validation_data is not None:
            logs.update(evaluate_parameter_server(strategy, model, validation_data, loss_fn, *_fresh_metrics(metric_objs),
                                                  validation_steps or 1, "val_"))
        bar.update(loop.steps_per_epoch, logs, finalize=True)
        loop.epoch += 1
        loop.step_in_epoch.zero_()
        cbs.on_epoch_end(epoch, logs)
    cbs.on_train_end()


def _fresh_metrics(metric_objs: Sequence[metrics_lib.Metric]) -> tuple[metrics_lib.Metric, list[metrics_lib.Metric]]:
    """Empty copies for validation (a Metric's copy starts from zero state: see ``Metric.__getstate__``)."""
    return metrics_lib.Mean(name="loss"), [copy.deepcopy(m) for m in metric_objs]


def evaluate_parameter_server(strategy: "Strategy", model: torch.nn.Module, data: Any,
                              loss_fn: Callable[..., torch.Tensor], loss_metric: metrics_lib.Metric,
                              metric_objs: Sequence[metrics_lib.Metric], steps: Optional[int],
                              prefix: str = "") -> dict[str, float]:
    """Schedule ``steps`` evaluation steps on the workers; the loss and metrics over all of them."""
    if not steps:
        raise ValueError("evaluate under ParameterServerStrategy needs steps (workers cycle through their data)")
    coordinator = coordinator_for(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(data)))

    def test_step(it: Iterator[Any]) -> list[dict[str, torch.Tensor]]:
        x, y = next(it)[:2]
        with torch.no_grad():
            model.eval()
            pred = model(x)
            return [loss_metric.deltas(loss_fn(pred, y))] + [m.deltas(y, pred) for m in metric_objs]

    values = [coordinator.schedule(test_step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    _merge(values, loss_metric, metric_objs)
    return _logs(loss_metric, metric_objs, prefix)
