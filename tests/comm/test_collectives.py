"""ProcessGroupCommunicator between 2 real worker processes (gloo over loopback), started by `distrib launch`."""

from __future__ import annotations

import re

from helpers import SCRIPTS, launch

CHECKS = [
    "all_reduce",
    "all_reduce several",
    "all_reduce_async",
    "all_gather uneven",
    "all_gather_object",
    "broadcast",
    "broadcast_object",
    "reduce_scatter",
    "barrier",
    "reducer removed with its optimizer",
]


def test_every_collective_between_two_workers():
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "comm_collectives.py"), timeout=90)
    assert code == 0, out
    for worker in (0, 1):
        for name in CHECKS:
            assert f"[worker {worker}] OK {name}\n" in out, out
    assert "FAILED" not in out


def test_a_dead_peer_fails_the_overlapped_all_reduce_within_the_timeout():
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "comm_collectives.py"), "dead-peer", timeout=60)
    assert code == 0, out
    found = re.search(r"DEAD PEER CollectiveError after ([\d.]+)s", out)
    assert found, out
    assert float(found.group(1)) < 30  # the 3 s timeout (gloo may also see the closed socket at once)


def test_a_barrier_of_its_own_length_outlasts_the_communication_timeout_and_a_plain_one_does_not():
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_barrier.py"), "1", timeout=90)
    assert code == 0, out
    for worker in (0, 1):  # worker 1 sleeps 3 s; the communication timeout is 2 s
        assert f"[worker {worker}] long barrier passed" in out, out
        assert f"[worker {worker}] short barrier failed" in out, out
