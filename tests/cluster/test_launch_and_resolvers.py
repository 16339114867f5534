"""The cluster layer: TF_CONFIG / torchrun / Slurm resolvers, and `distrib launch` as a process manager."""

from __future__ import annotations

import json

import pytest

import distrib as ds
from distrib.cluster import TFConfigClusterResolver, TFConfigError


@pytest.mark.parametrize(
    "config, field",
    [
        ("{not json", "not valid JSON"),
        ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "boss", "index": 0}}', "task.type"),
        ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}', "task.index"),
        (
            '{"cluster": {"worker": ["localhost:1", "localhost:1"]}, "task": {"type": "worker", "index": 0}}',
            r"cluster.worker\[1\]",
        ),
        ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}', r"cluster.worker\[0\]"),
        ('{"cluster": {"wrkr": ["localhost:1"]}, "task": {"type": "worker", "index": 0}}', "cluster.wrkr"),
        ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "ps", "index": 0}}', "task.type"),
    ],
)
def test_malformed_tf_config_names_the_field_at_fault(config, field):
    with pytest.raises(TFConfigError, match=field):
        TFConfigClusterResolver(environ={"TF_CONFIG": config})


def test_tf_config_chief_and_ranks():
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]}
    r = TFConfigClusterResolver(
        environ={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})}
    )
    assert (r.task_type, r.task_id, r.is_chief, r.rendezvous_address()) == ("worker", 1, False, "localhost:1")
    assert r.master() == "localhost:3"  # TF: this task's address (no rpc_layer in this TF_CONFIG)
    from distrib.strategies.multi_worker import worker_rank

    assert worker_rank(r) == (2, 3)
    torchrun = ds.cluster_resolver.resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (torchrun.task_type, torchrun.task_id, torchrun.rendezvous_address()) == ("worker", 1, "h:9")
    slurm = ds.cluster_resolver.SlurmClusterResolver(
        environ={
            "SLURM_PROCID": "3",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NODELIST": "node[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        }
    )
    assert slurm.cluster_spec().as_dict() == {"worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]}
    assert slurm.task_id == 3 and not slurm.is_chief
