"""Conformance: TF's ``tensorflow/python/keras/metrics_test.py``, ported for the metrics distrib claims.

Ported: ``KerasSumTest``, ``MeanTest``, ``KerasAccuracyTest``, ``TopKCategoricalAccuracyTest``,
``SparseTopKCategoricalAccuracyTest`` and ``CustomMetricsTest.test_metric_wrappers_autograph``
(``Mean``, ``Sum``, ``Accuracy``, ``BinaryAccuracy``, ``CategoricalAccuracy``,
``SparseCategoricalAccuracy``, ``TopKCategoricalAccuracy``, ``SparseTopKCategoricalAccuracy``,
``MeanMetricWrapper``, ``get``). Each test names the TF test it ports. Not ported: tests of
graph placeholders and ``tf.function`` (no graphs in PyTorch), of ragged tensors (PyTorch has
none), and of metric classes distrib does not claim. Deliberate differences, asserted here:

* a metric's ``dtype`` (its state) is float64 by default, TF's float32: a float32 count stops
  growing by one past 2**24 examples, a silently wrong mean on large data; ``result()`` is
  float32 as in TF;
* ``ds.metrics.get("acc")`` is the metric ``fit(metrics=["acc"])`` uses, resolved by shapes as
  Keras' ``compile`` resolves it; TF's ``metrics.get('acc')`` is the exact-match function, which
  is ``ds.metrics.accuracy`` here;
* ``binary_accuracy`` of rank-1 inputs counts every element as one example (tf.keras averages
  the batch into one value, which would weigh a replica's short or empty batch like a full one).
"""

from __future__ import annotations

import pytest
import torch

import distrib as ds

M = ds.metrics


def close(value: torch.Tensor, expected: float, places: int = 2) -> None:
    assert round(float(value) - expected, places) == 0, (float(value), expected)


# ------------------------------------------------------------------ KerasSumTest


def test_sum():
    """KerasSumTest.test_sum"""
    m = M.Sum(name="my_sum")
    assert m.name == "my_sum" and m.dtype == torch.float64  # TF: float32 (see the module docstring)
    assert float(m.total) == 0
    assert float(m(100)) == 100 and float(m.total) == 100
    m.update_state(torch.tensor([1, 5]))
    close(m.result(), 106)
    assert float(m.total) == 106
    m.reset_states()
    assert float(m.total) == 0


def test_sum_with_sample_weight():
    """KerasSumTest.test_sum_with_sample_weight"""
    m = M.Sum(dtype=torch.float64)
    assert m.dtype == torch.float64
    assert float(m(100, sample_weight=0.5)) == 50 and float(m.total) == 50  # scalar weight
    close(m([1, 5], sample_weight=[1, 0.2]), 52.0, 4)  # weights of the values' rank
    close(m([1, 2], sample_weight=0.5), 53.5, 1)  # broadcast
    close(m([1, 5], sample_weight=[[1], [0.2]]), 55.5, 1)  # squeezed
    close(m([[1], [5]], sample_weight=[1, 0.2]), 57.5, 2)  # expanded
    result = m([[[1.0, 2.0], [3.0, 2.0], [0.5, 4.0]]], sample_weight=[0.5])  # values reduced to the weight's rank
    close(result, 63.75, 2)
    close(m.total, 63.75, 2)


def test_sum_save_restore(tmp_path):
    """KerasSumTest.test_save_restore (with ds.Checkpoint)"""
    m = M.Sum()
    checkpoint = ds.Checkpoint(sum=m)
    m(100.0)
    m(200.0)
    save_path = checkpoint.save(str(tmp_path / "ckpt"))
    m(1000.0)
    checkpoint.restore(save_path)
    m(300.0)
    assert float(m.result()) == 600.0
    restore_sum = M.Sum()
    ds.Checkpoint(sum=restore_sum).restore(save_path)
    restore_sum(300.0)
    assert float(restore_sum.result()) == 600.0


