"""Metrics updated inside run give the value over every replica."""

from __future__ import annotations

import pytest
import torch

import distrib as ds


def split_run(strategy, fn, *tensors):
    (x,) = list(strategy.experimental_distribute_dataset([tuple(tensors)]))
    return strategy.run(fn, args=(x,))


def test_accuracy_and_mean_over_replicas_equal_the_values_over_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(10, 5, generator=g), torch.randint(0, 5, (10,), generator=g)
    losses = torch.rand(10, generator=g)
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    with strategy.scope():
        accuracy = ds.metrics.SparseCategoricalAccuracy()
        mean = ds.metrics.Mean()
        total = ds.metrics.Sum()

    def fn(inputs):
        y_pred, y_true, loss = inputs
        accuracy.update_state(y_true, y_pred)
        mean.update_state(loss)
        total.update_state(loss)

    split_run(strategy, fn, logits, labels, losses)
    expected = (logits.argmax(1) == labels).float().mean()
    assert float(accuracy.result()) == pytest.approx(float(expected))
    assert float(mean.result()) == pytest.approx(float(losses.mean()))
    assert float(total.result()) == pytest.approx(float(losses.sum()))
    accuracy.reset_state()
    assert float(accuracy.result()) == 0.0


def test_accuracy_takes_probabilities_column_labels_and_weights():
    acc = ds.metrics.SparseCategoricalAccuracy()
    probs = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    acc.update_state(torch.tensor([[1], [1], [1]]), probs, sample_weight=torch.tensor([1.0, 1.0, 2.0]))
    assert float(acc.result()) == pytest.approx(3 / 4)
    assert float(ds.metrics.Mean()(torch.tensor([1.0, 3.0]))) == 2.0  # callable like Keras metrics


def test_scaled_loss_in_a_mean_metric_is_off_by_the_replica_count_as_the_tutorial_warns():
    # two replicas, two examples each, losses [2, 3] and [4, 5], global batch 4
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mean = ds.metrics.Mean()
    per_replica = ds.PerReplica([torch.tensor([2.0, 3.0]), torch.tensor([4.0, 5.0])])
    scaled = strategy.run(lambda l: ds.compute_average_loss(l, global_batch_size=4), args=(per_replica,))
    strategy.run(lambda l: mean.update_state(l), args=(scaled,))
    assert float(mean.result()) == 1.75
    assert float(strategy.reduce("SUM", scaled)) == 3.5


def test_a_torchmetrics_metric_updated_inside_run_is_right():
    torchmetrics = pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(1)
    preds, target = torch.randn(9, 3, generator=g).softmax(1), torch.randint(0, 3, (9,), generator=g)
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    split_run(strategy, lambda inputs: metric.update(*inputs), preds, target)
    expected = (preds.argmax(1) == target).float().mean()
    assert float(metric.compute()) == pytest.approx(float(expected))
