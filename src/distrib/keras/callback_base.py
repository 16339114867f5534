"""The base of ``ds.callbacks``: :class:`Callback`, :class:`CallbackList` and :class:`History`.

A callback sees the training loop through ``self.loop`` (set before training starts):
``loop.model``, ``loop.optimizer``, ``loop.strategy``, ``loop.epoch`` and
``loop.step_in_epoch`` (tensors: the position training resumes from),
``loop.stop_training`` (set it in a batch hook to stop after that batch, in an epoch hook
to stop after that epoch, as Keras' ``model.stop_training``, which works too) and ``loop.is_chief``.
The shortcuts ``self.model``, ``self.optimizer`` and ``self.learning_rate`` are what a
Keras callback reaches as ``self.model``, ``self.model.optimizer`` and
``self.model.optimizer.learning_rate``: a PyTorch module has no optimizer, so the
optimizer that ``fit`` trains with is the callback's own attribute.
Under several workers every worker runs every callback, and they all see the same
epoch logs (metrics are global; batch logs are this worker's running values); only
the chief writes files.

This module holds what every callback and the loop need, so that the callbacks that
write files (:mod:`distrib.keras.callbacks`, :mod:`distrib.keras.tensorboard`) can live
in modules of their own without importing one another.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from distrib.keras.training import Loop

__all__ = [
    "Callback",
    "CallbackList",
    "History",
    "Logs",
    "as_learning_rate",
    "first_learning_rate",
    "set_learning_rate",
    "user_stacklevel",
]

Logs = dict[str, Any]


def _groups_with_lr(optimizer: torch.optim.Optimizer | None, who: str) -> list[dict[str, Any]]:
    """``optimizer``'s parameter groups, each with an ``lr``; a ValueError naming the fix otherwise."""
    if optimizer is None or not optimizer.param_groups or "lr" not in optimizer.param_groups[0]:
        raise ValueError(
            f"{who} needs an optimizer whose param_groups have an 'lr', got "
            f"{type(optimizer).__name__}: give fit an optimizer such as torch.optim.SGD(..., lr=...) "
            "(evaluate and predict train nothing, so their callbacks have no optimizer)"
        )
    return optimizer.param_groups


def _is_keras_optimizer(optimizer: Any) -> bool:
    """A Keras 3 optimizer (``learning_rate``, no ``param_groups``): ``fit`` takes a compiled Keras model's."""
    return optimizer is not None and not hasattr(optimizer, "param_groups") and hasattr(optimizer, "learning_rate")


def first_learning_rate(optimizer: torch.optim.Optimizer | None, who: str = "learning_rate") -> float:
    """The first parameter group's learning rate, a float (a tensor rate is read with ``float``); a Keras
    optimizer's ``learning_rate``."""
    if _is_keras_optimizer(optimizer):
        rate: Any = getattr(optimizer, "learning_rate")  # noqa: B009 (a Keras optimizer's, untyped here)
        return float(torch.as_tensor(getattr(rate, "value", rate)))
    return float(_groups_with_lr(optimizer, who)[0]["lr"])


