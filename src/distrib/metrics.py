"""Metrics whose result covers every replica of every worker (``tf.keras.metrics`` names).

A metric keeps a few additive state tensors. Replicas of one process update the
same object (replicas take turns, so updates never race); ``result()`` first sums
the state over workers through the strategy's communicator (a collective: every
worker calls it), then computes the value. Subclasses only declare their states
and implement ``update_state`` and ``_compute``.

``torchmetrics`` metrics work too: under a multi-worker strategy they synchronise
through ``torch.distributed`` themselves.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import torch

from distrib import context
from distrib.losses import PER_EXAMPLE_LOSSES

__all__ = ["Metric", "Mean", "MeanMetricWrapper", "Sum", "SparseCategoricalAccuracy", "get"]


class Metric:
    """Base of distrib's metrics: named additive states, summed over workers on ``result()``.

    Subclasses implement ``deltas(...)``, which returns how much each state grows for the
    given inputs without touching the state (so a parameter-server worker can compute it
    and the coordinator add it), and ``_compute(state)``.
    """

    _state_names: tuple[str, ...] = ()

    def __init__(self, name: Optional[str] = None, dtype: torch.dtype = torch.float64) -> None:
        self.name = name or type(self).__name__.lower()
        self._strategy = context.get_strategy()
        device = self._strategy.local_devices[0]
        self._state = {k: torch.zeros((), dtype=dtype, device=device) for k in self._state_names}
        self._lock = threading.Lock()

    def _add(self, **deltas: torch.Tensor) -> None:
        with self._lock, torch.no_grad():
            for k, v in deltas.items():
                state = self._state[k]
                state.add_(v.detach().to(state.device, state.dtype))

    def deltas(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulate the inputs (TF's argument order, e.g. ``y_true, y_pred``)."""
        self._add(**self.deltas(*args, **kwargs))

    def merge_deltas(self, deltas: dict[str, torch.Tensor]) -> None:
        """Add state deltas computed elsewhere (by ``deltas``) into this metric."""
        self._add(**deltas)

    def __getstate__(self) -> dict[str, Any]:
        # a copy sent to another process computes deltas only: no lock, no strategy, fresh state
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_strategy", "_state")}
        state["_state"] = {k: torch.zeros_like(v, device="cpu") for k, v in self._state.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._strategy = context.default_strategy()

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The metric over everything seen by every replica since the last reset (a 0-d float32 tensor)."""
        with self._lock:
            state = {k: v.clone() for k, v in self._state.items()}
        if self._strategy.num_workers > 1:
            self._strategy.communicator.all_reduce(list(state.values()))
        return self._compute(state).to(torch.float32).cpu()

    def local_result(self) -> torch.Tensor:
        """The metric over this worker's replicas only: no collective, for per-step progress display."""
        with self._lock:
            state = {k: v.clone() for k, v in self._state.items()}
        return self._compute(state).to(torch.float32).cpu()

    def reset_state(self) -> None:
        """Forget everything seen so far."""
        with self._lock:
            for v in self._state.values():
                v.zero_()

    reset_states = reset_state  # the TF < 2.5 spelling used by the tutorials

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update_state(...)`` then ``result()``, as Keras metrics do."""
        self.update_state(*args, **kwargs)
        return self.result()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            for k, v in state.items():
                self._state[k].copy_(v)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


class Mean(Metric):
    """Weighted mean of every value given to ``update_state``.

    Example::

        >>> m = Mean()
        >>> m.update_state(torch.tensor([1.0, 2.0, 3.0]))
        >>> m.result()
        tensor(2.)
    """

    _state_names = ("total", "count")

    def deltas(self, values: Any, sample_weight: Any = None) -> dict[str, torch.Tensor]:
        values = torch.as_tensor(values)
        if sample_weight is None:
            return {"total": values.sum(), "count": torch.tensor(values.numel())}
        w = torch.broadcast_to(torch.as_tensor(sample_weight, device=values.device), values.shape)
        return {"total": (values * w).sum(), "count": w.sum()}

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return _divide_no_nan(state["total"], state["count"])


class Sum(Metric):
    """Sum of every value given to ``update_state``."""

    _state_names = ("total",)

    def deltas(self, values: Any, sample_weight: Any = None) -> dict[str, torch.Tensor]:
        values = torch.as_tensor(values)
        if sample_weight is not None:
            values = values * torch.as_tensor(sample_weight, device=values.device)
        return {"total": values.sum()}

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return state["total"]


class SparseCategoricalAccuracy(Metric):
    """How often the arg-max of ``y_pred`` (logits or probabilities) equals the integer ``y_true``.

    The argument order is TF's: ``update_state(y_true, y_pred)``.

    Example::

        >>> acc = SparseCategoricalAccuracy()
        >>> acc.update_state(torch.tensor([1, 0]), torch.tensor([[0.1, 0.9], [0.2, 0.8]]))
        >>> acc.result()
        tensor(0.5000)
    """

    _state_names = ("correct", "count")

    def deltas(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> dict[str, torch.Tensor]:
        y_pred = torch.as_tensor(y_pred)
        y_true = torch.as_tensor(y_true, device=y_pred.device).reshape(y_pred.shape[:-1])
        hits = (y_pred.argmax(dim=-1) == y_true.to(torch.long)).to(torch.float64)
        if sample_weight is None:
            return {"correct": hits.sum(), "count": torch.tensor(hits.numel())}
        w = torch.broadcast_to(torch.as_tensor(sample_weight, device=hits.device, dtype=hits.dtype), hits.shape)
        return {"correct": (hits * w).sum(), "count": w.sum()}

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return _divide_no_nan(state["correct"], state["count"])


class MeanMetricWrapper(Mean):
    """The mean over examples of ``fn(y_true, y_pred)`` (per-example values), e.g. ``mae``."""

    def __init__(self, fn: Any, name: Optional[str] = None) -> None:
        super().__init__(name=name or getattr(fn, "__name__", "mean_metric"))
        self._fn = fn

    def deltas(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return super().deltas(self._fn(torch.as_tensor(y_true), torch.as_tensor(y_pred)), sample_weight)


def get(identifier: Any) -> Metric:
    """A metric from a Keras name (``"accuracy"``, ``"mse"``, ``"mae"``) or a Metric (returned as is)."""
    if isinstance(identifier, Metric):
        return identifier
    names: dict[str, Callable[[], Metric]] = {
        "accuracy": lambda: SparseCategoricalAccuracy(name="accuracy"),
        "acc": lambda: SparseCategoricalAccuracy(name="accuracy"),
        "sparse_categorical_accuracy": lambda: SparseCategoricalAccuracy(name="sparse_categorical_accuracy"),
    }
    for loss_name in ("mse", "mean_squared_error", "mae", "mean_absolute_error"):
        names[loss_name] = functools.partial(MeanMetricWrapper, PER_EXAMPLE_LOSSES[loss_name], name=loss_name)
    if isinstance(identifier, str) and identifier.lower() in names:
        return names[identifier.lower()]()
    raise ValueError(f"unknown metric {identifier!r}: use one of {sorted(names)} or a ds.metrics.Metric instance")
