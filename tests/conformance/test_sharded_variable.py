"""TF's ``tensorflow/python/distribute/sharded_variable_test.py``, ported to distrib.

distrib has no ``ShardedVariable`` object: a parameter of a module built under
``ParameterServerStrategy.scope()`` with a ``variable_partitioner`` *is* sharded, along dim 0 with TF's
"div" rule, over the ps tasks. The module holds one whole tensor (what ``convert_to_tensor`` gives in TF);
``strategy.variable_shards(module)`` reads the shards (TF's ``.variables``) from the ps tasks. So TF's tests
that build a ``ShardedVariable`` from hand-made pieces become tests of a partitioned parameter.

Not ported, with the reason (rows in docs/migration.md): test_save_graph_def and test_load_raises_error
(SavedModel is not part of distrib), test_validation_errors (no ``ShardedVariable`` constructor to
validate; a partitioner's answer is validated instead, see test_parameter_server_strategy_v2.py),
test_as_function_input and test_flatten (``tf.function`` tracing and ``tf.nest`` composites have no
PyTorch counterpart).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TF_FILE = "tensorflow/python/distribute/sharded_variable_test.py"


# ----------------------------------------------------------------------------- PartitionerTest
def test_fixed_shards_partitioner():
    """TF: sharded_variable_test.py, PartitionerTest.test_fixed_shards_partitioner."""
    assert ds.partitioners.FixedShardsPartitioner(num_shards=2)((10, 3), torch.float32) == [2, 1]


def test_min_size_partitioner():
    """TF: sharded_variable_test.py, PartitionerTest.test_min_size_partitioner."""
    assert ds.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == [2, 1]
    assert ds.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32) == [6, 1]


def test_max_size_partitioner():
    """TF: sharded_variable_test.py, PartitionerTest.test_max_size_partitioner."""
    assert ds.partitioners.MaxSizePartitioner(max_shard_bytes=4)((6, 1), torch.float32) == [6, 1]
    assert ds.partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == [2, 1]
    assert ds.partitioners.MaxSizePartitioner(max_shard_bytes=1024)((6, 1), torch.float32) == [1, 1]


# ----------------------------------------------------------------------------- ShardedVariableTest
@pytest.fixture(scope="module")
def resolver():
    r = ds.testing.create_in_process_cluster(num_workers=1, num_ps=2)
    yield r
    ds.testing.stop_in_process_cluster(r)


class Holder(nn.Module):
    def __init__(self, value) -> None:
        super().__init__()
        t = torch.as_tensor(value)
        self.s = nn.Parameter(t, requires_grad=t.is_floating_point())


def sharded(resolver, value, shards: int):
    strategy = ds.ParameterServerStrategy(resolver, ds.partitioners.FixedShardsPartitioner(shards))
    with strategy.scope():
        holder = Holder(value)
    return strategy, holder


def pieces(strategy, holder) -> list:
    return [s.tolist() for s in strategy.variable_shards(holder)["s"]]


def test_sharded_variable_simple(resolver):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_sharded_variable_simple."""
    strategy, holder = sharded(resolver, [0, 1], 2)
    assert pieces(strategy, holder) == [[0], [1]]
    whole = holder.state_dict()["s"]
    assert list(whole.shape) == [2] and whole.dtype == torch.int64
    assert list(strategy.variable_placement(holder)) == ["s"]  # one name for the whole


def test_assign(resolver):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_assign.

    Difference: TF's test builds shards of 1, 2 and 1 rows by hand; distrib's shards always follow the "div"
    rule (4 rows in 3 shards: 2, 1, 1), the partitioning TF's strategy itself makes."""
    strategy, holder = sharded(resolver, [[0, 0], [1, 1], [2, 2], [3, 3]], 3)
    holder.load_state_dict({"s": torch.tensor([[4, 4], [5, 5], [6, 6], [7, 7]])})  # s.assign(...)
    assert pieces(strategy, holder) == [[[4, 4], [5, 5]], [[6, 6]], [[7, 7]]]


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["test_assign_add", "test_assign_sub"])
def test_assign_add_and_sub(resolver, sign):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_assign_add and test_assign_sub.

    distrib changes parameters through optimizers: ``assign_add(d)`` is an ``SGD(lr=1)`` step with gradient
    ``-d``, scheduled on a worker and applied shard by shard on the ps tasks."""
    strategy = ds.ParameterServerStrategy(resolver, ds.partitioners.FixedShardsPartitioner(3))
    with strategy.scope():
        holder = Holder(torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
        optimizer = torch.optim.SGD(holder.parameters(), lr=1.0)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    delta = torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])

    def assign(d):
        holder.s.grad = -sign * d
        optimizer.step()
        optimizer.zero_grad()

    coordinator.schedule(assign, args=(delta,)).fetch()
    expected = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]) + sign * delta
    assert pieces(strategy, holder) == [expected[:2].tolist(), expected[2:3].tolist(), expected[3:].tolist()]
    coordinator.close()


def test_convert_to_tensor(resolver):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_convert_to_tensor."""
    strategy, holder = sharded(resolver, [[0, 0], [1, 1], [2, 2], [3, 3]], 3)
    assert holder.state_dict()["s"].tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]  # the shards, concatenated


