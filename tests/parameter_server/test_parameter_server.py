"""ParameterServerStrategy on a real cluster: 2 ps and 2 worker processes over loopback, this process the chief.

One cluster serves every test of this module (starting processes that import torch is the slow
part); each test makes its own strategy, whose variables get their own keys on the ps tasks.
"""

from __future__ import annotations

import sys

import cloudpickle
import grpc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.cluster import ClusterSpec, SimpleClusterResolver
from distrib.parameter_server.errors import ClosureCancelledError, ScheduledFunctionError
from distrib.parameter_server.transport import wire

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

FEATURES = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])  # seed 003's regression data
LABELS = torch.tensor([[0.3], [0.5], [0.7]])


@pytest.fixture(scope="module")
def cluster():
    with ds.testing.LocalCluster(num_workers=2, num_ps=2) as c:
        c.wait_ready(timeout=120)
        yield c


def make_strategy(cluster, partitioner=None, num_ps=None) -> ds.ParameterServerStrategy:
    spec = dict(cluster.cluster)
    if num_ps is not None:
        spec["ps"] = spec["ps"][:num_ps]
    return ds.ParameterServerStrategy(
        SimpleClusterResolver(ClusterSpec(spec), "chief", 0), partitioner, token=cluster.token
    )


def regression_dataset_fn(input_context):
    # seed 003: from_tensor_slices((features, labels)).shuffle(10).repeat().batch(64); per-worker seed
    g = torch.Generator().manual_seed(input_context.input_pipeline_id)
    while True:
        perm = torch.randperm(3, generator=g)
        yield FEATURES[perm], LABELS[perm]


