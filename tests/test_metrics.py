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


# ---------------------------------------------------------------- every metric class, every strategy

M = ds.metrics


def _inputs(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, 5, generator=g)
    labels = torch.randint(0, 5, (n,), generator=g)
    return {
        "scores": scores,
        "labels": labels,
        "one_hot": torch.nn.functional.one_hot(labels, 5),
        "exact": torch.randint(0, 3, (n, 1), generator=g),
        "guess": torch.randint(0, 3, (n, 1), generator=g),
        "binary": (torch.rand(n, 1, generator=g) > 0.5).float(),
        "prob": torch.rand(n, 1, generator=g),
        "values": torch.randn(n, generator=g),
        "weights": torch.rand(n, generator=g),
    }


CASES = {  # metric factory, the inputs it takes from a batch
    "Accuracy": (M.Accuracy, ("exact", "guess")),
    "BinaryAccuracy": (lambda: M.BinaryAccuracy(threshold=0.3), ("binary", "prob")),
    "CategoricalAccuracy": (M.CategoricalAccuracy, ("one_hot", "scores")),
    "SparseCategoricalAccuracy": (M.SparseCategoricalAccuracy, ("labels", "scores")),
    "TopKCategoricalAccuracy": (lambda: M.TopKCategoricalAccuracy(k=2), ("one_hot", "scores")),
    "SparseTopKCategoricalAccuracy": (lambda: M.SparseTopKCategoricalAccuracy(k=3), ("labels", "scores")),
    "Mean": (M.Mean, ("values",)),
    "Sum": (M.Sum, ("values",)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("weighted", [False, True])
def test_every_metric_over_four_replicas_equals_the_metric_over_whole_batches(name, weighted):
    make, keys = CASES[name]
    batches = [_inputs(10, 0), _inputs(7, 1), _inputs(3, 2)]  # the last leaves one of 4 replicas an empty batch
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    with strategy.scope():
        distributed = make()
    outside = make()  # built outside the scope: sums over the same replicas once updated inside run
    plain = make()
    for b in batches:
        w = b["weights"] if weighted else None
        plain.update_state(*(b[k] for k in keys), sample_weight=w)

    def step(b):
        w = b["weights"] if weighted else None
        distributed.update_state(*(b[k] for k in keys), sample_weight=w)
        outside.update_state(*(b[k] for k in keys), sample_weight=w)

    for x in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x,))
    expected = float(plain.result())
    assert 0 < abs(expected)  # the data is not degenerate
    assert float(distributed.result()) == pytest.approx(expected, rel=1e-6)
    assert float(outside.result()) == pytest.approx(expected, rel=1e-6)
    assert outside.strategy is strategy
    distributed.reset_states()
    assert float(distributed.result()) == 0.0


def test_keras_names_and_default_names():
    for name in (
        "binary_accuracy",
        "categorical_accuracy",
        "sparse_categorical_accuracy",
        "top_k_categorical_accuracy",
        "sparse_top_k_categorical_accuracy",
    ):
        metric = M.get(name)
        assert metric.name == name and type(metric).__name__.lower().replace("_", "") == name.replace("_", "")
    assert M.get("top_k_categorical_accuracy").k == 5 and M.get("sparse_top_k_categorical_accuracy").k == 5
    assert type(M.get("BinaryAccuracy")) is M.BinaryAccuracy and type(M.get("Accuracy")) is M.Accuracy
    assert M.get("ACC").name == "accuracy" and M.get(M.Sum).name == "sum" and M.Mean().name == "mean"
    wrapped = M.get(lambda t, p: (t - p).abs())
    assert float(wrapped(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]))) == 1.0
    with pytest.raises(ValueError, match="unknown metric 'recall'"):
        M.get("recall")


def test_accuracy_by_name_follows_the_shapes_as_keras_compile_does():
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2]])
    acc = M.get("accuracy")
    assert float(acc(torch.tensor([1, 1]), scores)) == 0.5  # integer labels: sparse
    acc.reset_state()
    assert float(acc(torch.tensor([[0, 1], [0, 1]]), scores)) == 0.5  # one-hot labels: categorical
    acc.reset_state()
    assert float(acc(torch.tensor([[1.0], [0.0]]), torch.tensor([[0.7], [0.6]]))) == 0.5  # one output: binary
    logits = M.get("accuracy", binary_threshold=0.0)  # fit gives 0 for logit losses
    assert float(logits(torch.tensor([1.0, 0.0]), torch.tensor([0.2, -0.3]))) == 1.0


def test_a_metric_built_under_one_strategy_refuses_another():
    a, b = ds.MirroredStrategy(["cpu:0", "cpu:1"]), ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with a.scope():
        mean = M.Mean()
    with pytest.raises(ValueError, match="Create it under the scope of the strategy that updates it"):
        b.run(lambda: mean.update_state(torch.ones(2)))


def test_calling_a_metric_inside_run_returns_this_workers_value_without_a_collective():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        total = M.Sum()
    seen = strategy.run(lambda v: total(v), args=(ds.PerReplica([torch.tensor([1.0]), torch.tensor([2.0])]),))
    assert [float(v) for v in seen.values] == [1.0, 3.0]  # replicas take turns: the running value
    assert float(total.result()) == 3.0


def test_sample_weight_shapes_follow_keras_and_a_mismatch_names_the_fix():
    assert float(M.Mean()([[1.0], [5.0]], sample_weight=[1.0, 0.2])) == pytest.approx(2.0 / 1.2)  # weight expanded
    assert float(M.Mean()([1.0, 5.0], sample_weight=[[1.0], [0.2]])) == pytest.approx(2.0 / 1.2)  # weight squeezed
    # values reduced to the weight's rank: mean for Mean, sum for Sum
    assert float(M.Mean()([[[1.0, 2.0], [3.0, 2.0], [0.5, 4.0]]], sample_weight=[0.5])) == pytest.approx(12.5 / 6)
    assert float(M.Sum()([[[1.0, 2.0], [3.0, 2.0], [0.5, 4.0]]], sample_weight=[0.5])) == pytest.approx(6.25)
    with pytest.raises(ValueError, match="sample_weight of shape \\[3\\]"):
        M.Mean()([1.0, 2.0], sample_weight=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="one-hot"):
        M.CategoricalAccuracy()(torch.tensor([1, 0]), torch.tensor([[0.1, 0.9], [0.8, 0.2]]))
    with pytest.raises(ValueError, match="k must be a positive integer"):
        M.SparseTopKCategoricalAccuracy(k=0)


def test_metric_state_is_checkpointed_and_restored(tmp_path):
    acc = M.BinaryAccuracy()
    acc.update_state(torch.tensor([1.0, 0.0]), torch.tensor([0.9, 0.9]))
    path = ds.Checkpoint(acc=acc).save(str(tmp_path / "ckpt"))
    acc.update_state(torch.tensor([1.0]), torch.tensor([0.9]))
    ds.Checkpoint(acc=acc).restore(path)
    assert float(acc.result()) == 0.5


def test_binary_accuracy_of_rank_one_inputs_counts_every_element_as_an_example():
    # tf.keras would average each rank-1 batch into one value: (0.75 + 0.0) / 2 = 0.375
    acc = M.BinaryAccuracy()
    acc.update_state(torch.tensor([1, 1, 0, 0]), torch.tensor([0.98, 1.0, 0.0, 0.6]))
    acc.update_state(torch.tensor([1]), torch.tensor([0.2]))
    assert float(acc.result()) == pytest.approx(3 / 5)
