"""``ds.fit``, ``ds.evaluate``, ``ds.predict``: Keras' high-level loop, one loop under every strategy.

The model and optimizer are built under the strategy's scope as usual; these
functions find the strategy from the model, and ask it how a step executes
(:meth:`~distrib.Strategy.step_executor`): at once over the replicas of a
synchronous strategy, or scheduled on the workers of a parameter-server cluster.
Everything else is the same everywhere: the loss is scaled by the true global batch
size of every step (so a short last batch counts right), loss and metrics cover
every replica and worker (a step returns its metric *deltas*, merged here as each
step completes, in step order), every callback hook fires, and the chief alone
shows progress.

Example::

    >>> import distrib as ds, torch
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(2, 1)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
    >>> history = ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2
    >>> sorted(ds.evaluate(model, data, loss="mse", metrics=["mae"]))
    ['loss', 'mae']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from distrib import context, metrics as metrics_lib
from distrib.keras.callbacks import Callback, CallbackList, History
from distrib.keras.progress import Progbar
from distrib.losses import LossLike, compute_average_loss, per_example_loss
from distrib.strategies.base import Strategy
from distrib.strategies.execution import StepExecutor

__all__ = ["fit", "evaluate", "predict", "Loop"]

Logs = dict[str, float]
#: what fit/evaluate read: an iterable of ``(x, y)`` batches, or (parameter servers) a per-worker dataset function
Data = Union[Iterable[Any], Callable[..., Iterable[Any]]]


@dataclass
class Loop:
    """What callbacks see of a running ``fit``: ``epoch`` and ``step_in_epoch`` are where it resumes from."""

    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    strategy: Strategy
    steps_per_epoch: Optional[int] = None
    epoch: torch.Tensor = field(default_factory=lambda: torch.tensor(0))
    step_in_epoch: torch.Tensor = field(default_factory=lambda: torch.tensor(0))
    stop_training: bool = False

    @property
    def is_chief(self) -> bool:
        return self.strategy.is_chief


class _Tracked:
    """The loss and the metrics of one loop: steps return deltas, merged here in step order."""

    def __init__(self, strategy: Strategy, metrics: Sequence[Any]) -> None:
        self.strategy = strategy
        with strategy.scope():
            self.loss = metrics_lib.Mean(name="loss")
            self.metrics = [metrics_lib.get(m) for m in metrics]

    @property
    def all(self) -> list[metrics_lib.Metric]:
        return [self.loss, *self.metrics]

    def deltas(self, per_example: torch.Tensor, y: Any, pred: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """What one replica's step adds to every tracked value (computed on the replica, or on a worker)."""
        return [self.loss.deltas(per_example)] + [m.deltas(y, pred) for m in self.metrics]

    def merge(self, result: Any) -> None:
        """Add a step's deltas (its ``strategy.run`` result) from every local replica."""
        for replica_deltas in self.strategy.experimental_local_results(result):
            for metric, d in zip(self.all, replica_deltas):
                metric.merge_deltas(d)

    def reset(self) -> None:
        for m in self.all:
            m.reset_state()

    def logs(self, prefix: str = "", synced: bool = True) -> Logs:
        """Every value by name; ``synced=False`` is this worker's view, without a collective (per-step display)."""
        return {prefix + m.name: float(m.result() if synced else m.local_result()) for m in self.all}


def _strategy_of(model: torch.nn.Module) -> Strategy:
    """The strategy that distributes ``model`` (or a module inside it, e.g. a compiled wrapper), else the current one."""
    for module in model.modules():
        owner = context.owner_of(module)
        if owner is not None:
            return owner
    return context.get_strategy()


def _verbosity(strategy: Strategy, verbose: Union[str, int]) -> int:
    return (1 if verbose == "auto" else int(verbose)) if strategy.is_chief else 0


