"""distrib under a real Slurm (issue 11, items 4 and 6): Debian's slurm-wlm, one node on this host, then two.

One cluster (munged, slurmctld, slurmd: `slurm_cluster.SlurmCluster`) serves the one-node tests; it
needs root and the Slurm binaries, and the module is skipped with the reason otherwise. The
two-node tests run a second cluster whose nodes are two hosts made of network namespaces
(`cluster.netns`), each with its own name and address, whose own names resolve to 127.0.1.1 as on
Debian. Every job runs
`tests/scripts/hosts_mw.py` or `hosts_ps.py`, bounded in time; the cluster's `stop()` cancels
every job and kills every process it started, also after a failure.

Before: the fixed port 8888 made two job steps on one node collide (`EADDRINUSE`, or a rank
joined the other step's rendezvous), parameter servers could not run on Slurm, and a job started
without srun waited for its whole timeout.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import pytest
from cluster import netns
from cluster.slurm_cluster import SlurmCluster, wait
from helpers import SCRIPTS

REASON = SlurmCluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
TOKEN = "slurm-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster() as cluster:
        yield cluster


def results(out: str) -> dict[tuple[str, int], dict[str, str]]:
    """``RESULT``/``RESOLVED`` lines of hosts_mw.py by (kind, rank)."""
    found = {}
    for kind, fields in re.findall(r"^(RESULT|RESOLVED) (.*)$", out, re.M):
        values = dict(re.findall(r"(\w+)=(\S+)", fields))
        found[(kind, int(values["rank"]))] = values
    return found


def check_synchronous_job(out: str, world: int) -> str:
    """Every rank resolved Slurm's cluster and ends with the same parameters as whole-batch SGD; the port."""
    found = results(out)
    resolved = [found[("RESOLVED", r)] for r in range(world)]
    done = [found[("RESULT", r)] for r in range(world)]
    assert all(r["world"] == str(world) for r in resolved + done), out
    assert {r["rendezvous"] for r in resolved} == {resolved[0]["rendezvous"]}, out
    assert len({r["digest"] for r in done}) == 1 and all(float(r["max_diff"]) < 1e-5 for r in done), out
    assert all(line.startswith("SlurmClusterResolver") for line in re.findall(r"^RESOLVED (\S+)", out, re.M)), out
    return resolved[0]["rendezvous"]


def test_two_concurrent_srun_jobs_on_one_node_each_train_in_sync(slurm):
    """`srun -n2` twice at once: two jobs, both step 0, on the one node; each gets its own port."""
    marks = Path(tempfile.mkdtemp(dir=slurm.dir))
    jobs = [
        slurm.popen(
            [
                "srun",
                "-n2",
                sys.executable,
                str(SCRIPTS / "hosts_mw.py"),
                "--mark",
                str(marks / mine),
                "--wait-for",
                str(marks / other),
            ]
        )
        for mine, other in (("a", "b"), ("b", "a"))
    ]
    outs = [wait(job, timeout=120) for job in jobs]
    for code, out in outs:
        assert code == 0, out + slurm.logs()
    ports = [check_synchronous_job(out, 2) for _, out in outs]
    assert ports[0] != ports[1], ports  # same node, same step id 0: the job ids set the ports apart


def test_sbatch_with_two_concurrent_steps_on_one_node(slurm):
    """`sbatch -n4` whose script starts two `srun -n2` steps at once (steps 0 and 1: 8888 for both, before)."""
    marks = tempfile.mkdtemp(dir=slurm.dir)
    script = f"""#!/bin/bash
srun -n2 --exact {sys.executable} {SCRIPTS / "hosts_mw.py"} --mark {marks}/a --wait-for {marks}/b > {marks}/step0.out 2>&1 &
srun -n2 --exact {sys.executable} {SCRIPTS / "hosts_mw.py"} --mark {marks}/b --wait-for {marks}/a > {marks}/step1.out 2>&1 &
wait %1 && wait %2
"""
    code, out = slurm.sbatch(script, timeout=150, args=["-n4"])
    steps = [(Path(marks) / f"step{i}.out").read_text() for i in range(2)]
    assert code == 0, out + "\n".join(steps) + slurm.logs()
    ports = [check_synchronous_job(text, 2) for text in steps]
    assert ports[0] != ports[1], ports


