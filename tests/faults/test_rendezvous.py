"""Joining a cluster is bounded by CommunicationOptions(timeout_seconds=...) in every phase (issue 10, B.3).

Before: 150 s observed with a 30 s timeout (the store client retries its connect). Each scenario
starts one worker of a 2-worker cluster whose peer never comes, with a 3 s timeout.

Traffic stays on this machine (issue 30, item 1): the chief that never comes is an address of a
network namespace's own subnet that no host has (`cluster.netns`, root; skipped with the reason
elsewhere), so the joining worker's ARP requests go unanswered on a bridge that leads nowhere; the
chief that waits for its worker is on loopback. `tests/test_network_rule.py` keeps it so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from cluster import netns

from distrib.cluster.launch import free_ports

TIMEOUT = 3
SCRIPT = f"""
import time, distrib as ds
start = time.monotonic()
try:
    ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds={TIMEOUT}))
    print("JOINED")
except ds.CollectiveError as e:
    print(f"ERROR after {{time.monotonic() - start:.1f}}s: {{e}}")
"""
NETNS = netns.unavailable()


def tf_config(workers: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def chief_in_a_namespace_with_no_host() -> tuple[str, float]:
    """Worker 1 of 2 on a namespace host (its only network: the namespace's subnet, a bridge with no other host and
    no address of this machine's); the chief's address is in that subnet, and no host has it."""
    ports = free_ports(2)
    with netns.Hosts(1) as hosts:
        nobody = f"{hosts.subnet}.99"  # hosts are .11 and up: nothing answers ARP for .99
        workers = [f"{nobody}:{ports[0]}", f"{hosts[0].address}:{ports[1]}"]
        start = time.monotonic()
        proc = hosts.popen(
            0, [sys.executable, "-c", SCRIPT], {"TF_CONFIG": tf_config(workers, 1), "PYTHONPATH": ":".join(sys.path)}
        )
        code, out = hosts.wait(proc, timeout=60)
        elapsed = time.monotonic() - start
    assert netns.leftovers() == [], netns.leftovers()
    return out, elapsed


def chief_on_loopback_without_its_worker() -> tuple[str, float]:
    """The chief (worker 0) on loopback; worker 1 never comes."""
    ports = free_ports(2)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "TF_CONFIG": tf_config([f"127.0.0.1:{p}" for p in ports], 0),
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ":".join(sys.path),
        },
    )
    return result.stdout + result.stderr[-2000:], time.monotonic() - start


@pytest.mark.parametrize(
    "case, trial",
    [
        pytest.param(
            "the chief never comes (an address no host has, in a network namespace)",
            chief_in_a_namespace_with_no_host,
            marks=pytest.mark.skipif(NETNS is not None, reason=NETNS or ""),
        ),
        ("the chief waits for a worker that never comes", chief_on_loopback_without_its_worker),
    ],
)
def test_joining_without_the_peer_fails_within_the_timeout(case, trial):
    out, elapsed = trial()
    found = re.search(r"ERROR after ([\d.]+)s: worker \d could not join the 2-worker cluster", out)
    assert found, out[-4000:]
    print(
        f"FAULT rendezvous, {case}: timeout {TIMEOUT} s, error after {found.group(1)} s ({elapsed:.1f} s with start-up)"
    )
    # the timeout, plus the 2 s left for torch's own, finer error, plus room for a loaded 2-core machine (6.1 s was
    # seen at load 7); a wrong bound (the 30 s default, or none) would still fail
    assert float(found.group(1)) < 3 * TIMEOUT