def test_save_restore(resolver, tmp_path):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_save_restore."""
    strategy, holder = sharded(resolver, [0, 1, 2, 3], 4)
    path = ds.Checkpoint(s=holder).save(tmp_path / "checkpoint")
    holder.load_state_dict({"s": torch.tensor([4, 1, 2, 3])})
    assert pieces(strategy, holder)[0] == [4]
    ds.Checkpoint(s=holder).restore(path)
    assert pieces(strategy, holder)[0] == [0]  # the original weights are restored


def test_save_restore_different_partitions(resolver, tmp_path):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_save_restore_different_partitions."""
    strategy, holder = sharded(resolver, [0, 1, 2, 3], 4)
    path = ds.Checkpoint(s=holder).save(tmp_path / "checkpoint")
    strategy2, holder2 = sharded(resolver, [0, 0, 0, 0], 1)
    ds.Checkpoint(s=holder2).restore(path)  # 4 partitions into 1
    assert pieces(strategy2, holder2) == [[0, 1, 2, 3]]
    holder2.load_state_dict({"s": torch.tensor([5, 10, 15, 20])})
    path = ds.Checkpoint(s=holder2).save(tmp_path / "checkpoint")
    ds.Checkpoint(s=holder).restore(path)  # 1 partition into 4
    assert pieces(strategy, holder) == [[5], [10], [15], [20]]


def test_save_restore_4_to_2_partitions(resolver, tmp_path):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_save_restore_4_to_2_partitions."""
    strategy, holder = sharded(resolver, [0, 1, 2, 3], 4)
    path = ds.Checkpoint(s=holder).save(tmp_path / "checkpoint")
    strategy2, holder2 = sharded(resolver, [0, 0, 0, 0], 2)
    ds.Checkpoint(s=holder2).restore(path)
    assert pieces(strategy2, holder2) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("shards", [4, 2], ids=["test_delayed_restore", "test_delayed_restore_4_to_2_partitions"])
def test_delayed_restore(resolver, tmp_path, shards):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_delayed_restore and test_delayed_restore_4_to_2_partitions.

    Difference: TF keeps a restore pending until the variable is assigned to the model; PyTorch modules have
    their parameters when built, so distrib restores into the built module, and restoring into a module that
    lacks a saved parameter is a CheckpointError that names it (no silent partial restore)."""
    strategy, holder = sharded(resolver, [0, 1, 2, 3], 4)
    path = ds.Checkpoint(model=holder).save(tmp_path / "checkpoint")
    with pytest.raises(ds.CheckpointError, match="'s'"):
        ds.Checkpoint(model=nn.Module()).restore(path)
    strategy2, holder2 = sharded(resolver, [0, 0, 0, 0], shards)
    ds.Checkpoint(model=holder2).restore(path)
    assert pieces(strategy2, holder2) == ([[0], [1], [2], [3]] if shards == 4 else [[0, 1], [2, 3]])


def test_tf_module(resolver):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_tf_module.

    Difference: TF's module lists the shards as its variables; a PyTorch module lists the one whole parameter
    (``model.parameters()``, ``state_dict()`` keys), so optimizers and checkpoints see the model as written."""
    strategy, holder = sharded(resolver, [0, 1], 2)
    assert [name for name, _ in holder.named_parameters()] == ["s"]
    assert holder.state_dict()["s"].tolist() == [0, 1]
    assert pieces(strategy, holder) == [[0], [1]]


def test_embedding_lookup(resolver):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_embedding_lookup.

    TF counts ResourceGather ops (one per shard) in a traced graph; here the lookups run in a scheduled
    function on the worker's copy of the table, refreshed from its 3 shards (2, 2 and 1 rows, as TF's)."""
    strategy = ds.ParameterServerStrategy(resolver, ds.partitioners.FixedShardsPartitioner(3))
    with strategy.scope():
        sv = nn.Embedding(5, 2)
    sv.load_state_dict({"weight": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])})
    assert [len(s) for s in strategy.variable_shards(sv)["weight"]] == [2, 2, 1]
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def lookups():
        lookup = sv(torch.tensor([0, 3, 4]))
        sparse_lookup = F.embedding_bag(torch.tensor([0, 3, 4, 1]), sv.weight, torch.tensor([0, 2, 3]), mode="mean")
        ids, weights = torch.tensor([0, -1, 4, 1]), torch.tensor([1.0, 1.0, -1.0, 1.0])
        keep = (ids >= 0) & (weights > 0)  # safe_embedding_lookup_sparse prunes these
        offsets = torch.searchsorted(torch.tensor([0, 0, 1, 2])[keep], torch.arange(3))
        safe_sparse_lookup = F.embedding_bag(ids[keep], sv.weight, offsets, mode="mean")
        return lookup.detach(), sparse_lookup.detach(), safe_sparse_lookup.detach()

    lookup, sparse_lookup, safe_sparse_lookup = coordinator.schedule(lookups).fetch()
    assert lookup.tolist() == [[1.0, 2.0], [7.0, 8.0], [9.0, 10.0]]
    assert torch.allclose(sparse_lookup, torch.tensor([[4.0, 5.0], [9.0, 10.0], [3.0, 4.0]]))
    assert torch.allclose(safe_sparse_lookup, torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]))
    coordinator.close()