# ------------------------------------------------------------------ MeanTest


def test_mean():
    """MeanTest.test_mean"""
    m = M.Mean(name="my_mean")
    assert m.name == "my_mean" and m.dtype == torch.float64 and sorted(m.state_dict()) == ["count", "total"]
    assert float(m.total) == 0 and float(m.count) == 0
    assert float(m(100)) == 100 and float(m.total) == 100 and float(m.count) == 1
    m.update_state(torch.tensor([1, 5]))
    close(m.result(), 106 / 3, 2)
    assert float(m.total) == 106 and float(m.count) == 3
    m.reset_states()
    assert float(m.total) == 0 and float(m.count) == 0
    m2 = M.Mean.from_config(m.get_config())
    assert m2.name == "my_mean" and m2.dtype == torch.float64 and sorted(m2.state_dict()) == ["count", "total"]


def test_mean_with_sample_weight():
    """MeanTest.test_mean_with_sample_weight"""
    m = M.Mean(dtype=torch.float64)
    assert float(m(100, sample_weight=0.5)) == 50 / 0.5
    assert float(m.total) == 50 and float(m.count) == 0.5
    close(m([1, 5], sample_weight=[1, 0.2]), 52 / 1.7, 2)
    close(m.total, 52, 2)
    close(m.count, 1.7, 2)
    close(m([1, 2], sample_weight=0.5), 53.5 / 2.7, 2)
    close(m.total, 53.5, 2)
    close(m.count, 2.7, 2)
    close(m([1, 5], sample_weight=[[1], [0.2]]), 55.5 / 3.9, 2)
    close(m.total, 55.5, 2)
    close(m.count, 3.9, 2)
    close(m([[1], [5]], sample_weight=[1, 0.2]), 57.5 / 5.1, 2)
    close(m.total, 57.5, 2)
    close(m.count, 5.1, 2)
    result = m([[[1.0, 2.0], [3.0, 2.0], [0.5, 4.0]]], sample_weight=[0.5])
    assert round(float(result), 2) == 10.45
    assert round(float(m.total), 2) == 58.54 and round(float(m.count), 2) == 5.6


def test_mean_save_restore(tmp_path):
    """MeanTest.test_save_restore (with ds.Checkpoint)"""
    m = M.Mean()
    checkpoint = ds.Checkpoint(mean=m)
    m(100.0)
    m(200.0)
    save_path = checkpoint.save(str(tmp_path / "ckpt"))
    m(1000.0)
    checkpoint.restore(save_path)
    m(300.0)
    assert float(m.result()) == 200.0
    restore_mean = M.Mean()
    ds.Checkpoint(mean=restore_mean).restore(save_path)
    restore_mean(300.0)
    assert float(restore_mean.result()) == 200.0 and float(restore_mean.count) == 3


def test_mean_multiple_instances():
    """MeanTest.test_multiple_instances (variable names are TF's; here each instance has its own state)"""
    m, m2 = M.Mean(), M.Mean()
    assert m.name == "mean" and m2.name == "mean"
    assert float(m(100)) == 100 and float(m.total) == 100 and float(m.count) == 1
    assert float(m2.total) == 0 and float(m2.count) == 0
    assert float(m2([63, 10])) == 36.5 and float(m2.total) == 73 and float(m2.count) == 2
    assert float(m.result()) == 100 and float(m.total) == 100 and float(m.count) == 1


# ------------------------------------------------------------------ KerasAccuracyTest


def test_accuracy():
    """KerasAccuracyTest.test_accuracy"""
    acc = M.Accuracy(name="my_acc")
    assert acc.name == "my_acc" and sorted(acc.state_dict()) == ["count", "total"]
    acc.update_state([[1], [2], [3], [4]], [[1], [2], [3], [4]])
    assert float(acc.result()) == 1
    a2 = M.Accuracy.from_config(acc.get_config())
    assert a2.name == "my_acc" and a2.dtype == acc.dtype
    close(acc([[2], [1]], [[2], [0]], sample_weight=[[0.5], [0.2]]), 0.96, 2)  # 4.5/4.7


