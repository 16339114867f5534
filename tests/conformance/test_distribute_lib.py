"""Conformance: TF's ``tensorflow/python/distribute/distribute_lib_test.py``, ported to distrib.

TF's ``_TestStrategy`` (a one-replica strategy that is not the default one) is ``ds.OneDeviceStrategy("cpu")``;
TF's default strategy is ``ds.get_strategy()`` outside every scope. TF's ``extended.call_for_each_replica`` is
``strategy.run``. Graph mode and ``tf.function`` variants collapse into eager PyTorch; ``tf.data`` datasets are
Python lists of batches.

Not ported, and why:
- ``testScopeDeviceNestingError``, ``testScopeVarCreatorNestingError``, ``testScopeVarScopeNestingError``: a distrib
  scope installs no device scope, variable creator or variable scope (PyTorch has none of the three to nest wrongly).
- ``testSettingSynchronizationAndAggregation``: variables' synchronization/aggregation modes do not exist in PyTorch.
- ``testSetStrategy``, ``testSetStrategyInScope``: ``experimental_set_strategy`` is not a name distrib claims.
- ``testMakeInputFnIterator``, ``testExperimentalMakeNumpyDataset``, ``testExperimentalRunStepsOnIterator``: TF1
  input APIs (``make_input_fn_iterator``, ``experimental_make_numpy_dataset``, ``experimental_run_steps_on_iterator``)
  that distrib does not claim.
- ``testUpdate``, ``testUpdateAutoGraph``, ``testUpdateNonSlot``, ``testUpdateNonSlotAutoGraph``: ``extended.update``
  of variables (and AutoGraph) have no PyTorch counterpart; ``optimizer.step()`` is distrib's update.
- ``testMergeCallAutoGraph``: AutoGraph does not exist in PyTorch.
- ``testClusterResolverDefaultNotImplemented``, its second half: it sets TF's private ``extended._cluster_resolver``.
- The variable-creation lines inside ported tests (``variable_scope.variable(...)`` returning the test strategy's
  dict): PyTorch has no variable creator; ``testScopeMostlyNoOp`` builds a ``torch.nn.Module`` instead.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import distrib as ds

# Outside every scope (at import) the current strategy and replica context are the default ones.
DEFAULT_STRATEGY = ds.get_strategy()
DEFAULT_REPLICA_CONTEXT = ds.get_replica_context()

# TF: "Mixing different tf.distribute.Strategy objects"; distrib: "... inside the scope of a different strategy".
MIXING = r"(?i)mixing different .*strateg|different strategy"


def _dataset_range_batch(n: int, batch: int) -> list[torch.Tensor]:
    """``tf.data.Dataset.range(n).batch(batch)`` as a list of int64 batches."""
    return [torch.arange(i, min(i + batch, n)) for i in range(0, n, batch)]


def assert_in_default_state() -> None:
    """TF's ``_assert_in_default_state``."""
    assert ds.get_replica_context() is DEFAULT_REPLICA_CONTEXT
    assert not ds.in_cross_replica_context()
    assert ds.get_strategy() is DEFAULT_STRATEGY
    assert not ds.has_strategy()
    assert ds.get_cross_replica_context() is None


def run_in_and_out_of_scope(check: Callable[[ds.Strategy], None]) -> None:
    """TF's ``_run_in_and_out_of_scope``: ``check(dist)`` outside and inside ``dist.scope()``; fails under another's."""
    dist = ds.OneDeviceStrategy("cpu")
    assert_in_default_state()
    check(dist)
    with dist.scope():
        check(dist)
    assert_in_default_state()
    another_strategy = ds.OneDeviceStrategy("cpu")
    with pytest.raises(RuntimeError, match=MIXING):
        with another_strategy.scope():
            check(dist)


# --------------------------------------------------------------------------- TestStrategyTest


def test_call_for_each_replica():
    """TF: distribute_lib_test.py, TestStrategyTest.testCallForEachReplica."""
    assert_in_default_state()
    dist = ds.OneDeviceStrategy("cpu")

    def run_fn():
        replica_context = ds.get_replica_context()
        assert replica_context is not None
        assert ds.get_cross_replica_context() is None
        assert not ds.in_cross_replica_context()
        assert ds.has_strategy()
        assert ds.get_strategy() is dist
        assert replica_context.merge_call(lambda _, test_arg: test_arg, kwargs={"test_arg": "foo"}) == "foo"

    dist.run(run_fn)
    with dist.scope():
        dist.run(run_fn)
    assert_in_default_state()


