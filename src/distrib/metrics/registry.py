"""``ds.metrics.get``: a metric from a Keras name, a class, a function or an instance.

What ``ds.fit(..., metrics=[...])`` uses, with Keras' ``compile`` rules: ``"accuracy"`` /
``"acc"`` become binary, sparse-categorical or categorical accuracy depending on the
shapes of ``y_true`` and ``y_pred`` (decided on each batch, as Keras decides once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from distrib.losses import PER_EXAMPLE_LOSSES
from distrib.metrics.accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    TopKCategoricalAccuracy,
    binary_accuracy,
    categorical_accuracy,
    sparse_categorical_accuracy,
)
from distrib.metrics.base import Metric
from distrib.metrics.reduce import Mean, MeanMetricWrapper, Sum

__all__ = ["get", "accuracy_by_shape"]


def accuracy_by_shape(y_true: Any, y_pred: Any, threshold: float = 0.5) -> torch.Tensor:
    """Keras ``compile``'s ``"accuracy"``: binary when ``y_pred`` has one output per example (last
    dimension 1, or rank 1), sparse-categorical when ``y_true`` holds integer labels (lower rank,
    or last dimension 1), else categorical (one-hot ``y_true``).

    Example::

        >>> accuracy_by_shape(torch.tensor([1, 0]), torch.tensor([[0.1, 0.9], [0.2, 0.8]]))  # integer labels
        tensor([1., 0.], dtype=torch.float64)
        >>> accuracy_by_shape(torch.tensor([[1.0], [0.0]]), torch.tensor([[0.9], [0.8]]))  # one probability each
        tensor([1., 0.], dtype=torch.float64)
    """
    t, p = torch.as_tensor(y_true), torch.as_tensor(y_pred)
    if p.dim() <= 1 or p.shape[-1] == 1:
        return binary_accuracy(t, p, threshold)
    if t.dim() < p.dim() or (t.dim() > 0 and t.shape[-1] == 1):
        return sparse_categorical_accuracy(t, p)
    return categorical_accuracy(t, p)


_CLASSES: dict[str, Callable[[], Metric]] = {
    cls.__name__: cls
    for cls in (
        Accuracy,
        BinaryAccuracy,
        CategoricalAccuracy,
        SparseCategoricalAccuracy,
        TopKCategoricalAccuracy,
        SparseTopKCategoricalAccuracy,
        Mean,
        Sum,
    )
}


def get(identifier: Any, *, binary_threshold: float = 0.5) -> Metric:
    """A metric from a Keras name, a Metric class or instance (an instance is returned as is), or a function.

    Names: ``"accuracy"``/``"acc"`` (resolved by shape, as Keras' ``compile`` does),
    ``"binary_accuracy"``, ``"categorical_accuracy"``, ``"sparse_categorical_accuracy"``,
    ``"top_k_categorical_accuracy"``, ``"sparse_top_k_categorical_accuracy"`` (k=5),
    ``"mse"``, ``"mae"`` (and their long names), or a class name (``"BinaryAccuracy"``).
    A function ``fn(y_true, y_pred)`` of per-example values is averaged
    (:class:`MeanMetricWrapper`). ``binary_threshold`` is the threshold of binary
    accuracies made from a name (``ds.fit`` gives 0.0 when its loss takes logits).

    Example::

        >>> get("sparse_top_k_categorical_accuracy")
        SparseTopKCategoricalAccuracy(name='sparse_top_k_categorical_accuracy')
        >>> get("acc").name
        'accuracy'

    Args:
        identifier: a name, a ``Metric`` class or instance, or a function ``fn(y_true, y_pred)``.
        binary_threshold: the threshold of a binary accuracy made from a name.

    Returns:
        The metric (``identifier`` itself when it is already one).

    Raises:
        ValueError: an unknown name, or a torchmetrics metric (it keeps its own state; ``fit`` merges deltas).
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    names: dict[str, Callable[[], Metric]] = {
        "accuracy": lambda: MeanMetricWrapper(accuracy_by_shape, name="accuracy", threshold=binary_threshold),
        "binary_accuracy": lambda: BinaryAccuracy(threshold=binary_threshold),
        "categorical_accuracy": CategoricalAccuracy,
        "sparse_categorical_accuracy": SparseCategoricalAccuracy,
        "top_k_categorical_accuracy": TopKCategoricalAccuracy,
        "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    }
    names["acc"] = names["accuracy"]
    for loss_name in ("mse", "mean_squared_error", "mae", "mean_absolute_error"):
        names[loss_name] = functools.partial(MeanMetricWrapper, PER_EXAMPLE_LOSSES[loss_name], name=loss_name)
    if isinstance(identifier, str):
        if identifier in _CLASSES:
            return _CLASSES[identifier]()
        if identifier.lower() in names:
            return names[identifier.lower()]()
    elif isinstance(identifier, torch.nn.Module):  # a torchmetrics metric: it keeps its own state, not deltas
        raise ValueError(
            f"{type(identifier).__name__} is not a ds.metrics metric: fit and evaluate merge metric "
            "deltas from every step, which only ds.metrics metrics give. Use it in your own loop "
            "(it works inside strategy.run), or pass a ds.metrics metric or a function"
        )
    elif callable(identifier):
        return MeanMetricWrapper(identifier)
    raise ValueError(
        f"unknown metric {identifier!r}: use one of {sorted(names)}, a class name "
        f"({', '.join(sorted(_CLASSES))}), a ds.metrics.Metric, or a function fn(y_true, y_pred) "
        "of per-example values"
    )
