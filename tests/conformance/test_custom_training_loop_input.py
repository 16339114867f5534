"""Conformance: TF's ``tensorflow/python/distribute/custom_training_loop_input_test.py`` (``InputIterationTest``),
ported to distrib.

Strategies: TF's ``all_strategies`` / ``strategies_minus_tpu`` are the default strategy (``ds.get_strategy()``),
``ds.OneDeviceStrategy("cpu")``, ``ds.MirroredStrategy(["cpu:0", "cpu:1"])`` and
``ds.CentralStorageStrategy(["cpu:0", "cpu:1"])`` (TF's ``central_storage_strategy_with_gpu_and_cpu``); its
``multidevice_strategies`` (which "assume exactly 2 replicas") are the Mirrored one. ``tf.function`` variants (step, run or iteration inside a
function) collapse into eager PyTorch, so tests that differ only in where ``tf.function`` sits share one body
here. ``tf.data`` pipelines are lists of batches (``from_tensor_slices(...).batch(b)`` is a list of tensors of
``b`` rows). TF's ``errors.OutOfRangeError`` from ``next()`` is Python's ``StopIteration``.

Not ported, and why:
- ``testStatefulExperimentalRunAlwaysExecute``: a variable with ``VariableAggregation.MEAN``; PyTorch has no
  variable aggregation modes.
- ``testDatasetIterationInFunction``, its ``ONLY_FIRST_REPLICA`` variable half (same reason); the iteration and
  ``reduce`` half is ported.
- ``testFullEagerTPU``, ``testDistributeDatasetHostPrefetch``, ``testDistributeDatasetFunctionHostPrefetch``,
  ``testDynamicShapesWithRunOptionsBucketizing``, ``testDynamicShapesWithRunOptionsDisableDynamicPadder``: TPU / XLA.
- ``testComputeLossWithDynamicShapes``: ``tf.compat.v1.losses.compute_weighted_loss`` is not a name distrib claims.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

import distrib as ds

DEFAULT_STRATEGY = ds.get_strategy()
ALL: dict[str, Callable[[], ds.Strategy]] = {
    "default": lambda: DEFAULT_STRATEGY,
    "one_device_cpu": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_cpu_1_and_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_cpu_1_and_2": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


@pytest.fixture(scope="module", params=list(ALL))
def distribution(request) -> ds.Strategy:
    return ALL[request.param]()


@pytest.fixture(scope="module")
def multidevice() -> ds.Strategy:
    return ds.MirroredStrategy(["cpu:0", "cpu:1"])


def batched(
    values: Iterable[Any], batch_size: int, drop_remainder: bool = False, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """``Dataset.from_tensor_slices(values).batch(batch_size, drop_remainder)`` as a list of tensors."""
    data = torch.as_tensor(values, dtype=dtype) if not isinstance(values, torch.Tensor) else values
    end = len(data) - len(data) % batch_size if drop_remainder else len(data)
    return [data[i : min(i + batch_size, end)] for i in range(0, end, batch_size)]


def assert_equal_flattened(expected_results: list[list[float]], actual_results: list[tuple[Any, ...]]) -> None:
    """TF's ``AssertFlattenedMixin.assert_equal_flattened``: each step's replica results, concatenated."""
    assert len(expected_results) == len(actual_results)
    for expected_result, actual_result in zip(expected_results, actual_results):
        final_result: list[float] = []
        for val in actual_result:
            final_result.extend(val.tolist())
        assert final_result == expected_result


def test_constant_numpy_input(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testConstantNumpyInput."""

    def computation(x):
        return torch.square(torch.as_tensor(x))

    outputs = distribution.experimental_local_results(distribution.run(computation, args=(2.0,)))
    assert [float(o) for o in outputs] == [4.0] * distribution.num_replicas_in_sync


