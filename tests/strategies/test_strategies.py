"""Strategy core: N logical replicas train exactly like one device; run/reduce/gather semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def batches(n_steps: int = 20, batch: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n_steps)
    ]


def train(strategy: ds.Strategy, data: list, global_batch: int) -> tuple[list[torch.Tensor], float, float]:
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        accuracy = ds.metrics.SparseCategoricalAccuracy()

    def step(inputs):
        x, y = inputs
        logits = model(x)
        loss = ds.compute_average_loss(F.cross_entropy(logits, y, reduction="none"), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        accuracy.update_state(y, logits)
        return loss

    total = 0.0
    for x in strategy.experimental_distribute_dataset(data):
        total += float(strategy.reduce(ds.ReduceOp.SUM, strategy.run(step, args=(x,)), axis=None))
    return [p.detach().clone() for p in model.parameters()], total, float(accuracy.result())


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_replicas_match_default_strategy_after_20_adam_steps(replicas):
    data = batches(20, 12)
    reference, ref_loss, ref_acc = train(ds.get_strategy(), data, 12)
    params, loss, acc = train(ds.MirroredStrategy([f"cpu:{i}" for i in range(replicas)]), data, 12)
    assert params[0].abs().sum() > 0
    for p, q in zip(reference, params):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert acc == ref_acc
    # the parameters moved: a broken optimizer merge would leave them at their initial values
    assert not torch.allclose(params[-1], make_model()[-1].bias)


def test_last_batch_of_6_over_4_replicas_is_split_2_2_1_1_and_trains_like_one_device():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    x = torch.arange(6.0).reshape(6, 1)
    (part,) = list(strategy.experimental_distribute_dataset([x]))
    sizes = [len(v) for v in strategy.experimental_local_results(part)]
    assert sizes == [2, 2, 1, 1]
    assert torch.equal(torch.cat(part.values), x)  # nothing dropped or duplicated

    data = batches(3, 12) + batches(1, 6)
    reference, _, _ = train(ds.get_strategy(), data, 12)
    params, _, _ = train(strategy, data, 12)
    for p, q in zip(reference, params):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_a_replica_left_without_examples_gets_an_empty_batch_and_the_step_runs():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    data = [(torch.randn(3, 1, 8, 8), torch.randint(0, 10, (3,)))]
    (x,) = list(strategy.experimental_distribute_dataset(data))
    assert [len(v[0]) for v in strategy.experimental_local_results(x)] == [1, 1, 1, 0]
    reference, _, _ = train(ds.get_strategy(), data, 3)
    params, _, _ = train(strategy, data, 3)
    for p, q in zip(reference, params):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_reduce_mean_axis0_counts_uneven_batches_exactly():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    values = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [5.0, 50.0], [6.0, 60.0]])
    (x,) = list(strategy.experimental_distribute_dataset([values]))
    per_replica = strategy.run(lambda v: v * 1.0, args=(x,))
    torch.testing.assert_close(strategy.reduce("MEAN", per_replica, axis=0), values.mean(0))
    torch.testing.assert_close(strategy.reduce("SUM", per_replica, axis=0), values.sum(0))
    # axis=None averages the per-replica values themselves (here each replica's sum), not examples
    scalars = strategy.run(lambda v: v.sum(), args=(x,))
    torch.testing.assert_close(strategy.reduce("MEAN", scalars), values.sum() / 4)
    gathered = strategy.gather(per_replica, axis=0)
    assert torch.equal(gathered, values)


def test_replica_context_ids_and_all_reduce():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    def fn():
        ctx = ds.get_replica_context()
        assert ds.get_strategy() is strategy
        mine = torch.tensor(float(ctx.replica_id_in_sync_group + 1))
        return ctx.replica_id_in_sync_group, ctx.all_reduce(ds.ReduceOp.SUM, mine), ctx.all_reduce("MEAN", mine)

    ids, sums, means = strategy.run(fn)
    assert ids.values == (0, 1, 2)
    assert [float(v) for v in sums.values] == [6.0, 6.0, 6.0]
    assert [float(v) for v in means.values] == [2.0, 2.0, 2.0]
    structured = strategy.run(
        lambda: ds.get_replica_context().all_reduce(
            "SUM", {"a": torch.ones(2), "b": (torch.tensor(float(ds.get_replica_context().replica_id_in_sync_group)),)}
        )
    )
    for value in structured["a"].values:
        assert value.tolist() == [3.0, 3.0]
    assert [float(v) for v in structured["b"][0].values] == [3.0, 3.0, 3.0]
    assert ds.get_replica_context() is not None and ds.get_replica_context().num_replicas_in_sync == 1
    with strategy.scope():
        assert ds.get_replica_context() is None
        assert ds.in_cross_replica_context()


def test_run_returns_plain_values_with_one_replica_and_per_replica_values_with_several():
    one = ds.OneDeviceStrategy("cpu")
    assert one.run(lambda: 3) == 3
    two = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    out = two.run(lambda a, b: (a, b), args=(1,), kwargs={"b": 2})
    assert isinstance(out[0], ds.PerReplica) and out[0].values == (1, 1) and out[1].values == (2, 2)
    assert two.experimental_local_results(out[0]) == (1, 1)
    assert one.experimental_local_results(5) == (5,)


def test_an_error_in_one_replica_is_raised_by_run_and_the_strategy_keeps_working():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])

    def fn():
        ctx = ds.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            raise KeyError("replica one failed")
        return ctx.all_reduce("SUM", torch.ones(()))

    with pytest.raises(KeyError, match="replica one failed"):
        strategy.run(fn)
    assert strategy.run(lambda: 7).values == (7, 7)


def test_replicas_reaching_different_merge_points_is_an_error_not_a_hang():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])

    def fn():
        ctx = ds.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            ctx.all_reduce("SUM", torch.ones(()))

    with pytest.raises(RuntimeError, match="merge point"):
        strategy.run(fn)


def test_grad_mode_of_the_caller_reaches_replica_threads():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with torch.no_grad():
        flags = strategy.run(torch.is_grad_enabled)
    assert flags.values == (False, False)
    assert strategy.run(torch.is_grad_enabled).values == (True, True)


def test_distribute_datasets_from_function_gives_an_input_context_and_consecutive_batches():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    seen = []

    def dataset_fn(ctx: ds.InputContext):
        seen.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(8)
        return [torch.full((per_replica,), float(i)) for i in range(3)]

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert seen == [ds.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)]
    assert [[float(v[0]) if len(v) else None for v in s.values] for s in steps] == [[0.0, 1.0], [2.0, None]]
    assert len(steps[1].values[1]) == 0
    assert len(strategy.distribute_datasets_from_function(dataset_fn)) == len(steps) == 2  # 3 batches, 2 replicas


def test_len_of_datasets_from_function_needs_a_sized_pipeline():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    unsized = strategy.distribute_datasets_from_function(lambda ctx: (torch.zeros(2) for _ in range(3)))
    with pytest.raises(TypeError, match="generator, which has no len"):
        len(unsized)


def test_get_per_replica_batch_size_rejects_a_batch_that_does_not_divide():
    ctx = ds.InputContext(num_replicas_in_sync=3)
    assert ctx.get_per_replica_batch_size(96) == 32
    with pytest.raises(ValueError, match=r"global_batch_size=64 is not divisible by num_replicas_in_sync=3.*66"):
        ctx.get_per_replica_batch_size(64)


@pytest.mark.parametrize("device", ["tpu:0", "cuda:64", "banana"])
def test_unknown_devices_are_rejected_with_the_name(device):
    with pytest.raises(ValueError, match=device.split(":")[0]):
        ds.MirroredStrategy(["cpu:0", device])


def test_optimizer_over_a_module_built_outside_the_scope_is_rejected():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="outside the scope"), strategy.scope():
        torch.optim.SGD(model.parameters(), lr=0.1)


def test_scopes_of_two_strategies_cannot_nest():
    a, b = ds.MirroredStrategy(["cpu:0"]), ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with a.scope():
        with pytest.raises(RuntimeError, match="different strategy"):
            with b.scope():
                pass


def test_compute_average_loss_and_regularization_scaling():
    assert float(ds.compute_average_loss(torch.tensor([2.0, 3.0]), global_batch_size=4)) == 1.25
    w = torch.tensor([1.0, 0.0])
    assert float(ds.compute_average_loss(torch.tensor([2.0, 3.0]), sample_weight=w, global_batch_size=4)) == 0.5
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    out = strategy.run(
        lambda: (ds.compute_average_loss(torch.tensor([2.0, 3.0])), ds.scale_regularization_loss(torch.tensor(4.0)))
    )
    assert [float(v) for v in out[0].values] == [1.25, 1.25]
    assert [float(v) for v in out[1].values] == [2.0, 2.0]
    empty = strategy.run(lambda: ds.compute_average_loss(torch.zeros(0)))
    assert [float(v) for v in empty.values] == [0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        ds.compute_average_loss(torch.ones(2), global_batch_size=0)