def test_async_training_of_the_seed_regression_converges(cluster):
    strategy = make_strategy(cluster)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(2, 1))
        with torch.no_grad():  # start far from the optimum, as the seed's Keras init does (loss 7.5)
            model[0].weight.fill_(0.5)
            model[0].bias.zero_()
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    per_worker_iterator = iter(coordinator.create_per_worker_dataset(regression_dataset_fn))

    def replica_fn(x, y):
        loss = ds.compute_average_loss(F.mse_loss(model(x), y, reduction="none").mean(1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def train_step(iterator):
        x, y = next(iterator)
        return strategy.reduce(ds.ReduceOp.SUM, strategy.run(replica_fn, args=(x, y)), axis=None)

    with torch.no_grad():
        start = F.mse_loss(model(FEATURES), LABELS).item()
    losses = []
    for _epoch in range(5):  # fit(epochs=5, steps_per_epoch=...) as a custom loop
        values = [coordinator.schedule(train_step, args=(per_worker_iterator,)) for _ in range(20)]
        coordinator.join(timeout=120)
        losses.append(sum(v.fetch().item() for v in values) / len(values))
    with torch.no_grad():
        final = F.mse_loss(model(FEATURES), LABELS).item()  # the coordinator reads the ps tasks
    assert final < 0.05 * start, (start, final, losses)
    assert losses[-1] < losses[0]
    workers = {v.worker for v in values}
    assert len(workers) == 2, workers  # both workers trained (asynchronously)
    coordinator.close()


def test_error_in_scheduled_function_surfaces_from_join_with_remote_traceback(cluster):
    strategy = make_strategy(cluster)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def fails_on_three(i):
        if i == 3:
            raise ValueError(f"bad input {i}")
        return i

    values = [coordinator.schedule(fails_on_three, args=(i,)) for i in range(40)]
    with pytest.raises(ValueError, match="bad input 3") as info:
        coordinator.join(timeout=60)
    assert isinstance(info.value, ScheduledFunctionError)
    assert "fails_on_three" in info.value.remote_traceback and 'raise ValueError(f"bad input {i}")' in str(info.value)
    # the user's file and line, not cloudpickle >= 3.1.3's "<dynamic-code>" (pickling.py restores it)
    raise_line = fails_on_three.__code__.co_firstlineno + 2
    assert f'File "{__file__}", line {raise_line}, in fails_on_three' in info.value.remote_traceback
    statuses = {v.status for v in values}
    assert ds.coordinator.RemoteValueStatus.FAILED in statuses
    cancelled = [v for v in values if v.status is ds.coordinator.RemoteValueStatus.CANCELLED]
    if cancelled:
        with pytest.raises(ClosureCancelledError):
            cancelled[0].fetch()
    assert coordinator.schedule(fails_on_three, args=(1,)).fetch(timeout=60) == 1  # usable again after join raised
    coordinator.close()


class ClickModel(nn.Module):
    def __init__(self, rows: int = 1000, dim: int = 8, sparse: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(rows, dim, sparse=sparse)
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids).mean(1)).squeeze(1)


def train_clicks(strategy, steps: int, sparse: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    with strategy.scope():
        model = ClickModel(sparse=sparse)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def step(ids, clicks):
        loss = F.binary_cross_entropy_with_logits(model(ids), clicks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 100, (16, 3), generator=g)  # only rows < 100 are ever touched
        coordinator.schedule(step, args=(ids, (ids[:, 0] % 2).float()))
    coordinator.join(timeout=120)
    return model, optimizer, coordinator


def test_partitioned_sparse_embedding_updates_only_touched_rows(cluster):
    strategy = make_strategy(cluster, ds.partitioners.FixedShardsPartitioner(2))
    torch.manual_seed(0)
    untouched_before = ClickModel().embedding.weight.detach()[100:].clone()
    model, optimizer, coordinator = train_clicks(strategy, steps=20)
    placement = strategy.variable_placement(model)
    assert placement["embedding.weight"] == [(0, 0, 500), (1, 500, 1000)]  # split along dim 0 over both ps
    weight = model.state_dict()["embedding.weight"]  # gathered whole from both ps tasks
    assert torch.equal(weight[100:], untouched_before)
    assert not torch.equal(weight[:100], ClickModel().embedding.weight.detach()[:100])
    sent = sum(s["ps_bytes_sent"] for s in coordinator.worker_stats())
    assert sent < 20 * 1000 * 8 * 4 / 4, sent  # far less than the dense table gradient per step
    coordinator.close()


def test_sharded_checkpoint_restores_into_plain_module_and_other_shardings(cluster, tmp_path):
    strategy = make_strategy(cluster, ds.partitioners.MaxSizePartitioner(max_shard_bytes=1000))
    model, optimizer, coordinator = train_clicks(strategy, steps=10)
    assert len(strategy.variable_placement(model)["embedding.weight"]) == 33  # 31 rows of 32 bytes per shard
    path = ds.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "ckpt")
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    trained_state = optimizer.state_dict()["state"]
    coordinator.close()

    plain = ClickModel()  # one device, no strategy
    plain_opt = torch.optim.Adagrad(plain.parameters(), lr=0.1)
    ds.Checkpoint(model=plain, optimizer=plain_opt).restore(path)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert torch.equal(plain_opt.state_dict()["state"][0]["sum"], trained_state[0]["sum"])

    other = make_strategy(cluster, ds.partitioners.FixedShardsPartitioner(3), num_ps=1)  # 3 shards, 1 ps
    with other.scope():
        torch.manual_seed(1)
        moved = ClickModel()
        moved_opt = torch.optim.Adagrad(moved.parameters(), lr=0.1)
    ds.Checkpoint(model=moved, optimizer=moved_opt).restore(path)
    assert [ps for ps, _, _ in other.variable_placement(moved)["embedding.weight"]] == [0, 0, 0]
    moved.embedding.weight.data.zero_()  # the local copy is not the truth: state_dict() reads the ps task
    for name, value in moved.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert torch.equal(moved_opt.state_dict()["state"][0]["sum"], trained_state[0]["sum"])


def test_calls_without_the_cluster_token_are_refused_and_logged(cluster):
    address = cluster.cluster["ps"][0]
    request = wire.encode({"vars": [{"key": "intruder/v0/part_0", "value": torch.ones(2)}]})
    with grpc.insecure_channel(address) as channel:
        create = channel.unary_unary("/distrib.ParameterServer/Create")
        for metadata in ((), (("x-distrib-cluster-token", "wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                create(request, metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(cluster.cluster["worker"][0]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/distrib.Worker/Run")(b"\x80\x04anything", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # nothing was created: with the token, the key is unknown
    from distrib.parameter_server.transport.rpc import Connection

    conn = Connection(address, "distrib.ParameterServer", cluster.token)
    reply = wire.decode(conn.call("Pull", wire.encode({"keys": ["intruder/v0/part_0"], "since": [0]}), timeout=10))
    conn.close()
    assert reply["error"]["type"] == "UnknownVariable"
    assert "refused /distrib.ParameterServer/Create" in cluster.log("ps", 0)
    assert "missing cluster token" in cluster.log("ps", 0) and "wrong cluster token" in cluster.log("ps", 0)
