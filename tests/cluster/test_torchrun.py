"""torchrun and what users bring from it (issue 11, items 1 and 3), with real processes:

- torchrun elastic (``--nnodes=1:2``, ``--rdzv-backend=c10d``): two agents on this host, the second
  joining after the first's job has started; the job grows from 1 to 2 workers and ends as an
  uninterrupted run;
- ``distrib launch`` exports torchrun's variables: a DDP-style script (plain ``init_process_group``,
  ``DistributedDataParallel``, no distrib import) runs under it unchanged;
- a process group the script initialised itself (``mp.spawn`` tutorials) is the cluster: replicas stay
  equal and equal a one-process run on the global batch; a resolver or environment that disagrees with
  the group is a clear error.
"""

from __future__ import annotations

import json
import re
import sys
import uuid

import pytest
import torch
from helpers import SCRIPTS
from scripts.torchrun_processes import Job, alive, clean_env, run_job

from distrib.cluster.launch import free_ports

TOLERANCE = 1e-6


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_torchrun_elastic_grows_from_one_to_two_workers_and_ends_as_an_uninterrupted_run(tmp_path):
    """Agent A starts alone (``--nnodes=1:2``: one node is enough) and trains on 1 worker; the script holds
    before step 5 while it runs on one worker. Agent B then joins the same c10d rendezvous: A restarts its
    worker, both rendezvous as a 2-worker job, which resumes at step 5 from the checkpoint and finishes.
    Asserted: both agents exit 0, steps ran on 1 then on 2 workers, the two ranks' parameters are equal,
    and they equal an uninterrupted one-process run's (float rounding); no process is left.

    The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. With torch's default (the agent's store
    shared with the workers) growth fails in torch's agents, before any worker starts: the rank-0 agent
    keeps its store information from round 0 and never publishes MASTER_ADDR for round 1, so the joining
    agent times out reading it (``DistStoreError: wait timeout ... /torch.rendezvous.<id>.1/MASTER_ADDR``)
    and the first one waiting for its role info (torch 2.13; see pytorch issue 147064)."""
    code, out, _ = run_job(
        [sys.executable, str(SCRIPTS / "resize_train.py"), "--out", str(tmp_path / "ref"), "--epochs", "1"],
        tmp_path / "ref.log",
        timeout=120,
        env=clean_env(),
    )
    assert code == 0, out
    port = free_ports(1)[0]
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={uuid.uuid4().hex}",
        "--rdzv-conf=last_call_timeout=1",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        str(SCRIPTS / "resize_train.py"),
        "--out",
        str(tmp_path / "out"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--epochs",
        "1",
        "--hold-at",
        "5",
        "--all-ranks",
        "--timeout",
        "30",
    ]
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    first = Job(agent, tmp_path / "a.log", env=env)
    second = None
    try:
        assert first.wait_for("holding before step 5 on 1 worker", timeout=120), first.output()
        second = Job(agent, tmp_path / "b.log", env=env)
        codes = (first.wait(150), second.wait(150))
        both = first.output() + second.output()
        assert codes == (0, 0), both
    finally:
        left = {**first.kill(), **(second.kill() if second else {})}
    assert not left, f"processes still running after both agents exited: {sorted(left)}"
    assert "step 4 on 1 workers" in both and "resumed at step 5 on 2 workers" in both, both
    assert "step 7 on 2 workers" in both and "done: worker 1 of 2" in both, both
    ranks = [torch.load(tmp_path / f"out.{r}") for r in (0, 1)]
    difference = max_difference(ranks[0], torch.load(tmp_path / "ref"))
    print(
        f"torchrun elastic 1 -> 2 workers: ranks differ by {max_difference(*ranks):.3g}, "
        f"the uninterrupted run by {difference:.3g}"
    )
    assert max_difference(*ranks) == 0.0
    assert difference <= TOLERANCE


def test_a_ddp_script_runs_unchanged_under_distrib_launch(tmp_path):
    """``distrib launch --workers 2`` exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (the first task's TF_CONFIG address); the DDP script trains on 2 processes and ends with one
    process's parameters on the global batch."""
    code, out, left = run_job(
        [
            sys.executable,
            "-m",
            "distrib.app.cli",
            "launch",
            "--workers",
            "2",
            str(SCRIPTS / "torchrun_ddp.py"),
            "--out",
            str(tmp_path / "two"),
        ],
        tmp_path / "launch.log",
        timeout=120,
        env=clean_env(),
    )
    assert code == 0 and not left, out
    cluster = json.loads(re.search(r"\[launch\] starting 2 task\(s\): (.*)", out).group(1))
    host, port = cluster["worker"][0].rsplit(":", 1)
    for rank in (0, 1):
        assert (
            f"[worker {rank}] variables RANK={rank} WORLD_SIZE=2 LOCAL_RANK={rank} LOCAL_WORLD_SIZE=2 "
            f"MASTER_ADDR={host} MASTER_PORT={port}"
        ) in out, out
    two = [torch.load(tmp_path / f"two.{r}") for r in (0, 1)]
    assert max_difference(*two) == 0.0
    assert max_difference(two[0], ddp_reference()) <= TOLERANCE


