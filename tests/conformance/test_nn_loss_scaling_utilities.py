"""Conformance: TF's ``tensorflow/python/ops/nn_loss_scaling_utilities_test.py`` (``LossUtilitiesTest``),
ported to ``ds.compute_average_loss`` / ``ds.scale_regularization_loss``.

TF's ``mirrored_strategy_with_cpu_1_and_2`` is ``ds.MirroredStrategy(["cpu:0", "cpu:1"])`` (two logical CPU
replicas). TF runs most tests in graph and eager mode; both collapse into eager PyTorch here.
TF's ``InvalidArgumentError`` (a runtime op error) is a ``ValueError`` in distrib, PyTorch's error for a bad
argument value.

Not ported, and why:
- ``testComputeAverageLossInvalidRank``, its "dynamic rank" half: a graph placeholder of unknown rank does not
  exist in eager PyTorch (the static-rank half is ported).
"""

from __future__ import annotations

import pytest
import torch

import distrib as ds


@pytest.fixture(scope="module")
def distribution() -> ds.Strategy:
    return ds.MirroredStrategy(["cpu:0", "cpu:1"])


def test_compute_average_loss_global_batch_size():
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossGlobalBatchSize."""
    loss = ds.compute_average_loss([1, 2, 3, 4, 5], global_batch_size=10)
    assert float(loss) == 1.5


def test_compute_average_loss_global_batch_size_non_scalar():
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossGlobalBatchSize_BatchSizeNonScalar.

    TF: ``ValueError("global_batch_size must be scalar")`` for ``global_batch_size=[10]``.
    """
    with pytest.raises(ValueError, match="global_batch_size must be (a )?scalar"):
        ds.compute_average_loss([1, 2, 3, 4, 5], global_batch_size=[10])


def test_compute_average_loss_global_batch_size_float():
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossGlobalBatchSize_BatchSizeFloat.

    TF: ``TypeError("global_batch_size must be an int")`` for ``global_batch_size=10.0``.
    """
    with pytest.raises(TypeError, match="global_batch_size must be an int"):
        ds.compute_average_loss([1, 2, 3, 4, 5], global_batch_size=10.0)


@pytest.mark.parametrize("size, tf_name", [(-1, "BatchSizeNegative"), (0, "BatchSizeZero")])
def test_compute_average_loss_global_batch_size_not_positive(size, tf_name):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossGlobalBatchSize_BatchSizeNegative
    and ..._BatchSizeZero.

    TF: ``InvalidArgumentError("global_batch_size must be positive")``; distrib: ``ValueError`` (see the module docstring).
    """
    with pytest.raises(ValueError, match="global_batch_size must be (a )?positive"):
        ds.compute_average_loss([1, 2, 3, 4, 5], global_batch_size=size)


def test_compute_average_loss_default_global_batch_size(distribution):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossDefaultGlobalBatchSize."""
    per_example_loss = torch.tensor([2.5, 6.2, 5.0])
    # Without strategy: one replica.
    torch.testing.assert_close(ds.compute_average_loss(per_example_loss), torch.tensor((2.5 + 6.2 + 5.0) / 3))
    # With strategy: two replicas, each sees the whole per-example loss; the global batch is 6.
    with distribution.scope():
        per_replica_losses = distribution.run(ds.compute_average_loss, args=(per_example_loss,))
        loss = distribution.reduce("SUM", per_replica_losses, axis=None)
        torch.testing.assert_close(loss, torch.tensor((2.5 + 6.2 + 5.0) / 3))


def test_compute_average_loss_sample_weights(distribution):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossSampleWeights."""
    with distribution.scope():
        # Scalar sample weight.
        per_replica_losses = distribution.run(
            ds.compute_average_loss, args=([2.0, 4.0, 6.0],), kwargs={"sample_weight": 2}
        )
        loss = distribution.reduce("SUM", per_replica_losses, axis=None)
        torch.testing.assert_close(loss, torch.tensor((2.0 + 4.0 + 6.0) * 2.0 / 3))
        # Per-example sample weight.
        per_replica_losses = distribution.run(
            ds.compute_average_loss, args=([2.0, 4.0, 6.0],), kwargs={"sample_weight": [0.3, 0.5, 0.2]}
        )
        loss = distribution.reduce("SUM", per_replica_losses, axis=None)
        torch.testing.assert_close(loss, torch.tensor((2.0 * 0.3 + 4.0 * 0.5 + 6.0 * 0.2) / 3))
        # Time-step sample weight.
        per_replica_losses = distribution.run(
            ds.compute_average_loss,
            args=([[2.0, 0.5], [4.0, 1.0]],),
            kwargs={"sample_weight": [[0.3, 0.7], [0.2, 0.8]]},
        )
        loss = distribution.reduce("SUM", per_replica_losses, axis=None)
        torch.testing.assert_close(loss, torch.tensor((2.0 * 0.3 + 0.5 * 0.7 + 4.0 * 0.2 + 1.0 * 0.8) / 2))


def test_compute_average_loss_invalid_sample_weights():
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossInvalidSampleWeights."""
    with pytest.raises(ValueError, match="(?i)incompatible shapes"):
        ds.compute_average_loss([2.5, 6.2, 5.0], sample_weight=[0.2, 0.8], global_batch_size=10)


def test_compute_average_loss_dtype(distribution):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossDtype."""
    with distribution.scope():
        per_example_loss = torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64)
        per_replica_losses = distribution.run(
            ds.compute_average_loss, args=(per_example_loss,), kwargs={"sample_weight": 2}
        )
        loss = distribution.reduce("SUM", per_replica_losses, axis=None)
        assert loss.dtype == torch.float64


def test_compute_average_loss_invalid_rank():
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossInvalidRank (static rank)."""
    with pytest.raises(
        ValueError, match="Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1"
    ):
        ds.compute_average_loss(torch.tensor(2))


def test_compute_average_loss_in_cross_replica_context(distribution):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testComputeAverageLossInCrossReplicaContext."""
    with distribution.scope():
        with pytest.raises(RuntimeError, match="You are calling `compute_average_loss` in cross replica context"):
            ds.compute_average_loss([2, 3])


def test_scale_regularization_loss(distribution):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testScaleRegularizationLoss."""
    reg_losses = torch.tensor([2.5, 6.2, 5.0])
    # Without strategy: one replica.
    torch.testing.assert_close(ds.scale_regularization_loss(reg_losses), torch.tensor(2.5 + 6.2 + 5.0))
    # With strategy: two replicas; summed over replicas, the regularization loss counts once.
    with distribution.scope():
        per_replica_losses = distribution.run(ds.scale_regularization_loss, args=(reg_losses,))
        loss = distribution.reduce("SUM", per_replica_losses, axis=None)
        torch.testing.assert_close(loss, torch.tensor(2.5 + 6.2 + 5.0))


def test_scale_regularization_loss_in_cross_replica_context(distribution):
    """TF: nn_loss_scaling_utilities_test.py, LossUtilitiesTest.testScaleRegularizationLossInCrossReplicaContext."""
    with distribution.scope():
        with pytest.raises(RuntimeError, match="You are calling `scale_regularization_loss` in cross replica context"):
            ds.scale_regularization_loss([2, 3])
