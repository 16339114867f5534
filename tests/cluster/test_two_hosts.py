"""distrib across hosts (issue 11, items 5 and 6): hosts made of Linux network namespaces joined by a bridge.

Each host (`cluster.netns.Hosts`) has its own network stack, address (192.168.77.11, .12, ...),
hostname (host1, host2, ...) and /etc/hosts; the only way between them is the bridge, as between
machines on one switch. Every job runs `tests/scripts/hosts_mw.py` (MultiWorkerMirroredStrategy,
which checks its parameters against whole-batch SGD and prints a digest of them) or
`hosts_ps.py` (parameter servers), bounded in time; every namespace, bridge, veth and process is
removed at the end of each test, and the test asserts so (`netns.leftovers()`). A host that cannot
tell its interface, and the connect phase across hosts, are in tests/faults/test_hosts.py.

Before: a host whose name resolves to 127.0.1.1 (Debian's /etc/hosts) failed across hosts
(`connectFullMesh ... remote=[127.0.1.1]`) until GLOO_SOCKET_IFNAME was set; `ds.Server` could
only listen on the spec's exact address, so behind a Service name that is not the host's own
address it could not start. Needs root (namespaces); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import pytest
from cluster import netns
from helpers import SCRIPTS

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
TOKEN = "hosts-test-token-0123456789abcdef"
TIMEOUT = "30"  # CommunicationOptions(timeout_seconds=...) of every worker


@pytest.fixture
def make_hosts() -> Iterator:
    """``make_hosts(n, **options)``: a started `netns.Hosts`; all of them closed, and checked gone, at the end."""
    made: list[netns.Hosts] = []

    def make(n: int, **options: object) -> netns.Hosts:
        hosts = netns.Hosts(n, **options)  # type: ignore[arg-type]
        made.append(hosts)
        hosts.start()
        return hosts

    yield make
    for hosts in made:
        hosts.close()
    assert netns.leftovers() == [], netns.leftovers()


def fields(out: str, kind: str) -> dict[int, dict[str, str]]:
    """The ``kind`` lines (RESULT, RESOLVED) of hosts_mw.py, by rank."""
    found = {}
    for line in re.findall(rf"^{kind} (.*)$", out, re.M):
        values = dict(re.findall(r"(\w+)=(\S+)", line))
        found[int(values["rank"])] = values
    return found


def check_trained_in_sync(outs: Sequence[str], resolver: str) -> dict[int, dict[str, str]]:
    """One process per host, each its own rank, with equal parameters that match whole-batch SGD."""
    text = "\n".join(outs)
    resolved, done = fields(text, "RESOLVED"), fields(text, "RESULT")
    world = len(outs)
    assert sorted(done) == list(range(world)) and sorted(resolved) == list(range(world)), text
    assert {r["hostname"] for r in done.values()} == {f"host{i + 1}" for i in range(world)}, text
    assert len({r["digest"] for r in done.values()}) == 1, text  # the same parameters on every host
    assert all(float(r["max_diff"]) < 1e-5 for r in done.values()), text
    assert all(line.startswith(resolver) for line in re.findall(r"^RESOLVED (\S+)", text, re.M)), text
    return resolved


def run_all(
    hosts: netns.Hosts, commands: Sequence[tuple[int, list[str], dict[str, str]]], timeout: float = 120
) -> list[str]:
    """Start every ``(host, argv, env)`` at once; all must exit 0 within ``timeout``; their outputs."""
    procs = [hosts.popen(i, argv, env) for i, argv, env in commands]
    outs = []
    for proc in procs:
        code, out = hosts.wait(proc, timeout)
        assert code == 0, "\n---\n".join([out] + [hosts.output(p) for p in procs])
        outs.append(out)
    return outs


def tf_config(workers: Sequence[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


def test_multi_worker_mirrored_through_tf_config_on_two_hosts(make_hosts):
    """TF_CONFIG names the hosts, and each host's own name maps to 127.0.1.1 (Debian's default /etc/hosts),
    so gloo would advertise a loopback address: distrib picks the interface that routes to the other
    host (eth0) and the job trains as with routable names (that case, names routable everywhere, is
    `test_gloo_listens_in_the_hosts_ephemeral_range_so_a_firewall_can_pin_it`)."""
    hosts = make_hosts(2, loopback_hostname=[0, 1])
    workers = ["host1:23456", "host2:23456"]
    outs = run_all(
        hosts,
        [
            (
                i,
                [sys.executable, str(SCRIPTS / "hosts_mw.py"), "--timeout", TIMEOUT],
                {"TF_CONFIG": tf_config(workers, i)},
            )
            for i in range(2)
        ],
    )
    resolved = check_trained_in_sync(outs, "TFConfigClusterResolver")
    assert all(r["rendezvous"] == "host1:23456" for r in resolved.values()), outs
    assert all(r["ifname"] == "eth0" for r in resolved.values()), outs  # the interface of the route, not lo


def torchrun(node_rank: int, master: str, port: int = 29533) -> list[str]:
    return [
        shutil.which("torchrun") or "torchrun",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        "1",
        "--master-addr",
        master,
        "--master-port",
        str(port),
        str(SCRIPTS / "hosts_mw.py"),
        "--timeout",
        TIMEOUT,
    ]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_multi_worker_mirrored_through_torchrun_on_two_hosts(make_hosts):
    """`torchrun --nnodes 2 --node-rank k --master-addr 192.168.77.11` on each host, whose own name maps to
    127.0.1.1: torchrun gives only MASTER_ADDR, the interface is still the one that routes there."""
    hosts = make_hosts(2, loopback_hostname=[0, 1])
    outs = run_all(hosts, [(i, torchrun(i, hosts[0].address), {}) for i in range(2)])
    resolved = check_trained_in_sync(outs, "TorchrunClusterResolver")
    assert all(r["rendezvous"] == f"{hosts[0].address}:29533" for r in resolved.values()), outs
    assert all(r["ifname"] == "eth0" for r in resolved.values()), outs


# Parameter servers: each server's address in the spec is a Service-like name; on the server's own host
# that name resolves to an address that is not the host's (a Kubernetes Service's virtual IP, a NAT's
# public address), while the other hosts reach the server through it.
_SERVICES = {
    0: {"ps-svc": "192.168.77.12", "worker-svc": "192.168.77.13"},
    1: {"ps-svc": "10.77.0.11", "worker-svc": "192.168.77.13"},
    2: {"ps-svc": "192.168.77.12", "worker-svc": "10.77.0.12"},
}
_PS_CLUSTER = {"chief": ["host1:2221"], "ps": ["ps-svc:2222"], "worker": ["worker-svc:2223"]}


def ps_env(task: str, index: int = 0, **extra: str) -> dict[str, str]:
    return {
        "TF_CONFIG": json.dumps({"cluster": _PS_CLUSTER, "task": {"type": task, "index": index}}),
        "DISTRIB_CLUSTER_TOKEN": TOKEN,
        **extra,
    }


_REFUSED_PROBE = """
import grpc, sys
channel = grpc.insecure_channel(sys.argv[1])
for metadata in [(), (("x-distrib-cluster-token", "wrong-token-0123456789abcdef"),)]:
    try:
        channel.unary_unary("/distrib.ParameterServer/Health")(b"", timeout=60, metadata=metadata, wait_for_ready=True)
        print("ANSWERED", len(metadata))
    except grpc.RpcError as e:
        print("REFUSED", len(metadata), e.code().name)