@pytest.mark.parametrize(
    "tf_name, iteration",
    [
        ("testFullEager", "for"),
        ("testStepInFunction", "for"),
        ("testRunInFunction", "for"),
        ("testRunInFunctionAutoGraphApplication", "for"),
        ("testIterationInsideFunction", "next"),
        ("testIterationOutsideFunction", "next"),
    ],
)
def test_iteration(distribution, tf_name, iteration):
    """TF: custom_training_loop_input_test.py, InputIterationTest.<tf_name> (testFullEager, testStepInFunction,
    testRunInFunction, testRunInFunctionAutoGraphApplication: a ``for`` loop over the distributed dataset;
    testIterationInsideFunction, testIterationOutsideFunction: ``next(iter(...))`` twice)."""
    dataset = batched([5.0, 6.0, 7.0, 8.0], 2)

    def train_step(data):
        return torch.square(data)

    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    results = []
    if iteration == "for":
        for x in dist_dataset:
            results.append(distribution.experimental_local_results(distribution.run(train_step, args=(x,))))
    else:
        iterator = iter(dist_dataset)
        for _ in range(2):  # 4 elements, global batch of 2
            results.append(
                distribution.experimental_local_results(distribution.run(train_step, args=(next(iterator),)))
            )
    assert_equal_flattened([[25.0, 36.0], [49.0, 64.0]], results)


def test_get_next_as_optional(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testGetNextAsOptional."""
    dist_dataset = distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0, 8.0], 2))
    iterator = iter(dist_dataset)

    def train_step(data):
        return torch.square(data)

    result = distribution.experimental_local_results(
        distribution.run(train_step, args=(iterator.get_next_as_optional().get_value(),))
    )
    assert_equal_flattened([[25.0, 36.0]], [result])


def test_get_next_as_optional_example_usage(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testGetNextAsOptionalExampleUsage."""
    global_batch_size, steps_per_loop = 2, 6
    dataset = batched(range(8), global_batch_size, dtype=torch.int32)
    distributed_iterator = iter(distribution.experimental_distribute_dataset(dataset))
    seen = []

    def step_fn(x):
        seen.append(x)
        return x

    steps = 0
    for _ in range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        distribution.run(step_fn, args=(optional_data.get_value(),))
        steps += 1
    assert steps == 4
    assert sorted(int(v) for x in seen for v in x) == list(range(8))


def test_nested_output(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testNestedOutput."""
    distribution = multidevice
    input_iterator = iter(distribution.experimental_distribute_dataset(batched([0, 1, 2, 3], 2)))

    def computation(x):
        return [{"a": x - 1, "b": x + 1}]

    outputs = distribution.run(computation, args=(next(input_iterator),))
    results = [{k: distribution.experimental_local_results(v) for k, v in outputs[0].items()}]
    for replica in range(distribution.num_replicas_in_sync):
        # the input is range(4), so the replica id is the input
        assert results[0]["a"][replica].tolist() == [replica - 1]
        assert results[0]["b"][replica].tolist() == [replica + 1]


def test_dataset_iteration_in_function(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDatasetIterationInFunction (iteration and
    ``reduce`` half; see the module docstring)."""
    dist_dataset = distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0, 8.0], 2))
    number_of_steps = torch.tensor(0.0)
    product_of_means = torch.tensor(2.0)
    for x in dist_dataset:  # loop with values modified each iteration
        number_of_steps += 1
        product_of_means *= distribution.reduce("MEAN", x, axis=0).to(product_of_means.dtype)
    for y in dist_dataset:  # loop with no intermediate state
        distribution.run(lambda _: None, args=(y,))
    assert float(number_of_steps) == 2
    assert float(product_of_means) == pytest.approx(2 * (5 + 6) / 2 * (7 + 8) / 2, abs=1e-3)