def test_binary_accuracy():
    """KerasAccuracyTest.test_binary_accuracy"""
    acc = M.BinaryAccuracy(name="my_acc")
    assert acc.name == "my_acc" and sorted(acc.state_dict()) == ["count", "total"]
    acc.update_state([[1], [0]], [[1], [0]])
    assert float(acc.result()) == 1
    acc.update_state([[1], [1]], [[[1]], [[0]]])  # y_pred squeezed
    close(acc.result(), 0.75, 2)
    close(acc([[[1]], [[1]]], [[1], [0]]), 0.67, 2)  # y_true squeezed: 4/6
    close(acc([[1], [1]], [[1], [0]], [[0.5], [0.2]]), 0.67, 2)  # 4.5/6.7


def test_binary_accuracy_threshold():
    """KerasAccuracyTest.test_binary_accuracy_threshold"""
    acc = M.BinaryAccuracy(threshold=0.7)
    close(acc([[1], [1], [0], [0]], [[0.9], [0.6], [0.4], [0.8]]), 0.5, 2)


def test_categorical_accuracy():
    """KerasAccuracyTest.test_categorical_accuracy"""
    acc = M.CategoricalAccuracy(name="my_acc")
    assert acc.name == "my_acc" and sorted(acc.state_dict()) == ["count", "total"]
    acc.update_state([[0, 0, 1], [0, 1, 0]], [[0.1, 0.1, 0.8], [0.05, 0.95, 0]])
    assert float(acc.result()) == 1
    close(acc([[0, 0, 1], [0, 1, 0]], [[0.1, 0.1, 0.8], [0.05, 0, 0.95]], [[0.5], [0.2]]), 0.93, 2)  # 2.5/2.7


def test_sparse_categorical_accuracy():
    """KerasAccuracyTest.test_sparse_categorical_accuracy"""
    acc = M.SparseCategoricalAccuracy(name="my_acc")
    assert acc.name == "my_acc" and sorted(acc.state_dict()) == ["count", "total"]
    acc.update_state([[2], [1]], [[0.1, 0.1, 0.8], [0.05, 0.95, 0]])
    assert float(acc.result()) == 1
    close(acc([[2], [1]], [[0.1, 0.1, 0.8], [0.05, 0, 0.95]], [[0.5], [0.2]]), 0.93, 2)  # 2.5/2.7


def test_sparse_categorical_accuracy_mismatched_dims():
    """KerasAccuracyTest.test_sparse_categorical_accuracy_mismatched_dims"""
    acc = M.SparseCategoricalAccuracy(name="my_acc")
    acc.update_state([2, 1], [[0.1, 0.1, 0.8], [0.05, 0.95, 0]])
    assert float(acc.result()) == 1
    close(acc([2, 1], [[0.1, 0.1, 0.8], [0.05, 0, 0.95]], [[0.5], [0.2]]), 0.93, 2)  # 2.5/2.7


def test_get_acc():
    """KerasAccuracyTest.test_get_acc: difference, asserted (see the module docstring)"""
    acc = M.get("acc")
    assert isinstance(acc, M.Metric) and acc.name == "accuracy"
    assert float(acc(torch.tensor([1, 0]), torch.tensor([[0.2, 0.8], [0.3, 0.7]]))) == 0.5  # integer labels: sparse
    assert M.accuracy(torch.tensor([1, 2]), torch.tensor([1, 0])).tolist() == [1.0, 0.0]  # TF's exact-match function


# ------------------------------------------------------------------ TopKCategoricalAccuracyTest


def test_top_k_config():
    """TopKCategoricalAccuracyTest.test_config"""
    a = M.TopKCategoricalAccuracy(name="topkca", dtype="int32")
    assert a.name == "topkca" and a.dtype == torch.int32
    a2 = M.TopKCategoricalAccuracy.from_config(a.get_config())
    assert a2.name == "topkca" and a2.dtype == torch.int32 and a2.k == 5


