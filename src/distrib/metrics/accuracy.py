"""Keras' accuracy metrics: ``Accuracy``, ``BinaryAccuracy``, ``CategoricalAccuracy``,
``SparseCategoricalAccuracy``, ``TopKCategoricalAccuracy``, ``SparseTopKCategoricalAccuracy``.

Each is a :class:`~distrib.metrics.MeanMetricWrapper` of the function of the same name
(also public, as ``tf.keras.metrics.binary_accuracy`` is): a 1.0 or 0.0 per example
(per element for ``accuracy``), averaged with the sample weights. Created under a
strategy's scope and updated inside ``run``, ``result()`` covers every replica of every
worker. Argument order is Keras': ``update_state(y_true, y_pred, sample_weight=None)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from distrib.metrics.reduce import MeanMetricWrapper, squeeze_pair

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "SparseCategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "sparse_categorical_accuracy",
    "top_k_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
]


def _pair(y_true: Any, y_pred: Any) -> tuple[torch.Tensor, torch.Tensor]:
    pred = torch.as_tensor(y_pred)
    return torch.as_tensor(y_true, device=pred.device), pred


def _same_shape(name: str, y_true: torch.Tensor, y_pred: torch.Tensor, hint: str) -> None:
    if y_true.shape != y_pred.shape:
        raise ValueError(
            f"{name}: y_true of shape {list(y_true.shape)} and y_pred of shape {list(y_pred.shape)} differ; {hint}"
        )


def accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1.0 where ``y_pred`` equals ``y_true``, element by element (exact match, Keras' ``accuracy``).

    Example::

        >>> accuracy(torch.tensor([[1], [2]]), torch.tensor([[1], [0]]))
        tensor([[1.],
                [0.]], dtype=torch.float64)

    Args:
        y_true: the labels (a tensor, or anything ``torch.as_tensor`` takes).
        y_pred: the predictions, of ``y_true``'s shape (a trailing dimension of size 1 on either is dropped).

    Returns:
        A float64 tensor of 1.0 and 0.0, of the inputs' shape.

    Raises:
        ValueError: the shapes differ.
    """
    t, p = squeeze_pair(*_pair(y_true, y_pred))
    _same_shape("accuracy", t, p, "they are compared element by element")
    common = torch.promote_types(t.dtype, p.dtype)
    return (t.to(common) == p.to(common)).to(torch.float64)


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> torch.Tensor:
    """How often ``y_pred > threshold`` equals the 0/1 ``y_true``: the mean over the last axis, per example.

    With rank-1 inputs every element is one example (tf.keras would average the whole
    batch into one value, weighing a replica's short or empty batch like a full one).

    Example::

        >>> binary_accuracy(torch.tensor([[1.0], [1.0], [0.0], [0.0]]), torch.tensor([[0.98], [1.0], [0.0], [0.6]]))
        tensor([1., 1., 1., 0.], dtype=torch.float64)

    Args:
        y_true: 0/1 labels.
        y_pred: scores or probabilities, of ``y_true``'s shape.
        threshold: a prediction above it counts as 1.

    Returns:
        A float64 tensor: per example, the fraction of its last axis that is right.

    Raises:
        ValueError: the shapes differ.
    """
    t, p = squeeze_pair(*_pair(y_true, y_pred))
    _same_shape("binary_accuracy", t, p, "give one 0/1 label per prediction")
    hits = (t.to(torch.float64) == (p > threshold).to(torch.float64)).to(torch.float64)
    return hits.mean(-1) if hits.dim() >= 2 else hits


def categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1.0 where the arg-max of the one-hot ``y_true`` equals the arg-max of ``y_pred``, per example.

    Example::

        >>> categorical_accuracy(torch.tensor([[0, 0, 1], [0, 1, 0]]), torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]]))
        tensor([0., 1.], dtype=torch.float64)

    Args:
        y_true: one-hot labels, ``[batch, classes]``.
        y_pred: scores, of ``y_true``'s shape.

    Returns:
        A float64 tensor of 1.0 and 0.0, one per example.

    Raises:
        ValueError: the shapes differ.
    """
    t, p = _pair(y_true, y_pred)
    _same_shape(
        "categorical_accuracy",
        t,
        p,
        "y_true must be one-hot, of y_pred's shape (for integer labels use SparseCategoricalAccuracy)",
    )
    return (t.argmax(-1) == p.argmax(-1)).to(torch.float64)


def _sparse_labels(name: str, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """Integer labels of shape ``y_pred.shape[:-1]`` (a trailing dimension of size 1 is dropped)."""
    batch_shape = y_pred.shape[:-1]
    if y_true.dim() == y_pred.dim() and y_true.dim() > 0 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    if y_true.shape != batch_shape:
        if y_true.numel() != math.prod(batch_shape):
            raise ValueError(
                f"{name}: y_true of shape {list(y_true.shape)} does not hold one integer label per "
                f"row of y_pred {list(y_pred.shape)}; give labels of shape {list(batch_shape)} (for "
                "one-hot labels use the non-sparse metric)"
            )
        y_true = y_true.reshape(batch_shape)
    return y_true


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1.0 where the arg-max of ``y_pred`` (logits or probabilities) equals the integer label ``y_true``.

    Example::

        >>> sparse_categorical_accuracy(torch.tensor([[2], [1]]), torch.tensor([[0.1, 0.6, 0.3], [0.05, 0.95, 0]]))
        tensor([0., 1.], dtype=torch.float64)

    Args:
        y_true: integer labels, ``[batch]`` or ``[batch, 1]``.
        y_pred: scores, ``[batch, classes]``.

    Returns:
        A float64 tensor of 1.0 and 0.0, one per example.

    Raises:
        ValueError: ``y_true`` does not hold one label per row of ``y_pred``.
    """
    t, p = _pair(y_true, y_pred)
    t = _sparse_labels("sparse_categorical_accuracy", t, p)
    predicted = p.argmax(-1)
    if t.is_floating_point():  # float labels (2.0) compare as Keras does, after casting the arg-max
        return (predicted.to(t.dtype) == t).to(torch.float64)
    return (predicted == t.to(predicted.dtype)).to(torch.float64)


def sparse_top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> torch.Tensor:
    """1.0 where the integer label ``y_true`` is among the ``k`` largest entries of ``y_pred`` (TF's ``in_top_k``).

    Ties at the k-th place count as in (fewer than ``k`` entries are strictly larger);
    a row with a non-finite entry, or a label out of range, counts as out, as in TF.

    Example::

        >>> scores = torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]])
        >>> sparse_top_k_categorical_accuracy(torch.tensor([2, 1]), scores, k=1)
        tensor([0., 1.], dtype=torch.float64)

    Args:
        y_true: integer labels, ``[batch]`` or ``[batch, 1]``.
        y_pred: scores, ``[batch, classes]``.
        k: how many of the largest scores count.

    Returns:
        A float64 tensor of 1.0 and 0.0, one per example.

    Raises:
        ValueError: ``y_true`` does not hold one label per row of ``y_pred``.
    """
    t, p = _pair(y_true, y_pred)
    t = _sparse_labels("sparse_top_k_categorical_accuracy", t, p)
    classes = p.shape[-1]
    rows, labels = p.reshape(-1, classes), t.reshape(-1).to(torch.long)
    valid = (labels >= 0) & (labels < classes) & torch.isfinite(rows).all(-1)
    target = rows.gather(1, labels.clamp(0, max(classes - 1, 0)).unsqueeze(1))
    hits = ((rows > target).sum(-1) < k) & valid
    return hits.to(torch.float64).reshape(p.shape[:-1])


def top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> torch.Tensor:
    """1.0 where the arg-max of the one-hot ``y_true`` is among the ``k`` largest entries of ``y_pred``.

    Example::

        >>> scores = torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]])
        >>> top_k_categorical_accuracy(torch.tensor([[0, 0, 1], [0, 1, 0]]), scores, k=2)
        tensor([1., 1.], dtype=torch.float64)

    Args:
        y_true: one-hot labels, ``[batch, classes]``.
        y_pred: scores, of ``y_true``'s shape.
        k: how many of the largest scores count.

    Returns:
        A float64 tensor of 1.0 and 0.0, one per example.

    Raises:
        ValueError: the shapes differ.
    """
    t, p = _pair(y_true, y_pred)
    _same_shape(
        "top_k_categorical_accuracy",
        t,
        p,
        "y_true must be one-hot, of y_pred's shape (for integer labels use SparseTopKCategoricalAccuracy)",
    )
    return sparse_top_k_categorical_accuracy(t.argmax(-1), p, k=k)


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer (how many top predictions count), got k={k!r}")
    return k