def test_scope():
    """TF: distribute_lib_test.py, TestStrategyTest.testScope."""
    assert_in_default_state()
    dist = ds.OneDeviceStrategy("cpu")
    with dist.scope():
        assert ds.get_replica_context() is None
        assert ds.get_cross_replica_context() is dist
        assert ds.in_cross_replica_context()
        assert ds.has_strategy()
        assert ds.get_strategy() is dist
    assert_in_default_state()


def test_same_scope_nesting():
    """TF: distribute_lib_test.py, TestStrategyTest.testSameScopeNesting."""
    assert_in_default_state()
    dist = ds.OneDeviceStrategy("cpu")
    scope_a = dist.scope()
    with scope_a:
        assert ds.get_strategy() is dist
        scope_b = dist.scope()
        with scope_b:
            assert ds.get_strategy() is dist
            with scope_a:
                assert ds.get_strategy() is dist
            assert ds.get_strategy() is dist
        assert ds.get_strategy() is dist
        dist2 = ds.OneDeviceStrategy("cpu")
        scope2 = dist2.scope()
        with pytest.raises(RuntimeError, match=MIXING):
            with scope2:
                pass
    assert_in_default_state()
    with scope_b:
        assert ds.get_strategy() is dist
    assert_in_default_state()


def test_reduce():
    """TF: distribute_lib_test.py, TestStrategyTest.testReduce (in and out of scope, and under another strategy's scope)."""

    def check(dist):
        x = torch.tensor(1.0)
        assert dist.reduce(ds.ReduceOp.MEAN, x, axis=None) == x

    run_in_and_out_of_scope(check)


def test_reductions_accept_string_ops():
    """TF: distribute_lib_test.py, TestStrategyTest.testReductions_acceptStringOps."""
    dist = ds.OneDeviceStrategy("cpu")
    for op in ("mean", "MEAN", "sum", "SUM"):
        x, y = torch.tensor(1.0), torch.tensor(1.0)
        assert dist.reduce(op, x, axis=None) == x
        assert dist.extended.reduce_to(op, x, "/CPU:0") == x
        x_r, y_r = dist.extended.batch_reduce_to(op, ((x, "/CPU:0"), (y, "/CPU:0")))
        assert x_r == x and y_r == y


def test_reduce_to():
    """TF: distribute_lib_test.py, TestStrategyTest.testReduceTo."""

    def check(dist):
        x = torch.tensor(1.0)
        assert dist.extended.reduce_to(ds.ReduceOp.MEAN, x, "/CPU:0") == x

    run_in_and_out_of_scope(check)


def test_batch_reduce_to():
    """TF: distribute_lib_test.py, TestStrategyTest.testBatchReduceTo."""

    def check(dist):
        x, y = torch.tensor(1.0), torch.tensor(1.0)
        x_r, y_r = dist.extended.batch_reduce_to(ds.ReduceOp.MEAN, ((x, "/CPU:0"), (y, "/CPU:0")))
        assert x_r == x and y_r == y

    run_in_and_out_of_scope(check)


def test_cluster_resolver_default_not_implemented():
    """TF: distribute_lib_test.py, TestStrategyTest.testClusterResolverDefaultNotImplemented (first half)."""
    assert ds.OneDeviceStrategy("cpu").cluster_resolver is None
    assert DEFAULT_STRATEGY.cluster_resolver is None


# --------------------------------------------------------------------------- DefaultDistributionStrategyTest


def test_merge_call():
    """TF: distribute_lib_test.py, DefaultDistributionStrategyTest.testMergeCall."""
    assert_in_default_state()

    def merge_fn(dist, s):
        assert dist is DEFAULT_STRATEGY
        assert ds.get_replica_context() is None
        assert ds.get_cross_replica_context() is dist
        assert ds.in_cross_replica_context()
        assert ds.get_strategy() is dist
        assert not ds.has_strategy()
        return "foo_" + s

    replica_ctx = ds.get_replica_context()
    assert replica_ctx is DEFAULT_REPLICA_CONTEXT
    assert replica_ctx.merge_call(merge_fn, args=("bar",)) == "foo_bar"
    assert_in_default_state()