def test_top_k_correctness():
    """TopKCategoricalAccuracyTest.test_correctness"""
    y_true = torch.tensor([[0, 0, 1], [0, 1, 0]])
    y_pred = torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]])
    assert float(M.TopKCategoricalAccuracy()(y_true, y_pred)) == 1  # both samples match
    assert float(M.TopKCategoricalAccuracy(k=1)(y_true, y_pred)) == 0.5  # only sample #2
    y_true = torch.tensor([[0, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0]])
    y_pred = torch.tensor([[0.5, 0.9, 0.1, 0.7, 0.6, 0.5, 0.4], [0.05, 0.95, 0, 0, 0, 0, 0]])
    assert float(M.TopKCategoricalAccuracy(k=6)(y_true, y_pred)) == 0.5  # k > 5: only one sample


def test_top_k_weighted():
    """TopKCategoricalAccuracyTest.test_weighted"""
    a = M.TopKCategoricalAccuracy(k=2)
    y_true = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1]])
    y_pred = torch.tensor([[0, 0.9, 0.1], [0, 0.9, 0.1], [0, 0.9, 0.1]])
    assert float(a(y_true, y_pred, sample_weight=torch.tensor((1.0, 0.0, 1.0)))) == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------ SparseTopKCategoricalAccuracyTest


def test_sparse_top_k_config():
    """SparseTopKCategoricalAccuracyTest.test_config"""
    a = M.SparseTopKCategoricalAccuracy(name="stopkca", dtype="int32")
    assert a.name == "stopkca" and a.dtype == torch.int32
    a2 = M.SparseTopKCategoricalAccuracy.from_config(a.get_config())
    assert a2.name == "stopkca" and a2.dtype == torch.int32


def test_sparse_top_k_correctness():
    """SparseTopKCategoricalAccuracyTest.test_correctness"""
    y_true = torch.tensor([2, 1])
    y_pred = torch.tensor([[0.1, 0.9, 0.8], [0.05, 0.95, 0]])
    assert float(M.SparseTopKCategoricalAccuracy()(y_true, y_pred)) == 1
    assert float(M.SparseTopKCategoricalAccuracy(k=1)(y_true, y_pred)) == 0.5
    y_pred = torch.tensor([[0.5, 0.9, 0.1, 0.7, 0.6, 0.5, 0.4], [0.05, 0.95, 0, 0, 0, 0, 0]])
    assert float(M.SparseTopKCategoricalAccuracy(k=6)(y_true, y_pred)) == 0.5


def test_sparse_top_k_weighted():
    """SparseTopKCategoricalAccuracyTest.test_weighted"""
    a = M.SparseTopKCategoricalAccuracy(k=2)
    y_pred = torch.tensor([[0, 0.9, 0.1], [0, 0.9, 0.1], [0, 0.9, 0.1]])
    result = a(torch.tensor([1, 0, 2]), y_pred, sample_weight=torch.tensor((1.0, 0.0, 1.0)))
    assert float(result) == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------ CustomMetricsTest


def test_metric_wrappers_autograph():
    """CustomMetricsTest.test_metric_wrappers_autograph (the MeanMetricWrapper half; Python control flow)"""

    def metric_fn(y_true, y_pred):
        x = torch.tensor(0.0)
        for i in range(len(y_true)):
            for j in range(len(y_true[i])):
                if y_true[i][j] == y_pred[i][j] and y_true[i][j] > 0:
                    x += 1.0
        return x

    mean_metric = M.MeanMetricWrapper(metric_fn)
    y_true = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]])
    y_pred = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0], [1, 1, 1, 1, 1]])
    assert float(mean_metric(y_true, y_pred)) == pytest.approx(10, rel=1e-2)
