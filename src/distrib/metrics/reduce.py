"""``Mean``, ``Sum`` and ``MeanMetricWrapper``: Keras' reducing metrics, over every replica and worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distrib.metrics.base import Metric, divide_no_nan, weighted_total

__all__ = ["Mean", "Sum", "MeanMetricWrapper"]


class Mean(Metric):
    """Weighted mean of every value given to ``update_state(values, sample_weight=None)``.

    Example::

        >>> m = Mean()
        >>> m.update_state(torch.tensor([1.0, 2.0, 3.0]))
        >>> m.result()
        tensor(2.)
        >>> float(m([4.0, 8.0], sample_weight=[0.0, 1.0]))  # update, then the result
        3.5
    """

    _state_names = ("total", "count")
    default_name = "mean"

    def deltas(self, values: Any, sample_weight: Any = None) -> dict[str, torch.Tensor]:
        """What ``update_state(values, sample_weight)`` adds, without adding it.

        Args:
            values: the values to average (a tensor, a number or a list).
            sample_weight: a weight per value (broadcast to ``values``' shape); None: 1 each.

        Returns:
            ``{"total": weighted sum, "count": sum of the weights}``.
        """
        total, count = weighted_total(values, sample_weight, reduce="mean")
        return {"total": total, "count": count}

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return divide_no_nan(state["total"], state["count"])


class Sum(Metric):
    """Weighted sum of every value given to ``update_state(values, sample_weight=None)``.

    Example::

        >>> s = Sum()
        >>> s.update_state(torch.tensor([1.0, 5.0]), sample_weight=torch.tensor([1.0, 0.2]))
        >>> s.result()
        tensor(2.)
    """

    _state_names = ("total",)
    default_name = "sum"

    def deltas(self, values: Any, sample_weight: Any = None) -> dict[str, torch.Tensor]:
        """What ``update_state(values, sample_weight)`` adds, without adding it.

        Args:
            values: the values to sum.
            sample_weight: a weight per value (broadcast to ``values``' shape); None: 1 each.

        Returns:
            ``{"total": the weighted sum}``.
        """
        return {"total": weighted_total(values, sample_weight, reduce="sum")[0]}

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return state["total"]


def squeeze_pair(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras' ``squeeze_or_expand_dimensions(y_pred, y_true)``: drop a last dimension of size 1 that one has extra."""
    diff = y_pred.dim() - y_true.dim()
    if diff == 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    elif diff == -1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    return y_true, y_pred


class MeanMetricWrapper(Mean):
    """The weighted mean of ``fn(y_true, y_pred, **kwargs)`` (a value per example, or per element).

    ``update_state(y_true, y_pred, sample_weight=None)``. Keras' accuracy metrics are
    built on it; give it any function of that shape, e.g. a per-example loss.

    Example::

        >>> mae = MeanMetricWrapper(lambda t, p: (t - p).abs(), name="mae")
        >>> mae.update_state(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
        >>> mae.result()
        tensor(0.2500)

    Args:
        fn: ``fn(y_true, y_pred, **kwargs)``, returning a value per example (or per element).
        name: the metric's name in the logs (default: ``fn``'s name).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).
        **kwargs: passed to ``fn`` on every call (``k=``, ``threshold=``).
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, dtype: Any = None, **kwargs: Any) -> None:
        super().__init__(name=name or self.default_name or getattr(fn, "__name__", "mean_metric_wrapper"), dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    def matches(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        """The values this metric averages for one batch (``fn(y_true, y_pred, **kwargs)``).

        Args:
            y_true: the labels.
            y_pred: the predictions.

        Returns:
            ``fn(y_true, y_pred, **kwargs)`` as a tensor.
        """
        return torch.as_tensor(self._fn(torch.as_tensor(y_true), torch.as_tensor(y_pred), **self._fn_kwargs))

    def deltas(  # type: ignore[override]
        self, y_true: Any, y_pred: Any, sample_weight: Any = None
    ) -> dict[str, torch.Tensor]:
        """What ``update_state(y_true, y_pred, sample_weight)`` adds, without adding it.

        Args:
            y_true: the labels.
            y_pred: the predictions.
            sample_weight: a weight per example; None: 1 each.

        Returns:
            ``{"total": ..., "count": ...}``, as ``Mean.deltas`` of :meth:`matches`.
        """
        return super().deltas(self.matches(y_true, y_pred), sample_weight)

    def get_config(self) -> dict[str, Any]:
        """``name``, ``dtype`` and the function's keyword arguments (``k``, ``threshold``), as Keras reports them.

        The metric classes built on this wrapper rebuild from it with ``from_config``; a
        wrapper of your own function is rebuilt by calling it again with the function.

        Returns:
            ``{"name": ..., "dtype": ..., **kwargs}``.
        """
        return {**super().get_config(), **self._fn_kwargs}