def test_scope_mostly_no_op():
    """TF: distribute_lib_test.py, DefaultDistributionStrategyTest.testScopeMostlyNoOp.

    TF raises "Mixing different tf.distribute.Strategy objects" when a variable is created under another
    strategy's scope opened inside the default strategy's scope; distrib raises when that scope is entered,
    before any module is built.
    """
    assert_in_default_state()
    test_strategy = ds.OneDeviceStrategy("cpu")
    with test_strategy.scope():
        torch.nn.Linear(1, 1)  # "before"

    scope = DEFAULT_STRATEGY.scope()
    with scope:
        assert_in_default_state()
        with pytest.raises(RuntimeError, match=MIXING):
            with test_strategy.scope():
                torch.nn.Linear(1, 1)  # "error"
        with scope:
            assert_in_default_state()
            with pytest.raises(RuntimeError, match=MIXING):
                with test_strategy.scope():
                    torch.nn.Linear(1, 1)  # "also_error"
        assert_in_default_state()
    assert_in_default_state()
    with test_strategy.scope():
        torch.nn.Linear(1, 1)  # "after"


def test_experimental_run_v2():
    """TF: distribute_lib_test.py, DefaultDistributionStrategyTest.testExperimentalRunV2.

    TF calls ``run`` twice on the same element; distrib also checks the old name ``experimental_run_v2``,
    which warns that it is deprecated, as TF's does.
    """
    default_strategy = DEFAULT_STRATEGY
    iterator = iter(default_strategy.experimental_distribute_dataset(_dataset_range_batch(10, 2)))
    next_val = iterator.get_next()

    def train_step(input_data):
        return input_data

    for _ in range(2):
        assert torch.equal(default_strategy.run(train_step, args=(next_val,)), next_val)
    with pytest.warns(DeprecationWarning, match="experimental_run_v2"):
        assert torch.equal(default_strategy.experimental_run_v2(train_step, args=(next_val,)), next_val)


def test_distributed_datasets():
    """TF: distribute_lib_test.py, DefaultDistributionStrategyTest.testDistributedDatasets."""
    dataset_fn = lambda _: _dataset_range_batch(10, 2)  # noqa: E731
    dist_dataset = DEFAULT_STRATEGY.experimental_distribute_dataset(dataset_fn(ds.InputContext()))
    next_val = next(iter(dist_dataset))
    assert next_val.tolist() == [0, 1]


def test_distributed_datasets_from_function():
    """TF: distribute_lib_test.py, DefaultDistributionStrategyTest.testDistributedDatasetsFromFunction.

    TF calls the old name ``experimental_distribute_datasets_from_function``; distrib keeps it and warns.
    """
    dataset_fn = lambda _: _dataset_range_batch(10, 2)  # noqa: E731
    with pytest.warns(DeprecationWarning, match="distribute_datasets_from_function"):
        dist_dataset_from_func = DEFAULT_STRATEGY.experimental_distribute_datasets_from_function(dataset_fn)
    next_val = next(iter(dist_dataset_from_func))
    assert next_val.tolist() == [0, 1]


# --------------------------------------------------------------------------- InputContextTest


def test_input_context_properties():
    """TF: distribute_lib_test.py, InputContextTest.testProperties."""
    input_context = ds.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert input_context.num_replicas_in_sync == 6
    assert input_context.input_pipeline_id == 1
    assert input_context.num_input_pipelines == 2


def test_input_context_per_replica_batch_size():
    """TF: distribute_lib_test.py, InputContextTest.testPerReplicaBatchSize."""
    input_context = ds.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert input_context.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError):
        input_context.get_per_replica_batch_size(13)


def test_input_context_str():
    """TF: distribute_lib_test.py, InputContextTest.testStr.

    TF: ``"tf.distribute.InputContext(input pipeline id 0, total: 1)"``; the ``tf.distribute.`` prefix is TF's
    namespace, the rest is what a user reads in a log line.
    """
    input_context = ds.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=42)
    assert str(input_context).endswith("InputContext(input pipeline id 0, total: 1)")
    input_context = ds.InputContext(num_input_pipelines=3, input_pipeline_id=1, num_replicas_in_sync=42)
    assert str(input_context).endswith("InputContext(input pipeline id 1, total: 3)")
