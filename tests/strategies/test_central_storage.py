"""CentralStorageStrategy: parameters in one place, every replica computing on its own copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from strategies.test_strategies import batches, train
from torch import nn

import distrib as ds


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_central_storage_trains_like_one_device(replicas):
    data = batches(20, 12)
    reference, ref_loss, ref_acc = train(ds.get_strategy(), data, 12)
    strategy = ds.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)], parameter_device="cpu")
    params, loss, acc = train(strategy, data, 12)
    for p, q in zip(reference, params):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and acc == ref_acc
    assert strategy.parameter_devices == ("cpu",) and strategy.extended.parameter_devices == ("cpu",)


def test_every_replica_computes_on_a_copy_and_batchnorm_statistics_are_averaged():
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    called = []
    model[0].register_forward_hook(lambda m, i, o: called.append(1))  # the central module is never called

    def step(x: torch.Tensor) -> None:
        ds.compute_average_loss(model(x).pow(2).sum(1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    x = torch.tensor([[0.0, 1.0], [2.0, 2.0], [10.0, 10.0], [30.0, 31.0]])
    strategy.run(
        step,
        args=(
            strategy.experimental_distribute_values_from_function(
                lambda ctx: x[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
            ),
        ),
    )
    assert called == []
    # each replica's BatchNorm saw its 2 rows; the central statistics are the average of both replicas'
    per_replica = [F.linear(x[i : i + 2], weight, bias).mean(0) * 0.1 for i in (0, 2)]
    torch.testing.assert_close(model[1].running_mean, (per_replica[0] + per_replica[1]) / 2)
