"""The cluster layer: TF_CONFIG / torchrun / Slurm resolvers, and `distrib launch` as a process manager."""

from __future__ import annotations

import json

import pytest

import distrib as ds
from distrib.cluster import TFConfigClusterResolver, TFConfigError
from helpers import launch


def test_launch_returns_the_first_failures_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import json, os, sys, time\n"
                      "t = json.loads(os.environ['TF_CONFIG'])['task']\n"
                      "sys.exit(7) if t['index'] == 1 else time.sleep(60)\n")
    code, out, elapsed = launch("--workers", "2", str(script), timeout=60)
    assert code == 7 and "worker 1 failed with exit code 7" in out
    assert elapsed < 30  # the sleeping worker was stopped, not waited for


@pytest.mark.parametrize("config, field", [
    ("{not json", "not valid JSON"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "boss", "index": 0}}', "task.type"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}', "task.index"),
    ('{"cluster": {"worker": ["localhost:1", "localhost:1"]}, "task": {"type": "worker", "index": 0}}',
     r"cluster.worker\[1\]"),
    ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}', r"cluster.worker\[0\]"),
    ('{"cluster": {"wrkr": ["localhost:1"]}, "task": {"type": "worker", "index": 0}}', "cluster.wrkr"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "ps", "index": 0}}', "task.type"),
])
def test_malformed_tf_config_names_the_field_at_fault(config, field):
    with pytest.raises(TFConfigError, match=field):
        TFConfigClusterResolver(environ={"TF_CONFIG": config})


def test_tf_config_chief_and_ranks():
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]}
    r = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})})
    assert (r.task_type, r.task_id, r.is_chief, r.master()) == ("worker", 1, False, "localhost:1")
    from distrib.strategies.multi_worker import worker_rank

    assert worker_rank(r) == (2, 3)
    torchrun = ds.cluster_resolver.resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (torchrun.task_type, torchrun.task_id, torchrun.master()) == ("worker", 1, "h:9")
    slurm = ds.cluster_resolver.SlurmClusterResolver(environ={
        "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "node[01-02]"})
    assert slurm.cluster_spec().as_dict() == {"worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]}
    assert slurm.task_id == 3 and not slurm.is_chief
