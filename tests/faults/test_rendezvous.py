"""Joining a cluster is bounded by CommunicationOptions(timeout_seconds=...) in every phase (issue 10, B.3).

Before: 150 s observed with a 30 s timeout (the store client retries its connect). Each scenario
starts one worker of a 2-worker cluster whose peer never comes, with a 3 s timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from distrib.cluster.launch import free_ports

SCRIPT = """
import time, distrib as ds
start = time.monotonic()
try:
    ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=3))
    print("JOINED")
except ds.CollectiveError as e:
    print(f"ERROR after {time.monotonic() - start:.1f}s: {e}")
"""


@pytest.mark.parametrize("case, chief, index", [
    ("the chief never comes (an address nothing answers)", "192.0.2.1", 1),
    ("the chief waits for a worker that never comes", "127.0.0.1", 0),
])
def test_joining_without_the_peer_fails_within_the_timeout(case, chief, index):
    ports = free_ports(2)
    config = {"cluster": {"worker": [f"{chief}:{ports[0]}", f"127.0.0.1:{ports[1]}"]},
              "task": {"type": "worker", "index": index}}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                            env={"TF_CONFIG": json.dumps(config), "PATH": "/usr/bin:/bin",
                                 "PYTHONPATH": ":".join(sys.path)})
    elapsed = time.monotonic() - start
    found = re.search(r"ERROR after ([\d.]+)s: worker \d could not join the 2-worker cluster", result.stdout)
    assert found, result.stdout + result.stderr[-2000:]
    print(f"FAULT rendezvous, {case}: timeout 3 s, error after {found.group(1)} s ({elapsed:.1f} s with start-up)")
    # the timeout, plus the 2 s left for torch's own, finer error, plus room for a loaded 2-core machine (6.1 s was
    # seen at load 7); a wrong bound (the 30 s default, or none) would still fail
    assert float(found.group(1)) < 3 * 3