def test_slicing(resolver):
    """TF: sharded_variable_test.py, ShardedVariableTest.test_slicing.

    The slices are taken on a worker, of its copy of an 8-row parameter in 3 shards (3, 3 and 2 rows, TF's).
    Differences, PyTorch's indexing rules: a negative step is an error (``torch.flip`` reverses), and a
    tensor index is allowed (TF: TypeError)."""
    strategy = ds.ParameterServerStrategy(resolver, ds.partitioners.FixedShardsPartitioner(3))
    with strategy.scope():
        holder = Holder(torch.arange(1, 17).reshape(8, 2))
    assert [len(s) for s in strategy.variable_shards(holder)["s"]] == [3, 3, 2]
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def slices():
        sv = holder.s.detach()
        out = {
            ":": sv[:],
            ":2": sv[:2],
            "-8:2": sv[-8:2],
            "5:": sv[5:],
            "5:-1": sv[5:-1],
            "::3": sv[::3],
            "::5": sv[::5],
            "1::6": sv[1::6],
            "1:5:6": sv[1:5:6],
            "1::7": sv[1::7],
            "2:7": sv[2:7],
            "2:7:2": sv[2:7:2],
            "2:7:3": sv[2:7:3],
            "::-1": torch.flip(sv, [0]),
            "2::-1": torch.flip(sv[:3], [0]),
            "7:1:-2": torch.flip(sv[2:8], [0])[::2],
            "0:0": sv[0:0],
            "5:3": sv[5:3],
            ":,0": sv[:, 0],
            ":,0:1": sv[:, 0:1],
            "2": sv[2],
            "6": sv[6],
            "2,1": sv[2, 1],
            "-2": sv[-2],
            "...": sv[...],
            "...,0": sv[..., 0],
            "0:1,...": sv[0:1, ...],
            "None,...": sv[None, ...],
            "mask": sv[sv > 10],
            "tensor": sv[torch.tensor(1) :],
        }
        errors = []
        for index in (100, -100):
            try:
                sv[index]
            except IndexError as e:
                errors.append(str(e))
        try:
            sv[::-1]
        except ValueError as e:
            errors.append(str(e))
        return out, errors

    out, errors = coordinator.schedule(slices).fetch()
    rows = torch.arange(1, 17).reshape(8, 2)
    expected = {
        ":": rows,
        ":2": [[1, 2], [3, 4]],
        "-8:2": [[1, 2], [3, 4]],
        "5:": [[11, 12], [13, 14], [15, 16]],
        "5:-1": [[11, 12], [13, 14]],
        "::3": [[1, 2], [7, 8], [13, 14]],
        "::5": [[1, 2], [11, 12]],
        "1::6": [[3, 4], [15, 16]],
        "1:5:6": [[3, 4]],
        "1::7": [[3, 4]],
        "2:7": [[5, 6], [7, 8], [9, 10], [11, 12], [13, 14]],
        "2:7:2": [[5, 6], [9, 10], [13, 14]],
        "2:7:3": [[5, 6], [11, 12]],
        "::-1": torch.flip(rows, [0]),
        "2::-1": [[5, 6], [3, 4], [1, 2]],
        "7:1:-2": [[15, 16], [11, 12], [7, 8]],
        "0:0": torch.zeros(0, 2, dtype=torch.int64),
        "5:3": torch.zeros(0, 2, dtype=torch.int64),
        ":,0": [1, 3, 5, 7, 9, 11, 13, 15],
        ":,0:1": [[1], [3], [5], [7], [9], [11], [13], [15]],
        "2": [5, 6],
        "6": [13, 14],
        "2,1": 6,
        "-2": [13, 14],
        "...": rows,
        "...,0": [1, 3, 5, 7, 9, 11, 13, 15],
        "0:1,...": [[1, 2]],
        "None,...": rows[None],
        "mask": [11, 12, 13, 14, 15, 16],
        "tensor": rows[1:],
    }
    for key, want in expected.items():
        assert torch.equal(out[key], torch.as_tensor(want)), key
    assert len(errors) == 3 and all("out of bounds" in e for e in errors[:2]) and "step" in errors[2]
    coordinator.close()