def test_parameter_servers_run_on_slurm_with_jobs(slurm):
    """`srun -n4` with `SlurmClusterResolver(jobs={"chief": 1, "ps": 1, "worker": 2})`: rank 0 coordinates."""
    code, out = slurm.run(
        [
            "srun",
            "-n4",
            sys.executable,
            str(SCRIPTS / "hosts_ps.py"),
            "--slurm-jobs",
            "chief=1,ps=1,worker=2",
            "--steps",
            "6",
        ],
        timeout=150,
        extra_env={"DISTRIB_CLUSTER_TOKEN": TOKEN},
    )
    assert code == 0, out + slurm.logs()
    served = re.findall(r"^SERVING job=(\w+) task=(\d+) address=(\S+)", out, re.M)
    assert sorted((job, int(task)) for job, task, _ in served) == [("ps", 0), ("worker", 0), ("worker", 1)], out
    summary = dict(re.findall(r"(\w+)=(\S+)", re.search(r"^COORDINATOR (.*)$", out, re.M).group(1)))
    assert summary["steps"] == "6" and float(summary["min_loss"]) < float(summary["first_loss"]), out
    ports = {int(address.rsplit(":", 1)[1]) for _, _, address in served}
    assert len(ports) == 3 and min(ports) != 8888, ports  # the step's own block of ports


def test_a_job_started_without_srun_is_refused_at_once(slurm):
    """`sbatch -n2` whose script runs python directly: one process, in no step; it must say `srun`."""
    script = f"#!/bin/bash\n{sys.executable} {SCRIPTS / 'hosts_mw.py'} --timeout 300\n"
    code, out = slurm.sbatch(script, timeout=90, args=["-n2"])
    assert code != 0, out
    assert "not inside a job step" in out and "start every task with srun" in out, out
    assert "RESULT" not in out and "could not join" not in out, out  # refused before any rendezvous


NETNS = netns.unavailable()


@pytest.fixture(scope="module")
def slurm_two_nodes():
    """Nodes host1 and host2 (192.168.77.11, .12), one slurmd each; gone, namespaces included, at the end."""
    with netns.Hosts(2, loopback_hostname=[0, 1]) as hosts:
        with SlurmCluster(hosts=hosts) as cluster:
            yield cluster
    assert netns.leftovers() == [], netns.leftovers()


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_srun_across_two_nodes_trains_in_sync(slurm_two_nodes):
    """`srun -N2 -n2`: one task per node, each with its node's name (which resolves to 127.0.1.1 there)."""
    code, out = slurm_two_nodes.run(["srun", "-N2", "-n2", sys.executable, str(SCRIPTS / "hosts_mw.py")], timeout=120)
    assert code == 0, out + slurm_two_nodes.logs()
    check_synchronous_job(out, 2)
    found = results(out)
    assert {found[("RESULT", r)]["hostname"] for r in range(2)} == {"host1", "host2"}, out
    assert all(found[("RESOLVED", r)]["ifname"] == "eth0" for r in range(2)), out  # not lo, not 127.0.1.1


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_parameter_servers_across_two_slurm_nodes(slurm_two_nodes):
    """`srun -N2 --ntasks-per-node=2` with jobs={"chief": 1, "ps": 1, "worker": 2}: chief and ps on host1, the
    workers on host2. Each node's own name resolves to 127.0.1.1 there (Debian), so a server on the spec's
    address alone was unreachable from the other node (the coordinator waited for ever on 'connecting')."""
    code, out = slurm_two_nodes.run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=2",
            sys.executable,
            str(SCRIPTS / "hosts_ps.py"),
            "--slurm-jobs",
            "chief=1,ps=1,worker=2",
            "--steps",
            "6",
        ],
        timeout=150,
        extra_env={"DISTRIB_CLUSTER_TOKEN": TOKEN},
    )
    assert code == 0, out + slurm_two_nodes.logs()
    served = re.findall(r"^SERVING job=(\w+) task=(\d+) address=(\S+) listening=(\S+) hostname=(\S+)", out, re.M)
    assert sorted((job, int(task), host) for job, task, _, _, host in served) == [
        ("ps", 0, "host1"),
        ("worker", 0, "host2"),
        ("worker", 1, "host2"),
    ], out
    # each node's name is 127.0.1.1 there: every server also listens on its node's routable address
    addresses = {"host1": "192.168.77.11", "host2": "192.168.77.12"}
    for _, _, address, listening, host in served:
        port = address.rsplit(":", 1)[1]
        assert listening.split(",") == [address, f"{addresses[host]}:{port}"], out
    summary = dict(re.findall(r"(\w+)=(\S+)", re.search(r"^COORDINATOR (.*)$", out, re.M).group(1)))
    assert summary["steps"] == "6" and float(summary["min_loss"]) < float(summary["first_loss"]), out
    assert {w.split("/")[0] for w in summary["workers_used"].split(",")} <= {"host2"}, out  # the workers' node
