"""Metrics a scheduled function captures: they travel to the workers as fresh copies (see ``ClusterCoordinator``).

``ds.metrics`` metrics and ``torchmetrics`` ones whose states merge (``full_state_update=False``) are sent
as copies reset to their defaults, pickled by the metric's own rules; a worker's updates come back with
each call's result and are added to the coordinator's metric.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from distrib.parameter_server.weak_names import WeakNames
from distrib.torch_patches import mark_metric_updated

__all__ = ["CapturedMetrics", "MetricCopy", "is_metric", "rebuild_metric"]


def is_metric(obj: Any) -> bool:
    from distrib.metrics.base import Metric

    if isinstance(obj, Metric):
        return True
    torchmetrics = sys.modules.get("torchmetrics")  # only if the user imported it: then such objects can exist
    return torchmetrics is not None and isinstance(obj, torchmetrics.Metric)


class MetricCopy:
    """Pickles as a copy of ``metric`` with a fresh state (the metric's own pickling rules)."""

    def __init__(self, metric: Any) -> None:
        if not hasattr(metric, "merge_deltas") and (
            metric.full_state_update or metric.full_state_update is None or metric.dist_sync_on_step
        ):
            raise TypeError(
                f"{type(metric).__name__} (torchmetrics, full_state_update or dist_sync_on_step) cannot "
                "add up updates made on several workers; use a metric whose states merge "
                "(full_state_update=False), or a ds.metrics one"
            )
        self.metric = metric

    def __reduce_ex__(self, protocol: Any) -> Any:
        metric = self.metric
        if not hasattr(metric, "merge_deltas"):  # torchmetrics: a copy reset to its defaults
            metric = metric.clone()
            metric.reset()
        reduced = metric.__reduce_ex__(protocol)  # ds.metrics: __getstate__ gives a fresh state
        if not isinstance(reduced, tuple) or len(reduced) < 3 or getattr(reduced[0], "__name__", "") != "__newobj__":
            raise TypeError(f"cannot send metric {metric!r} to the workers: it does not pickle as a plain object")
        return (rebuild_metric, (reduced[1][0], reduced[1][1:], reduced[2]))


def rebuild_metric(cls: type, args: tuple, state: Any) -> Any:
    """Unpickle what ``MetricCopy`` pickled: ``cls.__new__(cls, *args)`` given ``state`` as pickle does."""
    metric = cls.__new__(cls, *args)
    if state is None:
        return metric
    if hasattr(metric, "__setstate__") and not isinstance(state, tuple):
        metric.__setstate__(state)
        return metric
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        metric.__dict__.update(state)
    for name, value in (slots or {}).items():
        setattr(metric, name, value)
    return metric


class CapturedMetrics:
    """The coordinator's metrics that scheduled functions captured, by the names they travel under."""

    def __init__(self, prefix: str) -> None:
        self._names = WeakNames(prefix)
        self._lock = threading.Lock()  # one call's deltas merged at a time

    def key(self, metric: Any) -> str:
        """The name ``metric`` travels under (the same for every function that captures it)."""
        return self._names.name(metric)

    def merge(self, deltas: dict[str, dict[str, Any]]) -> None:
        """Add one completed call's deltas (metric name -> its worker copy's state) into the metrics here;
        metrics garbage-collected since are skipped."""
        with self._lock:
            for key, state in deltas.items():
                metric = self._names.get(key)
                if metric is None:
                    continue
                if hasattr(metric, "merge_deltas"):
                    metric.merge_deltas(state)
                else:  # a torchmetrics.Metric
                    metric.merge_state(state)
                    mark_metric_updated(metric)  # it has seen an update: compute() must not warn
