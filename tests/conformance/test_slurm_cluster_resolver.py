"""TF's ``tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver_test.py``, ported.

Every test of ``SlurmClusterResolverTest``. TF patches ``os.environ`` with ``mock.patch.dict``;
here ``slurm_env`` sets the same variables through monkeypatch (and clears every other
``SLURM_*`` variable), so the resolver reads the real ``os.environ`` and writes
``CUDA_VISIBLE_DEVICES`` there, as TF's does. TF compares protos; distrib compares
``as_dict()`` and ``==`` on the same four round trips.
"""

from __future__ import annotations

import os

import pytest

from distrib.cluster import ClusterSpec, SlurmClusterResolver
from distrib.cluster.slurm import expand_hostlist, expand_tasks_per_node


def assert_cluster_spec(spec: ClusterSpec, expected: dict) -> None:
    """TF's ``_verifyClusterSpecEquality``: the spec, and the spec rebuilt from itself and from its dict."""
    assert spec.as_dict() == expected
    assert ClusterSpec(spec).as_dict() == expected
    assert ClusterSpec(spec.as_dict()).as_dict() == expected
    assert ClusterSpec(spec) == spec == ClusterSpec(expected)


@pytest.fixture
def slurm_env(monkeypatch):
    def set_env(variables: dict) -> None:
        for name in list(os.environ):
            if name.startswith(("SLURM_", "SLURMD_")):
                monkeypatch.delenv(name)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after the test
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_expand_hostlist():
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.test_expand_hostlist."""
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("n[1,3]") == ["n1", "n3"]
    assert expand_hostlist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]
    assert expand_hostlist("n[0001-0003],m5,o[009-011]") == ["n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]


def test_expand_tasks_per_node():
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.test_expand_tasks_per_node."""
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    assert expand_tasks_per_node("13(x10)") == [13] * 10


def test_simple_retrieval_from_env(slurm_env):
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.testSimpleRetrievalFromEnv."""
    slurm_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
            "CUDA_VISIBLE_DEVICES": "0",
        }
    )
    resolver = SlurmClusterResolver()
    assert_cluster_spec(resolver.cluster_spec(), {"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]})
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert resolver.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_simple_successful_retrieval(slurm_env):
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.testSimpleSuccessfulRetrieval."""
    slurm_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43"})
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    assert_cluster_spec(resolver.cluster_spec(), {"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]})


def test_simple_master_retrieval(slurm_env):
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.testSimpleMasterRetrieval."""
    slurm_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43"})
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    resolver.task_type = "worker"
    resolver.task_id = 1
    assert resolver.master() == "grpc://t02n43:8888"

    resolver.rpc_layer = "ab"
    assert resolver.master("ps", 0) == "ab://t02n13:8888"
    assert resolver.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


def test_task_per_node_not_set_retrieval(slurm_env):
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.testTaskPerNodeNotSetRetrieval."""
    slurm_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
        }
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2}, port_base=8888, gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False
    )
    assert_cluster_spec(resolver.cluster_spec(), {"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]})


def test_multi_task_per_node_retrieval(slurm_env):
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.testMultiTaskPerNodeRetrieval."""
    slurm_env(
        {
            "SLURM_PROCID": "1",
            "SLURM_STEP_NUM_TASKS": "5",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=2, gpus_per_task=1, auto_set_gpu=True
    )
    assert_cluster_spec(
        resolver.cluster_spec(),
        {"ps": ["t02n13:8888"], "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"]},
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_multiple_gpus_per_task_retrieval(slurm_env):
    """TF: slurm_cluster_resolver_test.py, SlurmClusterResolverTest.testMultipleGpusPerTaskRetrieval."""
    slurm_env(
        {
            "SLURM_PROCID": "1",
            "SLURM_STEP_NUM_TASKS": "5",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=4, gpus_per_task=2, auto_set_gpu=True
    )
    assert_cluster_spec(
        resolver.cluster_spec(),
        {"ps": ["t02n13:8888"], "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"]},
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
