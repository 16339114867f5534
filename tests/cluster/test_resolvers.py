"""Cluster resolvers beyond TF's own tests: TF_CONFIG mistakes named by field (issue 10 C.7), Slurm
layouts TF gets wrong or does not check, the rendezvous address, and two real workers whose
TF_CONFIG has an ``rpc_layer`` (TF's ``master()`` would give gloo ``grpc://host:port``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from distrib.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TFConfigError,
    UnionClusterResolver,
    resolve,
    worker_rank,
)
from distrib.cluster.launch import free_ports

TWO = {"worker": ["localhost:2001", "localhost:2002"]}


def tf_config(cluster=None, task=None, **extra) -> str:
    config = {"cluster": TWO if cluster is None else cluster, "task": task or {"type": "worker", "index": 0}}
    return json.dumps({**config, **extra})


def resolver_for(text: str) -> TFConfigClusterResolver:
    return TFConfigClusterResolver(environ={"TF_CONFIG": text})


@pytest.mark.parametrize(
    "text, field",
    [
        (tf_config(task={"type": "worker", "idx": 1}), r"'task\.idx' is not a known key; did you mean 'index'"),
        (tf_config(task={"type": "worker", "index": 0, "rank": 1}), r"'task\.rank' is not a known key"),
        (tf_config(task={"typ": "worker", "index": 0}), r"'task\.typ' is not a known key; did you mean 'type'"),
        (tf_config(tasks={"type": "worker"}), r"field 'tasks' is not a known key; did you mean 'task'"),
        (
            tf_config(cluster={"workers": TWO["worker"]}),
            r"'cluster\.workers': unknown task type .*did you mean 'worker'",
        ),
        (tf_config(cluster={"worker": {"a": "h:1"}}), r"'cluster\.worker': the task index 'a' is not a non-negative"),
        (tf_config(cluster={"worker": {"-1": "h:1"}}), r"'cluster\.worker': the task index '-1'"),
        (tf_config(cluster={"worker": {"1.0": "h:1"}}), r"'cluster\.worker': the task index '1\.0'"),
        (
            tf_config(cluster={"worker": {"1": "h:1", "01": "h:2"}}, task={"type": "worker", "index": 1}),
            r"'cluster\.worker': the task index 1 is given twice",
        ),
        (
            '{"cluster": {"worker": {"0": "h:1", "0": "h:2"}}, "task": {"type": "worker", "index": 0}}',
            r"'cluster\.worker' has the key '0' twice",
        ),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0, "index": 1}}',
            r"'task' has the key 'index' twice",
        ),
        (
            tf_config(cluster={"worker": ["worker 0:2222", "w1:2222"]}),
            r"cluster\.worker\[0\].*invalid character\(s\) ' '",
        ),
        (tf_config(cluster={"worker": [":2222", "w1:2222"]}), r"cluster\.worker\[0\]': an empty host"),
        (tf_config(cluster={"worker": ["w0:2222", "w_1!:2222"]}), r"cluster\.worker\[1\].*invalid character\(s\) '!'"),
        (tf_config(cluster={"worker": ["wörker:2222"]}), r"cluster\.worker\[0\].*invalid character\(s\) 'ö'"),
        (tf_config(cluster={"worker": ["-w0:2222"]}), r"cluster\.worker\[0\].*not a valid host name"),
        (tf_config(cluster={"worker": ["::1:2222"]}), r"cluster\.worker\[0\].*IPv6 address needs brackets"),
        (tf_config(cluster={"worker": ["grpc://w0:2222"]}), r"cluster\.worker\[0\].*without a scheme"),
        (tf_config(cluster={"worker": ["w0:0"]}), r"cluster\.worker\[0\].*port in 1\.\.65535"),
        (tf_config(cluster={"worker": ["w0:65536"]}), r"cluster\.worker\[0\].*port in 1\.\.65535"),
        (tf_config(cluster={"worker": ["w0:²"]}), r"cluster\.worker\[0\].*port in 1\.\.65535"),
        (tf_config(cluster={"worker": ["300.1.1.1:2222"]}), r"cluster\.worker\[0\].*not an IPv4 address"),
        (tf_config(cluster={"worker": "w0:2222"}), r"'cluster\.worker' must be a list"),
        (tf_config(cluster={"chief": ["c0:1", "c1:1"], "worker": ["w:1"]}), r"'cluster\.chief' lists 2 tasks"),
        (tf_config(task={"index": 1}), r"'task\.type' is missing while 'task\.index' is given"),
        (tf_config(task={"type": "worker"}), r"'task\.index' is missing"),
        (tf_config(task={"type": "worker", "index": -1}), r"'task\.index'.*non-negative integer.*-1"),
        (tf_config(task={"type": "worker", "index": True}), r"'task\.index'.*True"),
        (tf_config(task={"type": "worker", "index": 1.5}), r"'task\.index'.*1\.5"),
        (tf_config(task={"type": "worker", "index": "1e3"}), r"'task\.index'.*'1e3'"),
        (tf_config(task={"type": "worker", "index": 2}), r"'task\.index': 2 is out of range.*0\.\.1"),
        (
            tf_config(cluster={"worker": {"0": "h:1", "3": "h:4"}}, task={"type": "worker", "index": 1}),
            r"'task\.index': 1 is out of range.*one of 0, 3",
        ),
        (tf_config(rpc_layer=1), r"'rpc_layer' must be a string"),
        ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": NaN}}', "NaN is not a JSON value"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ('{"cluster": {}, "task": {"type": "worker", "index": ' + "9" * 5000 + "}}", "not valid JSON"),
        ("null", "must be a JSON object"),
    ],
)
def test_malformed_tf_config_is_a_tf_config_error_naming_the_field(text, field):
    with pytest.raises(TFConfigError, match=field):
        resolver_for(text)


def test_tf_config_accepts_cloud_keys_sparse_jobs_and_an_evaluator_outside_the_cluster():
    r = resolver_for(
        tf_config(
            task={"type": "worker", "index": "1", "trial": "", "cloud": "x"}, environment="cloud", job={"args": []}
        )
    )
    assert (r.task_type, r.task_id) == ("worker", 1)
    r = resolver_for(tf_config(cluster={"ps": {"2": "ps2:1"}, "worker": ["w0:1"]}, task={"type": "ps", "index": "2"}))
    assert r.cluster_spec().as_dict() == {"ps": {2: "ps2:1"}, "worker": ["w0:1"]} and r.task_id == 2
    r = resolver_for(tf_config(task={"type": "evaluator", "index": 0}))
    assert (r.task_type, r.task_id, r.cluster_spec().jobs, r.is_chief) == ("evaluator", 0, ["worker"], False)
    assert not resolver_for('{"task": {"type": "evaluator", "index": 0}}').is_chief
    r = resolver_for(tf_config(cluster={"worker": ["[::1]:2001", "[fe80::1%eth0]:2002", "W-1.example.com.:3"]}))
    assert r.cluster_spec().num_tasks("worker") == 3


def test_constructor_overrides_are_checked_against_the_cluster():
    with pytest.raises(ValueError, match=r"task_type='ps'.*not in the cluster"):
        TFConfigClusterResolver(task_type="ps", task_id=0, environ={"TF_CONFIG": tf_config()})
    with pytest.raises(ValueError, match="task_id"):
        TFConfigClusterResolver(task_id="one", environ={"TF_CONFIG": tf_config()})


def test_master_is_tf_s_and_the_rendezvous_address_is_the_chief_without_prefix():
    cluster = {"chief": ["c0:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}
    r = resolver_for(tf_config(cluster=cluster, task={"type": "worker", "index": 1}, rpc_layer="grpc"))
    assert r.master() == "grpc://w1:1" and r.master("ps", 0, rpc_layer="") == "p0:1"
    assert r.rendezvous_address() == "c0:1" and worker_rank(r) == (2, 3) and not r.is_chief
    assert resolver_for(tf_config(cluster={"worker": ["w0:1"]})).master() == ""
    with pytest.raises(ValueError, match="names no task"):
        resolver_for(json.dumps({"cluster": cluster})).master()


def test_worker_rank_refuses_a_sparse_worker_job_and_non_worker_tasks():
    sparse = SimpleClusterResolver(ClusterSpec({"worker": {0: "w0:1", 2: "w2:1"}}), "worker", 2)
    with pytest.raises(ValueError, match=r"needs every worker task listed.*\[0, 2\]"):
        worker_rank(sparse)
    with pytest.raises(ValueError, match="this task is 'ps'"):
        worker_rank(SimpleClusterResolver(ClusterSpec({"worker": ["w:1"], "ps": ["p:1"]}), "ps", 0))
    assert worker_rank(TFConfigClusterResolver(environ={})) == (0, 1)


def test_cluster_spec_keeps_sparse_indices_and_refuses_unknown_jobs():
    spec = ClusterSpec({"worker": {3: "w3:1", "0": "w0:1"}})
    assert spec.task_indices("worker") == [0, 3] and spec.task_address("worker", 3) == "w3:1"
    assert spec.as_dict() == {"worker": {0: "w0:1", 3: "w3:1"}}
    with pytest.raises(ValueError, match=r"No such job in cluster: 'unknown' \(jobs: 'worker'\)"):
        spec.num_tasks("unknown")
    with pytest.raises(ValueError, match="task index 0 is given twice"):
        ClusterSpec({"worker": {0: "a:1", "00": "b:1"}})
    with pytest.raises(TypeError, match="must be a list"):
        ClusterSpec({"worker": "w0:1"})


def test_simple_resolver_catches_tf_s_positional_master():
    with pytest.raises(ValueError, match="pass TF's master by keyword"):
        SimpleClusterResolver(ClusterSpec(TWO), "grpc://localhost:2001")
    r = SimpleClusterResolver(ClusterSpec(TWO), master="grpc://localhost:2001", task_type="worker", task_id=0)
    assert r.master() == "grpc://localhost:2001"


def test_union_resolver_keeps_a_task_id_override_of_zero():
    first = SimpleClusterResolver(ClusterSpec(TWO), task_type="worker", task_id=1)
    assert UnionClusterResolver(first, task_id=0).task_id == 0  # TF's `or` would give 1
    with pytest.raises(TypeError):
        UnionClusterResolver(first, "not a resolver")
    with pytest.raises(ValueError, match="unexpected keyword"):
        UnionClusterResolver(first, environment="x")


def slurm(**env: str) -> dict:
    return {"SLURM_JOB_ID": "7", **env}


def test_slurm_keeps_node_order_where_tf_sorts_names():
    env = slurm(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="n[9-10]",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURMD_NODENAME="n10",
        SLURM_LOCALID="0",
    )
    r = SlurmClusterResolver(environ=env, port_base=5000)
    assert r.cluster_spec().as_dict() == {"worker": ["n9:5000", "n10:5000"]} and r.task_id == 1
    assert r.rendezvous_address() == "n9:5000"


def test_slurm_refuses_a_layout_that_is_not_where_slurm_put_the_task():
    env = slurm(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="4",
        SLURM_STEP_NODELIST="a,b",
        SLURM_STEP_TASKS_PER_NODE="2(x2)",
        SLURMD_NODENAME="b",
        SLURM_LOCALID="0",
    )  # cyclic distribution
    with pytest.raises(RuntimeError, match=r"SLURM_PROCID=1 runs on node 'b', not 'a' and local task 0, not 1"):
        SlurmClusterResolver(environ=env)


def test_slurm_without_srun_is_detected_and_explained():
    env = slurm(SLURM_NTASKS="4", SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID="0")
    assert SlurmClusterResolver.detect(env)
    with pytest.raises(RuntimeError, match="start every task with srun"):
        resolve(env)
    assert not SlurmClusterResolver.detect(slurm(SLURM_NTASKS="1"))


def test_slurm_job_variables_are_the_fallback_and_steps_get_their_own_ports():
    env = slurm(
        SLURM_PROCID="0",
        SLURM_STEP_NODELIST="n1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_STEP_ID="3",
        CUDA_VISIBLE_DEVICES="",
    )
    r = SlurmClusterResolver(environ=env)
    # job 7, step 3: 8888 + 16 x (37 x 7 + 3), a block of its own (TF: 8888 for every step)
    assert r.cluster_spec().as_dict() == {"worker": ["n1:13080", "n1:13081"]}
    other_step = SlurmClusterResolver(environ={**env, "SLURM_STEP_ID": "4"}).cluster_spec().as_dict()
    assert other_step == {"worker": ["n1:13096", "n1:13097"]}
    assert r.num_accelerators() == {"GPU": 0} and env["CUDA_VISIBLE_DEVICES"] == ""


def test_slurm_gives_each_task_its_share_of_the_gpus_slurm_made_visible():
    env = slurm(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="n1",
        SLURM_STEP_TASKS_PER_NODE="2",
        CUDA_VISIBLE_DEVICES="4,5,6,7",
    )
    r = SlurmClusterResolver(environ=env)
    r.cluster_spec()
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and r.num_accelerators() == {"GPU": 2}  # TF would set "2,3"


@pytest.mark.parametrize(
    "env, message",
    [
        (
            dict(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="2"),
            "SLURM_STEP_NUM_TASKS .* is 3 but the tasks per node add up to 2",
        ),
        (
            dict(
                SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="n[1-2]", SLURM_STEP_TASKS_PER_NODE="2"
            ),
            "gives 1 node.* lists 2",
        ),
        (
            dict(
                SLURM_PROCID="0",
                SLURM_STEP_NUM_TASKS="2",
                SLURM_STEP_NODELIST="n[2-1]",
                SLURM_STEP_TASKS_PER_NODE="1(x2)",
            ),
            "bad range '2-1'",
        ),
        (dict(SLURM_PROCID="x", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NODELIST="n1"), "SLURM_PROCID='x'"),
        (
            dict(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NODELIST="n1"),
            "SLURM_STEP_TASKS_PER_NODE is not set",
        ),
        (
            dict(
                SLURM_PROCID="0",
                SLURM_STEP_NUM_TASKS="1",
                SLURM_STEP_NODELIST="bad host",
                SLURM_STEP_TASKS_PER_NODE="1",
            ),
            "invalid character",
        ),
    ],
)
def test_slurm_environment_mistakes_are_clear_errors(env, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        SlurmClusterResolver(environ=slurm(**env), gpus_per_node=0)


def test_slurm_jobs_and_gpu_requests_are_checked():
    env = slurm(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="2")
    with pytest.raises(RuntimeError, match=r"Requested 3 tasks"):
        SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, environ=env, gpus_per_node=0)
    with pytest.raises(ValueError, match="unknown job 'wroker'"):
        SlurmClusterResolver(jobs={"wroker": 2}, environ=env, gpus_per_node=0)
    with pytest.raises(RuntimeError, match="more GPUs per node than available"):
        SlurmClusterResolver(environ=env, gpus_per_node=2, gpus_per_task=2)


WORKER = """
import torch, distrib as ds
strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=30))
total = strategy.reduce(ds.ReduceOp.SUM, torch.tensor(float(strategy.worker_index + 1)), axis=None)
print("RESULT", strategy.worker_index, strategy.num_workers, float(total), flush=True)
"""


def test_two_real_workers_meet_at_the_rendezvous_address_when_tf_config_has_an_rpc_layer():
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    try:
        for i in range(2):
            env = {**os.environ, "TF_CONFIG": tf_config(cluster, {"type": "worker", "index": i}, rpc_layer="grpc")}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        assert f"RESULT {i} 2 3.0" in out, out


# ------------------------------------------------------------------ the registry resolve() walks (issue 19, item 6)
def test_resolve_asks_the_registered_resolvers_in_order():
    from distrib.cluster import TorchrunClusterResolver, registered_resolvers

    assert registered_resolvers() == (TFConfigClusterResolver, TorchrunClusterResolver, SlurmClusterResolver)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    both = {**torchrun, "TF_CONFIG": tf_config()}  # distrib launch exports both: TF_CONFIG is asked first
    assert type(resolve(torchrun)) is TorchrunClusterResolver and type(resolve(both)) is TFConfigClusterResolver
    assert resolve({}) is None


def test_the_base_declares_detect_and_a_resolver_of_ones_own_is_found_once_registered(monkeypatch):
    import distrib.cluster.resolver as resolver_module
    from distrib.cluster import ClusterResolver, register_resolver, registered_resolvers

    monkeypatch.setattr(resolver_module, "_REGISTERED", list(registered_resolvers()))  # undone after the test
    assert not ClusterResolver.detect({"TF_CONFIG": tf_config()})  # the base reads no environment
    assert not SimpleClusterResolver.detect({"TF_CONFIG": tf_config()})
    assert SimpleClusterResolver(ClusterSpec(TWO), "worker", 0).spans_hosts is None  # cannot tell

    class Scheduler(ClusterResolver):
        @classmethod
        def detect(cls, environ=None):
            return "MY_SCHEDULER_RANK" in (environ or {})

        @classmethod
        def from_environment(cls, environ=None):
            resolver = cls()
            resolver.task_type, resolver.task_id = "worker", (environ or {})["MY_SCHEDULER_RANK"]
            return resolver

        def cluster_spec(self):
            return ClusterSpec(TWO)

    env = {"MY_SCHEDULER_RANK": "1", "TF_CONFIG": tf_config()}
    assert type(resolve(env)) is TFConfigClusterResolver  # not registered: not asked
    register_resolver(Scheduler)
    assert type(resolve(env)) is TFConfigClusterResolver  # asked after TF_CONFIG's
    register_resolver(Scheduler, first=True)
    found = resolve(env)
    assert type(found) is Scheduler and worker_rank(found) == (1, 2)
    assert registered_resolvers()[0] is Scheduler and registered_resolvers().count(Scheduler) == 1

    class NoDetect(ClusterResolver):
        def cluster_spec(self):
            return ClusterSpec(TWO)

    with pytest.raises(TypeError, match="NoDetect does not declare detect"):
        register_resolver(NoDetect)
    with pytest.raises(NotImplementedError, match="NoDetect reads no environment"):
        NoDetect.from_environment({})