"""


def test_parameter_servers_across_three_hosts_listen_on_every_interface(make_hosts):
    """Coordinator on host1, ps on host2, worker on host3, through TF_CONFIG. Listening on the spec's
    address fails on the server's host (not its address); `DISTRIB_BIND_ADDRESS=0.0.0.0` listens on every
    interface and training runs across the hosts; a call without the token, or with a wrong one, from
    another host is refused all the same."""
    hosts = make_hosts(3, extra_hosts=_SERVICES)
    script = [sys.executable, str(SCRIPTS / "hosts_ps.py")]
    # all at once (each process spends seconds importing torch): a ps on its spec address, the servers on
    # every interface, a probe without the token and the coordinator
    exact = hosts.popen(1, script, ps_env("ps"))
    servers = [
        hosts.popen(1, script, ps_env("ps", DISTRIB_BIND_ADDRESS="0.0.0.0")),
        hosts.popen(2, script, ps_env("worker", DISTRIB_BIND_ADDRESS="0.0.0.0")),
    ]
    probe = hosts.popen(0, [sys.executable, "-c", _REFUSED_PROBE, "ps-svc:2222"])
    chief = hosts.popen(0, script + ["--steps", "6"], ps_env("chief"))
    code, out = hosts.wait(exact, timeout=60)
    assert code != 0 and "cannot listen on 'ps-svc:2222'" in out and "bind_address='0.0.0.0'" in out, out
    assert "Cannot assign requested address" in out, out  # not this host's address (not: taken)
    code, probed = hosts.wait(probe, timeout=150)
    assert code == 0 and probed.split("\n").count("REFUSED 0 UNAUTHENTICATED") == 1, probed
    assert "REFUSED 1 UNAUTHENTICATED" in probed and "ANSWERED" not in probed, probed
    code, out = hosts.wait(chief, timeout=120)
    served = [hosts.stop(server) for server in servers]
    assert code == 0, out + "\n---\n".join(text for _, text in served)
    summary = dict(re.findall(r"(\w+)=(\S+)", re.search(r"^COORDINATOR (.*)$", out, re.M).group(1)))
    assert summary["steps"] == "6" and float(summary["min_loss"]) < float(summary["first_loss"]), out
    assert {w.split("/")[0] for w in summary["workers_used"].split(",")} == {"host3"}, out  # ran on the worker host
    for (code, text), (job, host) in zip(served, [("ps", "host2"), ("worker", "host3")]):
        assert code == 0, text  # a clean stop on SIGTERM
        assert re.search(
            rf"^SERVING job={job} task=0 address={job}-svc:\d+ listening=0\.0\.0\.0:\d+ hostname={host}$", text, re.M
        ), text


def listeners(hosts: netns.Hosts, index: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP listener on host ``index`` (``ss``)."""
    out = subprocess.run(
        ["ip", "netns", "exec", hosts[index].namespace, "ss", "-Hltn"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    found = set()
    for local in (line.split()[3] for line in out.splitlines() if line.strip()):
        address, _, port = local.rpartition(":")
        found.add((address.strip("[]"), int(port)))
    return found


@pytest.mark.skipif(shutil.which("ss") is None or shutil.which("sysctl") is None, reason="needs ss and sysctl")
def test_gloo_listens_in_the_hosts_ephemeral_range_so_a_firewall_can_pin_it(tmp_path, make_hosts):
    """TF_CONFIG on two hosts whose names are routable everywhere, and docs/multi-node.md's firewall advice:
    gloo's ports are not configurable in torch (pytorch/gloo#54,
    pytorch#141746); each worker's gloo listens on an ephemeral port of the interface chosen. Narrowing
    the host's `net.ipv4.ip_local_port_range` to 40000-40099 puts every such port in a range a firewall
    can open; the TF_CONFIG port is the chief's only fixed one."""
    hosts = make_hosts(2)
    for host in hosts.hosts:
        subprocess.run(
            ["ip", "netns", "exec", host.namespace, "sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=40000 40099"],
            check=True,
            timeout=30,
        )
    workers = ["host1:23456", "host2:23456"]
    marks, go = tmp_path / "joined", tmp_path / "go"
    procs = [
        hosts.popen(
            i,
            [
                sys.executable,
                str(SCRIPTS / "hosts_mw.py"),
                "--timeout",
                TIMEOUT,
                "--mark",
                str(marks),
                "--wait-for",
                str(go),
            ],
            {"TF_CONFIG": tf_config(workers, i)},
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"joined.{i}").exists() for i in range(2)):  # both joined, gloo's mesh is up
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "\n---\n".join(
            hosts.output(p) for p in procs
        )
        time.sleep(0.2)
    found = [listeners(hosts, i) for i in range(2)]
    for i in range(2):
        (tmp_path / f"go.{i}").touch()
    outs = [hosts.wait(p, 90) for p in procs]
    assert all(code == 0 for code, _ in outs), outs
    check_trained_in_sync([out for _, out in outs], "TFConfigClusterResolver")
    assert ("*", 23456) in found[0] or ("0.0.0.0", 23456) in found[0] or ("::", 23456) in found[0], found
    for i in range(2):
        gloo = {(a, p) for a, p in found[i] if p != 23456}
        assert gloo and all(a == hosts[i].address and 40000 <= p <= 40099 for a, p in gloo), found


def test_multi_worker_mirrored_with_the_variables_of_a_kubeflow_pytorchjob(make_hosts):
    """What Kubeflow's PyTorchJob sets in each pod (MASTER_ADDR: the master replica's Service name,
    MASTER_PORT, WORLD_SIZE, RANK; no LOCAL_RANK, no torchrun agent), by hand on two hosts where the
    Service name resolves to the master's address: `python script.py` joins as torchrun's would."""
    service = {"pytorchjob-master-0": "192.168.77.11"}
    hosts = make_hosts(2, extra_hosts={0: service, 1: service})
    env = {"MASTER_ADDR": "pytorchjob-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2"}
    outs = run_all(
        hosts,
        [
            (i, [sys.executable, str(SCRIPTS / "hosts_mw.py"), "--timeout", TIMEOUT], {**env, "RANK": str(i)})
            for i in range(2)
        ],
    )
    resolved = check_trained_in_sync(outs, "TorchrunClusterResolver")
    assert all(r["rendezvous"] == "pytorchjob-master-0:23456" and r["ifname"] == "eth0" for r in resolved.values()), (
        outs
    )