def test_dataset_assert_with_dynamic_batch(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDatasetAssertWithDynamicBatch.

    The step asserts on its (possibly empty) part of a short last batch.
    """

    def step_fn(data):
        assert bool((data <= 100.0).all()), data  # TF: Assert(reduce_max(data) <= 100)
        return torch.square(data)

    dist_dataset = distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0], 2))
    results = []
    iterator = iter(dist_dataset)
    for _ in range(2):  # 3 elements, global batch of 2
        results.append(distribution.experimental_local_results(distribution.run(step_fn, args=(next(iterator),))))
    assert_equal_flattened([[25.0, 36.0], [49.0]], results)


def test_distribute_dataset_iterator_without_function(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDistributeDatasetIteratorWithoutFunction."""
    data = [5.0, 6.0, 7.0, 8.0]
    input_iterator = iter(distribution.distribute_datasets_from_function(lambda _: [torch.tensor(v) for v in data]))
    local = distribution.experimental_local_results(input_iterator.get_next())
    assert [float(v) for v in local] == data[0 : distribution.num_replicas_in_sync]


def _device_types(values: Iterable[torch.Tensor]) -> list[str]:
    return [v.device.type for v in values]


def test_distribute_dataset_iterator_with_function(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDistributeDatasetIteratorWithFunction.

    TF compares each result's backing device with ``extended.worker_devices``; logical CPU replicas all compute on
    the one CPU device, so the device types are compared.
    """
    distribution = multidevice
    data = [5.0, 6.0, 7.0, 8.0]
    input_iterator = iter(distribution.distribute_datasets_from_function(lambda _: [torch.tensor(v) for v in data]))
    local_results = distribution.experimental_local_results(input_iterator.get_next())
    assert [float(v) for v in local_results] == data[0 : distribution.num_replicas_in_sync]
    assert _device_types(local_results) == [torch.device(d).type for d in distribution.extended.worker_devices]


@pytest.mark.parametrize(
    "api, tf_name",
    [("dataset", "testDistributeDatasetPrefetch"), ("function", "testDistributeDatasetFunctionPrefetch")],
)
def test_distribute_dataset_prefetch(multidevice, api, tf_name):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDistributeDatasetPrefetch /
    testDistributeDatasetFunctionPrefetch: every replica's element is on that replica's device."""
    distribution = multidevice
    data = [5.0, 6.0, 7.0, 8.0]
    if api == "dataset":
        dist = distribution.experimental_distribute_dataset(batched(data, 2))
    else:
        dist = distribution.distribute_datasets_from_function(lambda _: [torch.tensor(v) for v in data])
    local_results = distribution.experimental_local_results(iter(dist).get_next())
    assert _device_types(local_results) == [torch.device(d).type for d in distribution.extended.worker_devices]


@pytest.mark.parametrize("tf_name", ["testDynamicShapes", "testDynamicShapesWithGetNextOutsideFunction"])
def test_dynamic_shapes(multidevice, tf_name):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDynamicShapes /
    testDynamicShapesWithGetNextOutsideFunction: a batch of 3 over 2 replicas gives parts of 2 and 1."""
    distribution = multidevice
    input_iterator = iter(distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0], 4)))

    def computation(x):
        return torch.mean(x)

    outputs = distribution.experimental_local_results(distribution.run(computation, args=(next(input_iterator),)))
    assert [float(o) for o in outputs] == [5.5, 7.0]


def test_dynamic_outputs_with_x64(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDynamicOutputsWithX64."""
    distribution = multidevice
    input_iterator = iter(distribution.experimental_distribute_dataset(batched([5], 2, dtype=torch.int64)))
    result = distribution.experimental_local_results(distribution.run(lambda x: x + x, args=(next(input_iterator),)))
    assert result[0].tolist() == [10] and result[0].dtype == torch.int64
    assert result[1].tolist() == []


def test_strategy_reduce_with_dynamic_shapes(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testStrategyReduceWithDynamicShapes."""
    distribution = multidevice
    inputs = next(iter(distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0], 4))))
    assert float(distribution.reduce(ds.ReduceOp.MEAN, inputs, axis=0)) == 6.0


def test_strategy_reduce_with_dynamic_shapes_rank2(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testStrategyReduceWithDynamicShapesRank2."""
    distribution = multidevice
    dataset = batched([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], 4)
    inputs = next(iter(distribution.experimental_distribute_dataset(dataset)))
    assert distribution.reduce(ds.ReduceOp.MEAN, inputs, axis=0).tolist() == [1.0, 1.0]


def test_dynamic_shapes_with_size_op(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDynamicShapesWithSizeOp."""
    distribution = multidevice
    inputs = next(iter(distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0], 4))))
    outputs = distribution.experimental_local_results(distribution.run(lambda x: x.numel(), args=(inputs,)))
    assert list(outputs) == [2, 1]


def test_segment_sum_with_dynamic_number_of_segments(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testSegmentSumWithDynamicNumberOfSegments."""
    distribution = multidevice

    def dataset_fn(_):
        return batched(torch.zeros(5, dtype=torch.int32), 3)

    input_iterator = iter(distribution.distribute_datasets_from_function(dataset_fn))

    def step_fn(example):
        segment_ids = torch.zeros_like(example, dtype=torch.int64)
        num_segment = example.shape[0]
        return torch.zeros(num_segment, dtype=example.dtype).index_add_(0, segment_ids, example)

    outputs = distribution.experimental_local_results(distribution.run(step_fn, args=(next(input_iterator),)))
    assert tuple(outputs[0].shape) == (3,)
    assert tuple(outputs[1].shape) == (2,)


def test_reshape_with_dynamic_inputs(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testReshapeWithDynamicInputs."""
    distribution = multidevice

    def dataset_fn(_):
        return batched(torch.zeros((5, 1, 2), dtype=torch.int32), 3)

    input_iterator = iter(distribution.distribute_datasets_from_function(dataset_fn))

    def step_fn(example):
        n = example.shape[0]  # example: [<=3, 1, 2]
        tile = example.repeat(1, n, 1)  # [<=3, <=3, 2]
        reshape1 = tile.reshape(-1, 2)  # [<=9, 2]
        reshape2 = reshape1.reshape(n, n, 2)
        reshape3 = reshape1.reshape(n, -1, 2)
        reshape4 = reshape1.reshape(-1, n, 2)
        return [reshape1, reshape2, reshape3, reshape4, reshape1]

    outputs = distribution.experimental_local_results(distribution.run(step_fn, args=(next(input_iterator),)))
    assert [tuple(o.shape) for o in outputs[0]] == [(9, 2), (3, 3, 2), (3, 3, 2), (3, 3, 2), (9, 2)]
    assert [tuple(o.shape) for o in outputs[1]] == [(4, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2), (4, 2)]


def test_dynamic_shapes_with_first_replica_not_maximum_shape(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDynamicShapesWithFirstReplicaNotMaximumShape."""
    distribution = multidevice

    def dataset_fn(_):
        return [torch.tensor([[1.0, 2.0], [1.0, 2.0]]), torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])]

    input_iterator = iter(distribution.distribute_datasets_from_function(dataset_fn))
    outputs = distribution.experimental_local_results(distribution.run(torch.mean, args=(next(input_iterator),)))
    assert [float(o) for o in outputs] == [1.5, 2.0]


def test_map_fn_with_dynamic_inputs(multidevice):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testMapFnWithDynamicInputs."""
    distribution = multidevice

    def dataset_fn(_):
        return batched(torch.zeros((20, 300, 32), dtype=torch.int32), 16)

    input_iterator = iter(distribution.distribute_datasets_from_function(dataset_fn))

    def embedding_lookup(inputs):
        embedding_weights = torch.zeros((1, 128))
        embeddings = embedding_weights[inputs.reshape(-1).long()]
        return embeddings.reshape(*inputs.shape, 128)

    def step_fn(example):
        return torch.stack([embedding_lookup(e) for e in example])  # tf.map_fn over the batch

    outputs = distribution.experimental_local_results(distribution.run(step_fn, args=(next(input_iterator),)))
    assert tuple(outputs[0].shape) == (16, 300, 32, 128)
    assert tuple(outputs[1].shape) == (4, 300, 32, 128)


@pytest.mark.parametrize(
    "batch_size, drop_remainder, expected, tf_name",
    [
        (2, True, [5.0, 6.0], "testDatasetDistributeEvenlyDivisibleDrop"),
        (1, True, [5.0], "testDatasetDistributeNotDivisibleDrop"),
        (2, False, [5.0, 6.0], "testDatasetDistributeEvenlyDivisibleNoDrop"),
    ],
)
def test_dataset_distribute(distribution, batch_size, drop_remainder, expected, tf_name):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDatasetDistributeEvenlyDivisibleDrop /
    testDatasetDistributeNotDivisibleDrop / testDatasetDistributeEvenlyDivisibleNoDrop: the first element's parts,
    concatenated over replicas, are the first global batch."""
    dataset = batched([5.0, 6.0], batch_size, drop_remainder=drop_remainder)
    data = next(iter(distribution.experimental_distribute_dataset(dataset)))
    final_result: list[float] = []
    for val in distribution.experimental_local_results(data):
        final_result.extend(val.tolist())
    assert final_result == expected


def test_dataset_partial_batch_with_mixed_outputs(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDatasetPartialBatchWithMixedOutputs."""
    input_iterator = iter(distribution.experimental_distribute_dataset(batched([5.0], 2)))

    def computation(x):
        return torch.zeros(3), torch.square(x)  # a fixed-size output and a dynamic one

    results = distribution.run(computation, args=(next(input_iterator),))
    for replica_id in range(distribution.num_replicas_in_sync):
        assert distribution.experimental_local_results(results[0])[replica_id].tolist() == [0.0, 0.0, 0.0]
    assert distribution.experimental_local_results(results[1])[0].tolist() == [25.0]
    for replica_id in range(1, distribution.num_replicas_in_sync):
        assert distribution.experimental_local_results(results[1])[replica_id].tolist() == []


def test_multi_device_data_captured_function(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testMultiDeviceDataCapturedFunction."""
    inputs = [2.0, 3.0] * 5  # from_tensor_slices([2., 3.]).repeat(5)
    input_iterator = iter(distribution.distribute_datasets_from_function(lambda _: [torch.tensor(v) for v in inputs]))
    with distribution.scope():
        var = torch.tensor(1.0)

    def train_step(input_iterator):
        def func(inputs):
            return torch.square(inputs) + var

        per_replica_outputs = distribution.run(func, (next(input_iterator),))
        mean = distribution.reduce(ds.ReduceOp.MEAN, per_replica_outputs, axis=None)
        for _ in range(1):
            per_replica_outputs = distribution.run(func, (next(input_iterator),))
            mean = distribution.reduce(ds.ReduceOp.MEAN, per_replica_outputs, axis=None)
        return mean

    with distribution.scope():
        expected = 10.0 if distribution.num_replicas_in_sync == 1 else 7.5
        assert float(train_step(input_iterator)) == pytest.approx(expected)


def test_dataset_out_of_range(distribution):
    """TF: custom_training_loop_input_test.py, InputIterationTest.testDatasetOutOfRange.

    TF's variable has ``VariableAggregation.SUM``: each replica adds its part. A tensor updated in place by every
    replica does the same in distrib (replicas take turns, so the updates add up).
    """
    with distribution.scope():
        a = torch.tensor(0.0)

    def train_step(val):
        a.add_(val.sum())

    iterator = iter(distribution.experimental_distribute_dataset(batched([5.0, 6.0, 7.0, 8.0], 2)))
    with pytest.raises(StopIteration):
        for _ in range(100):
            distribution.run(train_step, args=(next(iterator),))
    assert float(a) == pytest.approx(26.0)
