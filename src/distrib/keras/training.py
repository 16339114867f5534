"""What a training loop keeps and its callbacks see (:class:`Loop`), and the bookkeeping every training
loop does with it (:class:`Training`): ``ds.fit``'s, and ``distrib train``'s custom loop (TF's tutorial's).

Both loops resume the same way: a callback that restores a backup at ``on_train_begin``
(``BackupAndRestore``, ``distrib train``'s preemption handler) sets ``loop.epoch`` and
``loop.step_in_epoch``; :meth:`Training.epochs` starts at that epoch, the loop skips
:attr:`Training.resume_at` batches of it, and each trained batch and each finished epoch moves
the position on, with the callbacks' hooks, in one place.

Example::

    >>> import torch
    >>> import distrib as ds
    >>> model = torch.nn.Linear(2, 1)
    >>> run = Training(Loop(model, None, ds.get_strategy()), [])
    >>> run.begin()
    >>> for epoch in run.epochs(2):
    ...     for batch in range(run.resume_at, 3):
    ...         run.batch_begin(batch)
    ...         _ = run.batch_end({"loss": 1.0})
    ...     run.end_epoch(epoch, {"loss": 1.0})
    >>> run.end({"loss": 1.0}).history
    {'loss': [1.0, 1.0]}
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from distrib.keras.callback_base import Callback, CallbackList, History

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["Loop", "Training"]


@dataclass
class Loop:
    """What callbacks see of a running loop: ``epoch`` and ``step_in_epoch`` are where it resumes from.

    ``scheduled``: the steps run on other processes, scheduled by the strategy's executor
    (:attr:`~distrib.strategies.execution.StepExecutor.scheduled`), so the model never runs here.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    strategy: Strategy
    steps_per_epoch: int | None = None
    epoch: torch.Tensor = field(default_factory=lambda: torch.tensor(0))
    step_in_epoch: torch.Tensor = field(default_factory=lambda: torch.tensor(0))
    scheduled: bool = False
    _stop: bool = field(default=False, repr=False)

    @property
    def is_chief(self) -> bool:
        return self.strategy.is_chief

    @property
    def stop_training(self) -> bool:
        """Set it (``self.loop.stop_training = True``) to stop after this batch or epoch.

        Keras' own spelling, ``self.model.stop_training = True`` in a callback, stops training
        too: it sets a plain attribute on the module, which ``fit`` reads here (and sets back
        to False when a ``fit`` starts, as Keras does), so a literal port is never ignored.
        """
        return self._stop or vars(self.model).get("stop_training") is True

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self._stop = bool(value)
        if not value and vars(self.model).get("stop_training") is True:
            setattr(self.model, "stop_training", False)  # noqa: B010 the user's attribute (Module types it as a submodule)


class Training:
    """The epoch, resume and callback bookkeeping of one training loop over ``loop``.

    ``callbacks`` fire in order, then :attr:`history` (last, as in Keras: it sees what the
    others add to the logs). The loop calls :meth:`begin`, then for each epoch of
    :meth:`epochs`: :meth:`batch_begin` and :meth:`batch_end` around each batch it trains (from
    batch :attr:`resume_at`), and :meth:`end_epoch`; then :meth:`end`.
    """

    def __init__(self, loop: Loop, callbacks: Sequence[Callback]) -> None:
        self.loop = loop
        self.history = History()
        self.callbacks = CallbackList([*callbacks, self.history])
        self.callbacks.set_loop(loop)

    def begin(self) -> None:
        """``on_train_begin``: where a restored backup sets the position training resumes from."""
        self.callbacks.on_train_begin()

    def epochs(self, epochs: int) -> Iterator[int]:
        """Each epoch left of ``epochs``, from ``loop.epoch``, until a callback stops training; ``on_epoch_begin``
        fires before each. The loop ends each with :meth:`end_epoch` (or stops iterating)."""
        while int(self.loop.epoch) < epochs and not self.loop.stop_training:
            epoch = int(self.loop.epoch)
            self.callbacks.on_epoch_begin(epoch)
            yield epoch
            if int(self.loop.epoch) == epoch:  # else the same epoch again, forever
                raise RuntimeError(f"epoch {epoch + 1} was not ended (Training.end_epoch): a bug in the loop")

    @property
    def resume_at(self) -> int:
        """How many batches of this epoch were trained before training resumed (0 when it did not)."""
        return int(self.loop.step_in_epoch)

    def batch_begin(self, batch: int) -> None:
        """``on_train_batch_begin``, before batch ``batch`` (its index in the epoch) is trained."""
        self.callbacks.on_train_batch_begin(batch)

    def batch_end(self, logs: dict[str, Any]) -> int:
        """The epoch's next batch is trained (batches finish in order): the position moves past it, then
        ``on_train_batch_end``; returns the batch's index in the epoch."""
        self.loop.step_in_epoch += 1  # in place: a checkpoint of the position holds these tensors
        batch = int(self.loop.step_in_epoch) - 1
        self.callbacks.on_train_batch_end(batch, logs)
        return batch

    def end_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        """Epoch ``epoch`` is done: the position moves to the next epoch's start, then ``on_epoch_end``."""
        self.loop.epoch += 1
        self.loop.step_in_epoch.zero_()
        self.callbacks.on_epoch_end(epoch, logs)

    def end(self, logs: dict[str, Any] | None = None) -> History:
        """``on_train_end``; the History of the run."""
        self.callbacks.on_train_end(logs)
        return self.history