def _len(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:
        return None


def fit(model: torch.nn.Module, data: Data, *, optimizer: torch.optim.Optimizer, loss: LossLike,
        epochs: int = 1, steps_per_epoch: Optional[int] = None, validation_data: Optional[Data] = None,
        validation_steps: Optional[int] = None, metrics: Sequence[Any] = (), callbacks: Sequence[Callback] = (),
        verbose: Union[str, int] = "auto") -> History:
    """Train ``model`` on ``data`` (an iterable of global ``(x, y)`` batches); return the History.

    ``steps_per_epoch``: steps per epoch, cycling through ``data`` (default: one pass).
    Required under ParameterServerStrategy, where ``data`` may also be a function
    ``dataset_fn(input_context)`` returning an iterator, built on every worker.
    """
    strategy = _strategy_of(model)
    executor = strategy.step_executor()
    loss_fn = per_example_loss(loss)
    tracked = _Tracked(strategy, metrics)
    history = History()
    loop = Loop(model, optimizer, strategy, steps_per_epoch)
    cbs = CallbackList([history, *callbacks])
    cbs.set_loop(loop)
    verbosity = _verbosity(strategy, verbose)

    def train_step(x: torch.Tensor, y: torch.Tensor, n: int) -> list[dict[str, torch.Tensor]]:
        model.train()
        pred = model(x)
        per_example = loss_fn(pred, y)
        compute_average_loss(per_example, global_batch_size=n).backward()
        optimizer.step()
        optimizer.zero_grad()
        return tracked.deltas(per_example.detach(), y, pred.detach())

    cbs.on_train_begin()
    logs: Logs = {}
    while int(loop.epoch) < epochs and not loop.stop_training:
        epoch = int(loop.epoch)
        cbs.on_epoch_begin(epoch)
        tracked.reset()
        if verbosity:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
        bar = Progbar(steps_per_epoch or _len(data), verbosity)
        first = int(loop.step_in_epoch)
        if steps_per_epoch:
            inputs = executor.feed(data, start=epoch * steps_per_epoch + first, steps=steps_per_epoch - first,
                                   cycle=True, per_worker=True)
        else:
            if hasattr(data, "set_epoch"):
                data.set_epoch(epoch)
            inputs = executor.feed(data, start=first, per_worker=True)

        def settle(wait: bool) -> None:
            for result in executor.completed(wait):
                tracked.merge(result)
                loop.step_in_epoch += 1
                step_logs = tracked.logs(synced=False)
                cbs.on_train_batch_end(int(loop.step_in_epoch) - 1, step_logs)
                bar.update(int(loop.step_in_epoch), step_logs)

        for submitted, step_input in enumerate(inputs, start=first):
            cbs.on_train_batch_begin(submitted)
            executor.submit(train_step, step_input)
            settle(wait=False)
        settle(wait=True)
        logs = tracked.logs()
        if validation_data is not None:
            logs.update(_evaluate(model, validation_data, loss_fn, tracked, validation_steps, cbs, verbosity=0,
                                  prefix="val_"))
        bar.update(int(loop.step_in_epoch), logs, finalize=True)
        loop.epoch += 1
        loop.step_in_epoch.zero_()
        cbs.on_epoch_end(epoch, logs)
    cbs.on_train_end(logs)
    return history


def _evaluate(model: torch.nn.Module, data: Data, loss_fn: Any, tracked: _Tracked, steps: Optional[int],
              cbs: CallbackList, verbosity: int, prefix: str = "") -> Logs:
    """The loss and metrics of ``model`` over ``data``; fires the test hooks. Resets ``tracked`` first, as Keras."""
    executor: StepExecutor = tracked.strategy.step_executor()

    def test_step(x: torch.Tensor, y: torch.Tensor, n: int) -> list[dict[str, torch.Tensor]]:
        with torch.no_grad():
            model.eval()
            pred = model(x)
            return tracked.deltas(loss_fn(pred, y), y, pred)

    tracked.reset()
    cbs.on_test_begin()
    bar = Progbar(steps or _len(data), verbosity)
    done = 0

    def settle(wait: bool) -> None:
        nonlocal done
        for result in executor.completed(wait):
            tracked.merge(result)
            done += 1
            cbs.on_test_batch_end(done - 1, tracked.logs(synced=False))
            bar.update(done, tracked.logs(synced=False))

    for submitted, step_input in enumerate(executor.feed(data, steps=steps, cycle=steps is not None, per_worker=True)):
        cbs.on_test_batch_begin(submitted)
        executor.submit(test_step, step_input)
        settle(wait=False)
    settle(wait=True)
    logs = tracked.logs(prefix)
    bar.update(done, logs, finalize=True)
    cbs.on_test_end(logs)
    return logs


def evaluate(model: torch.nn.Module, data: Data, *, loss: LossLike, steps: Optional[int] = None,
             metrics: Sequence[Any] = (), return_dict: bool = True, verbose: Union[str, int] = 0,
             callbacks: Sequence[Callback] = ()) -> Any:
    """The loss and metrics of ``model`` over ``data`` (``steps`` batches, or all), over every replica.

    Under ParameterServerStrategy ``steps`` is required (workers cycle through their data).
    """
    strategy = _strategy_of(model)
    cbs = CallbackList(list(callbacks))
    cbs.set_loop(Loop(model, None, strategy))
    logs = _evaluate(model, data, per_example_loss(loss), _Tracked(strategy, metrics), steps, cbs,
                     _verbosity(strategy, verbose))
    return logs if return_dict else [logs[k] for k in logs]


def predict(model: torch.nn.Module, data: Iterable[Any], steps: Optional[int] = None,
            callbacks: Sequence[Callback] = ()) -> torch.Tensor:
    """``model``'s outputs for every example of ``data`` (batches of ``x`` or ``(x, y)``), in order, on every worker."""
    strategy = _strategy_of(model)
    executor = strategy.step_executor()
    cbs = CallbackList(list(callbacks))
    cbs.set_loop(Loop(model, None, strategy))

    def predict_step(x: torch.Tensor, y: Any, n: int) -> torch.Tensor:
        with torch.no_grad():
            model.eval()
            return model(x)

    outputs: list[torch.Tensor] = []

    def settle(wait: bool) -> None:
        for result in executor.completed(wait):
            outputs.append(strategy.gather(result, axis=0))
            cbs.on_predict_batch_end(len(outputs) - 1, {"outputs": outputs[-1]})

    cbs.on_predict_begin()
    for submitted, step_input in enumerate(executor.feed(data, steps=steps)):
        cbs.on_predict_batch_begin(submitted)
        executor.submit(predict_step, step_input)
        settle(wait=False)
    settle(wait=True)
    cbs.on_predict_end()
    return torch.cat(outputs)