class Accuracy(MeanMetricWrapper):
    """How often ``y_pred`` equals ``y_true`` exactly, element by element.

    Example::

        >>> m = Accuracy()
        >>> m.update_state(torch.tensor([[1], [2], [3], [4]]), torch.tensor([[0], [2], [3], [4]]))
        >>> m.result()
        tensor(0.7500)

    Args:
        name: the metric's name in the logs (default ``"accuracy"``).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).
    """

    default_name = "accuracy"

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        super().__init__(accuracy, name=name, dtype=dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` matches the 0/1 labels ``y_true``.

    ``threshold=0.5`` suits probabilities; for logits (a model trained with
    ``BCEWithLogitsLoss``) give ``threshold=0.0``.

    Example::

        >>> m = BinaryAccuracy(threshold=0.7)
        >>> m.update_state(torch.tensor([[1], [1], [0], [0]]), torch.tensor([[0.9], [0.6], [0.4], [0.8]]))
        >>> m.result()
        tensor(0.5000)

    Args:
        name: the metric's name in the logs (default ``"binary_accuracy"``).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).
        threshold: a prediction above it counts as 1 (0.0 for logits).

    Raises:
        ValueError: ``threshold`` is not a finite number.
    """

    default_name = "binary_accuracy"

    def __init__(self, name: str | None = None, dtype: Any = None, threshold: float = 0.5) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(
                f"threshold must be a finite number (0.5 for probabilities, 0.0 for logits), "
                f"got threshold={threshold!r}"
            )
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=float(threshold))
        self.threshold = float(threshold)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max of ``y_pred`` matches the one-hot labels ``y_true``.

    Example::

        >>> m = CategoricalAccuracy()
        >>> m.update_state(torch.tensor([[0, 0, 1], [0, 1, 0]]), torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]]))
        >>> m.result()
        tensor(0.5000)

    Args:
        name: the metric's name in the logs (default ``"categorical_accuracy"``).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).
    """

    default_name = "categorical_accuracy"

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max of ``y_pred`` (logits or probabilities) equals the integer ``y_true``.

    Example::

        >>> acc = SparseCategoricalAccuracy()
        >>> acc.update_state(torch.tensor([1, 0]), torch.tensor([[0.1, 0.9], [0.2, 0.8]]))
        >>> acc.result()
        tensor(0.5000)

    Args:
        name: the metric's name in the logs (default ``"sparse_categorical_accuracy"``).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).
    """

    default_name = "sparse_categorical_accuracy"

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot label is among the ``k`` largest predictions.

    Example::

        >>> m = TopKCategoricalAccuracy(k=1)
        >>> m.update_state(torch.tensor([[0, 0, 1], [0, 1, 0]]), torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]]))
        >>> m.result()
        tensor(0.5000)

    Args:
        k: how many of the largest scores count.
        name: the metric's name in the logs (default ``"top_k_categorical_accuracy"``).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).

    Raises:
        ValueError: ``k`` is not a positive int.
    """

    default_name = "top_k_categorical_accuracy"

    def __init__(self, k: int = 5, name: str | None = None, dtype: Any = None) -> None:
        super().__init__(top_k_categorical_accuracy, name=name, dtype=dtype, k=_check_k(k))
        self.k = k


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is among the ``k`` largest predictions.

    Example::

        >>> m = SparseTopKCategoricalAccuracy(k=1)
        >>> m.update_state(torch.tensor([2, 1]), torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]]))
        >>> m.result()
        tensor(0.5000)

    Args:
        k: how many of the largest scores count.
        name: the metric's name in the logs (default ``"sparse_top_k_categorical_accuracy"``).
        dtype: the dtype the state accumulates in (a torch dtype or its name; default float64).

    Raises:
        ValueError: ``k`` is not a positive int.
    """

    default_name = "sparse_top_k_categorical_accuracy"

    def __init__(self, k: int = 5, name: str | None = None, dtype: Any = None) -> None:
        super().__init__(sparse_top_k_categorical_accuracy, name=name, dtype=dtype, k=_check_k(k))
        self.k = k