def ddp_reference(steps: int = 5, global_batch: int = 8) -> list[torch.Tensor]:
    """torchrun_ddp.py's training in plain torch, in this process: one model, the whole global batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [t.detach() for t in model.parameters()]


def test_launch_exports_no_torchrun_variables_to_a_parameter_server_cluster():
    from distrib.cluster.launch import make_cluster, torchrun_variables

    cluster = make_cluster(2, 1, False)
    assert torchrun_variables(cluster, "ps", 0) == {}
    assert torchrun_variables(cluster, "chief", 0)["RANK"] == "0"
    assert torchrun_variables(cluster, "worker", 1)["RANK"] == "2"


def one_process_reference(steps: int = 6, global_batch: int = 8) -> list[torch.Tensor]:
    """torchrun_spawn_group.py's training in plain torch, in this process: one model, the whole global batch."""
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 2, generator=g)) for _ in range(steps)
    ]
    torch.manual_seed(10)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        (torch.nn.functional.mse_loss(model(x), y, reduction="none").mean(dim=1).sum() / global_batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [t.detach() for t in model.parameters()]


def test_an_initialised_process_group_is_the_cluster_and_replicas_stay_equal(tmp_path):
    """Two ``mp.spawn`` processes each call ``dist.init_process_group("gloo", ...)`` themselves, then build
    ``ds.MultiWorkerMirroredStrategy()``: it is worker r of 2 (not one worker per process, which would let the
    replicas drift apart), and both end with one process's parameters on the global batch. Then, on each
    rank, a resolver or an environment that disagrees with the group is a clear error."""
    code, out, left = run_job(
        [
            sys.executable,
            str(SCRIPTS / "torchrun_spawn_group.py"),
            "--procs",
            "2",
            "--port",
            str(free_ports(1)[0]),
            "--out",
            str(tmp_path / "p2"),
        ],
        tmp_path / "spawn.log",
        timeout=120,
        env=clean_env(),
    )
    assert code == 0 and not left, out
    assert "rank 0: worker 0 of 2, 2 replicas in sync" in out and "rank 1: worker 1 of 2" in out, out
    two = [torch.load(tmp_path / f"p2.{r}") for r in (0, 1)]
    one = one_process_reference()
    difference = max_difference(two[0], one)
    print(f"initialised group, 2 processes vs 1 on the global batch: max difference {difference:.3g}")
    assert max_difference(*two) == 0.0
    assert difference <= TOLERANCE
    assert "was accepted" not in out, out
    fix = ": the strategy's cluster must be the initialised group. Initialise the group with that rank"
    for rank in (0, 1):  # one check, one message, naming where the disagreeing cluster came from
        assert (
            f"refused: torch.distributed is already initialised as rank {rank} of 2, but the cluster_resolver "
            f"says rank {rank} of 3{fix}"
        ) in out, out
        assert (
            f"refused: torch.distributed is already initialised as rank {rank} of 2, but the environment "
            f"(TorchrunClusterResolver) says rank {1 - rank} of 2{fix}"
        ) in out, out


@pytest.mark.parametrize("address,spans", [("localhost", False), ("127.0.0.1", False), ("::1", False), ("node0", True)])
def test_two_agents_on_one_host_are_not_taken_for_two_hosts(address, spans):
    """``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE`` but a loopback ``MASTER_ADDR`` (two agents on one host, as in the
    elastic test): one host, so gloo stays on loopback instead of refusing a 'cluster across hosts'."""
    import distrib as ds

    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": address,
        "MASTER_PORT": "29500",
    }
    assert ds.cluster_resolver.TorchrunClusterResolver(env).spans_hosts is spans


def test_job_tracking_finds_and_ends_every_process(tmp_path):
    """The bookkeeping the torchrun tests rely on: a grandchild in a session of its own is found and killed."""
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    job = Job([sys.executable, "-c", code], tmp_path / "log")
    assert job.wait_for("started", 30)
    job.track()
    assert len(alive(job.tracked)) == 2
    left = job.kill()
    assert len(left) == 2 and not alive(job.tracked)


def test_a_bare_ipv6_master_addr_is_bracketed():
    import distrib as ds

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "fd00::1", "MASTER_PORT": "29500"}
    resolver = ds.cluster_resolver.TorchrunClusterResolver(env)
    assert resolver.rendezvous_address() == "[fd00::1]:29500"
    assert resolver.cluster_spec().task_address("worker", 1) == "[fd00::1]:29501"
