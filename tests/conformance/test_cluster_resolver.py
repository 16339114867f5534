"""TF's ``tensorflow/python/distribute/cluster_resolver/cluster_resolver_test.py``, ported.

Every test of ``BaseClusterResolverTest`` and ``UnionClusterResolverTest``. TF compares protos
(``as_cluster_def``); distrib has no protos, so ``assert_cluster_spec`` checks the same round
trips on ``as_dict()`` and ``==``.
"""

from __future__ import annotations

import pytest
import torch

from distrib.cluster import ClusterResolver, ClusterSpec, SimpleClusterResolver, UnionClusterResolver, UnionResolver

PS_WORKER = {"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}


def assert_cluster_spec(spec: ClusterSpec, expected: dict) -> None:
    """TF's ``_verifyClusterSpecEquality``: the spec, and the spec rebuilt from itself and from its dict."""
    assert spec.as_dict() == expected
    assert ClusterSpec(spec).as_dict() == expected
    assert ClusterSpec(spec.as_dict()).as_dict() == expected
    assert ClusterSpec(spec) == spec == ClusterSpec(expected)


class MockBaseClusterResolver(ClusterResolver):
    def cluster_spec(self):
        return None

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""


def local_accelerators() -> dict:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"GPU": count} if count else {}


def test_num_accelerators_success():
    """TF: cluster_resolver_test.py, BaseClusterResolverTest.testNumAcceleratorsSuccess.

    Documented difference: TF lists the devices a session sees (mocked to 4 GPUs in TF's test);
    distrib counts this machine's CUDA devices (``{}`` on a CPU machine)."""
    assert MockBaseClusterResolver().num_accelerators() == local_accelerators()


def test_num_accelerators_multi_device_success():
    """TF: cluster_resolver_test.py, BaseClusterResolverTest.testNumAcceleratorsMultiDeviceSuccess.

    Documented difference: distrib counts CUDA GPUs only (no TPUs), on this machine."""
    counts = MockBaseClusterResolver().num_accelerators()
    assert set(counts) <= {"GPU"} and counts == local_accelerators()


def test_num_accelerators_filter_tasks():
    """TF: cluster_resolver_test.py, BaseClusterResolverTest.testNumAcceleratorsFilterTasks.

    Documented difference: distrib cannot see another task's machine; ``task_type``/``task_id``
    are accepted and ignored (the answer is this machine's for every task)."""
    resolver = MockBaseClusterResolver()
    for task_type, task_id in (("worker1", 0), ("worker2", 3), ("worker2", 4)):
        assert resolver.num_accelerators(task_type=task_type, task_id=task_id) == local_accelerators()