def as_learning_rate(value: Any) -> float | None:
    """``value`` as a learning rate (a finite number or 0-d float tensor, as a float); None if it is not one."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def set_learning_rate(optimizer: torch.optim.Optimizer | None, value: Any, who: str = "learning_rate") -> float:
    """Set every parameter group's learning rate to ``value`` (see :func:`as_learning_rate`); return it.

    A tensor rate (a capturable optimizer's) stays a tensor and is filled in place, so the
    optimizer keeps reading the same tensor.
    """
    lr = as_learning_rate(value)
    if lr is None:
        raise ValueError(f"{who}: a learning rate must be a finite float, got {value!r}")
    if _is_keras_optimizer(optimizer):
        setattr(optimizer, "learning_rate", lr)  # noqa: B010 Keras assigns its variable (a schedule refuses)
        return lr
    for group in _groups_with_lr(optimizer, who):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return lr


class Callback:
    """Base class: override the hooks you need. ``logs`` hold the metrics so far.

    Keras' ``self.model.optimizer.learning_rate`` is ``self.learning_rate`` here (the first
    parameter group's rate, a float; assigning it sets every group's, as
    ``LearningRateScheduler`` does), and ``self.model.optimizer`` is ``self.optimizer``
    (the ``torch.optim.Optimizer`` given to ``fit``; None under ``evaluate`` and ``predict``).

    Example: the Keras tutorial's ``PrintLR``::

        >>> import distrib as ds, torch
        >>> class PrintLR(ds.callbacks.Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         print('Learning rate for epoch {} is {}'.format(epoch + 1, self.learning_rate))
        >>> model = torch.nn.Linear(2, 1)
        >>> decay = ds.callbacks.LearningRateScheduler(lambda epoch: 1e-3 if epoch < 1 else 1e-4)
        >>> _ = ds.fit(model, [(torch.ones(2, 2), torch.zeros(2, 1))], loss="mse", epochs=2, verbose=0,
        ...            optimizer=torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[decay, PrintLR()])
        Learning rate for epoch 1 is 0.001
        Learning rate for epoch 2 is 0.0001
    """

    loop: Loop

    def set_loop(self, loop: Loop) -> None:
        """Give the callback the running loop (``fit``, ``evaluate`` and ``predict`` call it before any hook).

        Args:
            loop: the loop, read through ``self.loop`` and the ``model``/``optimizer`` shortcuts.
        """
        self.loop = loop

    def _running(self, what: str) -> Loop:
        loop = self.__dict__.get("loop")
        if loop is None:
            raise AttributeError(
                f"{type(self).__name__}.{what} is the running loop's, set when fit, evaluate or "
                f"predict starts (it is not available in __init__); keep a value of your own under "
                f"another name"
            )
        return loop

    @property
    def model(self) -> torch.nn.Module:
        """The module being trained or evaluated (Keras' ``self.model``)."""
        return self._running("model").model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ``fit`` trains with (Keras' ``self.model.optimizer``); None under evaluate and predict."""
        return self._running("optimizer").optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__}.optimizer is the optimizer fit trains with, not settable; keep an "
            "optimizer of your own under another name"
        )

    @property
    def learning_rate(self) -> float:
        """The optimizer's learning rate, its first parameter group's (Keras' ``self.model.optimizer.learning_rate``).

        Assigning it sets every parameter group's rate; under parameter servers the new rate
        reaches the ps tasks with the next steps, as ``LearningRateScheduler``'s.
        """
        return first_learning_rate(self._running("learning_rate").optimizer, f"{type(self).__name__}.learning_rate")

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        set_learning_rate(self._running("learning_rate").optimizer, value, f"{type(self).__name__}.learning_rate")

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Called once when ``fit`` starts, before the first epoch (after a restore: at the resumed position).

        Args:
            logs: ``{}`` (no metrics yet).
        """

    def on_train_end(self, logs: Logs | None = None) -> None:
        """Called once when ``fit`` ends, normally or through ``stop_training``.

        Args:
            logs: the last epoch's logs.
        """

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Called at the start of each training epoch.

        Args:
            epoch: the epoch's index, from 0.
            logs: ``{}``.
        """

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Called at the end of each training epoch, after validation.

        Args:
            epoch: the epoch's index, from 0.
            logs: the epoch's metrics, global over every worker: ``loss``, the compiled metrics and ``val_``-prefixed validation ones.
        """

    def on_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Keras' older name of :meth:`on_train_batch_begin`, which calls it (as Keras' does).

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: as :meth:`on_train_batch_begin`'s.
        """

    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Keras' older name of :meth:`on_train_batch_end`, which calls it (as Keras' does).

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: as :meth:`on_train_batch_end`'s.
        """

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Called before each training batch; the base calls :meth:`on_batch_begin`.

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: ``{}``.
        """
        self.on_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Called after each training batch; the base calls :meth:`on_batch_end`.

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: this worker's running metrics over the epoch so far (``loss``, ...).
        """
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: Logs | None = None) -> None:
        """Called when ``evaluate`` (or ``fit``'s validation) starts.

        Args:
            logs: ``{}``.
        """

    def on_test_end(self, logs: Logs | None = None) -> None:
        """Called when ``evaluate`` (or ``fit``'s validation) ends.

        Args:
            logs: the evaluation's metrics.
        """

    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Called before each batch of ``evaluate``.

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: ``{}``.
        """

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Called after each batch of ``evaluate``.

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: this worker's running metrics so far.
        """

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        """Called when ``predict`` starts.

        Args:
            logs: ``{}``.
        """

    def on_predict_end(self, logs: Logs | None = None) -> None:
        """Called when ``predict`` ends.

        Args:
            logs: ``{}``.
        """

    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Called before each batch of ``predict``.

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: ``{}``.
        """

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Called after each batch of ``predict``.

        Args:
            batch: the batch's index in the epoch (or in the evaluation or prediction), from 0.
            logs: ``{"outputs": ...}``: the batch's predictions.
        """


#: the hooks whose only argument is ``logs`` (the others take a batch or epoch number first)
_LOGS_ONLY = frozenset(
    {"on_train_begin", "on_train_end", "on_test_begin", "on_test_end", "on_predict_begin", "on_predict_end"}
)


class CallbackList:
    """Calls a hook on every callback, in order: ``callbacks.on_epoch_end(epoch, logs)``.

    As Keras' ``CallbackList``, every hook gets a dict of logs (``{}`` when there is nothing to
    log yet: ``on_train_begin``, ``on_epoch_begin``, ``on_*_batch_begin``), the same dict for
    every callback, so ``list(logs.keys())`` in a callback works as in the Keras guides and
    what one callback adds (``LearningRateScheduler``'s ``lr``) reaches the next.

    Args:
        callbacks: the callbacks, called in this order.
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def set_loop(self, loop: Loop) -> None:
        """Give every callback the running loop.

        Args:
            loop: the loop (``fit``'s, ``evaluate``'s or ``predict``'s).
        """
        for c in self.callbacks:
            c.set_loop(loop)

    def __getattr__(self, hook: str) -> Any:
        if not hook.startswith("on_"):
            raise AttributeError(hook)
        at = 0 if hook in _LOGS_ONLY else 1  # where the logs argument is

        def call(*args: Any) -> None:
            if len(args) <= at or args[at] is None:
                args = (*args[:at], {})
            for c in self.callbacks:
                getattr(c, hook)(*args)

        return call


class History(Callback):
    """Per-epoch logs: ``history.history["loss"]`` is the list of epoch losses; returned by ``fit``."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # src/distrib/


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller that points at the first frame outside distrib.

    A callback's warning is meant for the line of the user's ``fit`` (or custom loop), however many of
    distrib's frames (the callback list, the loop's bookkeeping) lie between; a fixed number breaks when
    those change.

    Returns:
        1 when the caller is itself outside distrib, else 1 + the number of distrib frames above it.
    """
    frame = sys._getframe(1)  # the caller: the frame that calls warnings.warn
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level
