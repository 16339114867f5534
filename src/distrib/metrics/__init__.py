"""Metrics whose result covers every replica of every worker (``tf.keras.metrics`` names).

A metric keeps a few additive state tensors. Replicas of one process update the
same object (replicas take turns, so updates never race); ``result()`` first sums
the state over workers through the strategy's communicator (a collective: every
worker calls it), then computes the value. The strategy is the one the metric was
built under, else the first one it is updated under (so a metric built outside the
scope still sums over every worker). Subclasses only declare their states and
implement ``deltas`` and ``_compute`` (:mod:`distrib.metrics.base`).

* :mod:`~distrib.metrics.reduce`: ``Mean``, ``Sum``, ``MeanMetricWrapper``;
* :mod:`~distrib.metrics.accuracy`: ``Accuracy``, ``BinaryAccuracy``, ``CategoricalAccuracy``,
  ``SparseCategoricalAccuracy``, ``TopKCategoricalAccuracy``, ``SparseTopKCategoricalAccuracy``
  and their functions;
* :mod:`~distrib.metrics.registry`: ``get`` (Keras names, as ``fit(metrics=[...])`` takes them).

``torchmetrics`` metrics work too inside ``run``: under a multi-worker strategy they
synchronise through ``torch.distributed`` themselves.
"""

from distrib.metrics.accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    TopKCategoricalAccuracy,
    accuracy,
    binary_accuracy,
    categorical_accuracy,
    sparse_categorical_accuracy,
    sparse_top_k_categorical_accuracy,
    top_k_categorical_accuracy,
)
from distrib.metrics.base import Metric
from distrib.metrics.reduce import Mean, MeanMetricWrapper, Sum
from distrib.metrics.registry import get

__all__ = [
    "Metric",
    "Mean",
    "Sum",
    "MeanMetricWrapper",
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
    "get",
]