def test_single_cluster_resolver():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testSingleClusterResolver."""
    union_resolver = UnionClusterResolver(SimpleClusterResolver(ClusterSpec(PS_WORKER)))
    assert_cluster_spec(union_resolver.cluster_spec(), PS_WORKER)


def test_init_simple_cluster_resolver():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testInitSimpleClusterResolver."""
    resolver = SimpleClusterResolver(
        ClusterSpec(PS_WORKER),
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("ps", 1, "cloud")
    assert resolver.num_accelerators() == {"GPU": 8}
    assert resolver.rpc_layer == "grpc"


def test_override_simple_cluster_resolver():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testOverrideSimpleClusterResolver."""
    resolver = SimpleClusterResolver(
        ClusterSpec(PS_WORKER),
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    resolver.task_type = "worker"
    resolver.task_id = 2
    resolver.rpc_layer = "http"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 2, "http")


def test_simple_override_master_with_task_index_zero():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testSimpleOverrideMasterWithTaskIndexZero."""
    assert SimpleClusterResolver(ClusterSpec(PS_WORKER)).master("worker", 0, rpc_layer="grpc") == "grpc://worker0:2222"


def test_simple_override_master_with_rpc_layer():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testSimpleOverrideMasterWithRpcLayer."""
    assert SimpleClusterResolver(ClusterSpec(PS_WORKER)).master("worker", 2, rpc_layer="grpc") == "grpc://worker2:2222"


def test_simple_override_master():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testSimpleOverrideMaster."""
    assert SimpleClusterResolver(ClusterSpec(PS_WORKER)).master("worker", 2) == "worker2:2222"


def test_union_cluster_resolver_get_properties():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testUnionClusterResolverGetProperties."""
    resolver1 = SimpleClusterResolver(
        ClusterSpec(PS_WORKER),
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    resolver2 = SimpleClusterResolver(
        ClusterSpec({"ps": ["ps2:2222", "ps3:2222"], "worker": ["worker3:2222", "worker4:2222", "worker5:2222"]}),
        task_type="worker",
        task_id=2,
        environment="local",
        num_accelerators={"GPU": 16},
        rpc_layer="http",
    )
    union_resolver = UnionClusterResolver(resolver1, resolver2)
    assert (union_resolver.task_type, union_resolver.task_id, union_resolver.environment) == ("ps", 1, "cloud")
    assert union_resolver.num_accelerators() == {"GPU": 8}
    assert union_resolver.rpc_layer == "grpc"

    union_resolver.task_type = "worker"
    union_resolver.task_id = 2
    union_resolver.rpc_layer = "http"
    assert (union_resolver.task_type, union_resolver.task_id, union_resolver.rpc_layer) == ("worker", 2, "http")


def test_two_non_overlapping_job_merged_cluster_resolver():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testTwoNonOverlappingJobMergedClusterResolver."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"ps": PS_WORKER["ps"]})),
        SimpleClusterResolver(ClusterSpec({"worker": PS_WORKER["worker"]})),
    )
    assert_cluster_spec(union_cluster.cluster_spec(), PS_WORKER)


def test_merged_cluster_resolver_master():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testMergedClusterResolverMaster."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"ps": PS_WORKER["ps"]})),
        SimpleClusterResolver(ClusterSpec({"worker": PS_WORKER["worker"]})),
    )
    assert union_cluster.master() == ""
    assert union_cluster.master("worker", 1) == "worker1:2222"
    assert union_cluster.master("worker", 1, rpc_layer="grpc") == "grpc://worker1:2222"


def test_overlapping_job_merged_cluster_resolver():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testOverlappingJobMergedClusterResolver."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"worker": ["worker4:2222", "worker5:2222"]})),
        SimpleClusterResolver(ClusterSpec({"worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})),
    )
    assert_cluster_spec(
        union_cluster.cluster_spec(),
        {"worker": ["worker4:2222", "worker5:2222", "worker0:2222", "worker1:2222", "worker2:2222"]},
    )


def test_overlapping_sparse_job_merged_cluster_resolver_throw_error():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testOverlappingSparseJobMergedClusterResolverThrowError."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"worker": {7: "worker4:2222", 9: "worker5:2222"}})),
        SimpleClusterResolver(ClusterSpec({"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}})),
    )
    with pytest.raises(KeyError, match=r"'worker' task index\(es\) \[7\]"):
        union_cluster.cluster_spec()


def test_overlapping_dict_and_list_throw_error():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testOverlappingDictAndListThrowError."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"worker": ["worker4:2222", "worker5:2222"]})),
        SimpleClusterResolver(ClusterSpec({"worker": {1: "worker0:2222", 2: "worker1:2222", 3: "worker2:2222"}})),
    )
    with pytest.raises(KeyError):
        union_cluster.cluster_spec()


def test_overlapping_job_non_overlapping_key():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testOverlappingJobNonOverlappingKey."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"worker": {5: "worker4:2222", 9: "worker5:2222"}})),
        SimpleClusterResolver(ClusterSpec({"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}})),
    )
    assert_cluster_spec(
        union_cluster.cluster_spec(),
        {"worker": {3: "worker0:2222", 5: "worker4:2222", 6: "worker1:2222", 7: "worker2:2222", 9: "worker5:2222"}},
    )


def test_mixed_mode_non_overlapping_key():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testMixedModeNonOverlappingKey."""
    union_cluster = UnionClusterResolver(
        SimpleClusterResolver(ClusterSpec({"worker": ["worker4:2222", "worker5:2222"]})),
        SimpleClusterResolver(ClusterSpec({"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}})),
    )
    assert_cluster_spec(
        union_cluster.cluster_spec(),
        {"worker": {0: "worker4:2222", 1: "worker5:2222", 3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}},
    )


def test_retain_sparse_job_with_no_merging():
    """TF: cluster_resolver_test.py, UnionClusterResolverTest.testRetainSparseJobWithNoMerging.

    Also: TF exports the class as ``tf.distribute.cluster_resolver.UnionResolver``; so does distrib."""
    sparse = {"worker": {1: "worker0:2222", 3: "worker1:2222", 5: "worker2:2222"}}
    union_cluster = UnionResolver(SimpleClusterResolver(ClusterSpec(sparse)))
    assert_cluster_spec(union_cluster.cluster_spec(), sparse)
    assert union_cluster.cluster_spec().task_indices("worker") == [1, 3, 5]
