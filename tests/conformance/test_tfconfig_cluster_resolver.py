"""TF's ``tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver_test.py``, ported.

Every test of ``TFConfigClusterResolverTest``. TF_CONFIG is set in ``os.environ`` as TF's tests
do (through monkeypatch, so it is restored). TF compares protos (``as_cluster_def``); distrib has
no protos, so ``assert_cluster_spec`` checks the same four round trips on ``as_dict()`` and ``==``.
"""

from __future__ import annotations

import pytest
import torch

from distrib.cluster import ClusterSpec, TFConfigClusterResolver, TFConfigError

PS_WORKER = """
    {
      "cluster": {
        "ps": ["ps0:2222", "ps1:2222"],
        "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]
      },
      %s
      "task": {
        "type": "ps",
        "index": %s
      }
    }
"""


def assert_cluster_spec(spec: ClusterSpec, expected: dict) -> None:
    """TF's ``_verifyClusterSpecEquality``: the spec, and the spec rebuilt from itself and from its dict."""
    assert spec.as_dict() == expected
    assert ClusterSpec(spec).as_dict() == expected
    assert ClusterSpec(spec.as_dict()).as_dict() == expected
    assert ClusterSpec(spec) == spec == ClusterSpec(expected)


@pytest.fixture
def tf_config(monkeypatch):
    def set_config(text: str) -> None:
        monkeypatch.setenv("TF_CONFIG", text)

    return set_config


def test_normal_cluster_spec_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testNormalClusterSpecRead."""
    tf_config(PS_WORKER % ("", 0))
    assert_cluster_spec(
        TFConfigClusterResolver().cluster_spec(),
        {"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]},
    )


def test_automatic_master_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testAutomaticMasterRead."""
    tf_config(PS_WORKER % ("", 0))
    assert TFConfigClusterResolver().master() == "ps0:2222"


def test_specified_task_type_and_index_master_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testSpecifiedTaskTypeAndIndexMasterRead."""
    tf_config(PS_WORKER % ("", 0))
    assert TFConfigClusterResolver().master("worker", 1) == "worker1:2222"


def test_session_master_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testSessionMasterRead."""
    tf_config(PS_WORKER % ('"session_master": "sessionmaster:2222",', 0))
    assert TFConfigClusterResolver().master() == "sessionmaster:2222"


def test_rpc_layer_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testRpcLayerRead.

    distrib's own addition: the rendezvous address of the workers never carries the prefix."""
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', 0))
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "grpc://ps0:2222"
    assert resolver.rendezvous_address() == "worker0:2222"


def test_task_type_index_rpc_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testTaskTypeIndexRpcRead."""
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', 0))
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")


def test_parameter_overrides(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testParameterOverrides."""
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', 1))
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)

    resolver.task_type = "worker"
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.master() == "test://worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "test")


def test_task_type_cast_to_string(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testTaskTypeCastToString.

    Documented difference: TF accepts any job name in TF_CONFIG (its strategies refuse them later,
    in ``multi_worker_util``); distrib refuses a job that is not chief/worker/ps/evaluator when
    TF_CONFIG is read, naming the field, so a typo never reaches a rendezvous. The cast itself
    (a number as ``task.type`` read as a string) happens, and names the cast value."""
    tf_config("""{"cluster": {"123456": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222"]},
                  "rpc_layer": "grpc", "task": {"type": 123456, "index": 0}}""")
    with pytest.raises(TFConfigError, match=r"'cluster\.123456': unknown task type '123456'"):
        TFConfigClusterResolver()
    tf_config("""{"cluster": {"worker": ["worker0:2222"]}, "task": {"type": 123456, "index": 0}}""")
    with pytest.raises(TFConfigError, match=r"'task\.type': unknown task type '123456'"):
        TFConfigClusterResolver()


def test_task_index_cast_to_integer(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testTaskIndexCastToInteger."""
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', '"1"'))
    assert TFConfigClusterResolver().task_id == 1


def test_task_index_override(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testTaskIndexOverride."""
    tf_config("""{"cluster": {"worker": ["worker0:2222", "worker1:2222"]}, "task": {"type": "worker", "index": "0"}}""")
    assert TFConfigClusterResolver(task_id=1).task_id == 1


def test_zero_items_in_cluster_spec_master_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testZeroItemsInClusterSpecMasterRead."""
    tf_config("\n    {}\n    ")
    assert TFConfigClusterResolver().master() == ""


def test_one_item_in_cluster_spec_master_read(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testOneItemInClusterSpecMasterRead."""
    tf_config("""{"cluster": {"worker": ["worker0:2222"]}}""")
    assert TFConfigClusterResolver().master() == ""


def test_num_accelerators_filter_tasks_by_env_var(tf_config):
    """TF: tfconfig_cluster_resolver_test.py, TFConfigClusterResolverTest.testNumAcceleratorsFilterTasksByEnvVar.

    Documented differences: (1) the jobs ``worker1``/``worker2`` are refused (see
    test_task_type_cast_to_string); (2) TF lists the devices of the named task through a session
    (mocked in TF's test); distrib counts this machine's CUDA devices, whatever task is named."""
    tf_config("""{"cluster": {"worker1": ["w10:2222"], "worker2": ["w21:2222", "w22:2222"]},
                  "rpc_layer": "grpc", "task": {"type": "worker1", "index": "0"}}""")
    with pytest.raises(TFConfigError, match=r"'cluster\.worker1': unknown task type 'worker1'; did you mean 'worker'"):
        TFConfigClusterResolver()
    tf_config("""{"cluster": {"chief": ["w10:2222"], "worker": ["w21:2222", "w22:2222", "w23:2222", "w24:2222"]},
                  "rpc_layer": "grpc", "task": {"type": "chief", "index": "0"}}""")
    resolver = TFConfigClusterResolver()
    local = {"GPU": torch.cuda.device_count()} if torch.cuda.is_available() and torch.cuda.device_count() else {}
    assert resolver.num_accelerators() == local
    assert resolver.num_accelerators(task_type="worker", task_id=3) == local
