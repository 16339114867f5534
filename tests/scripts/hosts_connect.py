"""Join a cluster whose other workers may never come, and report how the connect phase ended.

    TF_CONFIG=... python tests/scripts/hosts_connect.py --timeout 5

Builds ``ds.MultiWorkerMirroredStrategy`` with ``CommunicationOptions(timeout_seconds=--timeout)``
from the launcher's variables (TF_CONFIG here) and prints one line,

    CONNECT rank=<r> outcome=<joined|CollectiveError|other exception> elapsed=<s> timeout=<s> message=<first line>

where ``elapsed`` is the time spent building the strategy (interpreter start and imports excluded: torch is
imported first, as a training script does, or distrib's lazy import of it would count as the connect's time).
Exits 0 whatever the outcome: the caller judges it.
"""

import argparse
import json
import os
import time

import torch  # noqa: F401 - imported before the clock starts (see above)

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--timeout", type=float, default=5.0)
args = p.parse_args()

rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", "?")
start = time.monotonic()
try:
    ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=args.timeout))
    outcome, message = "joined", ""
except ds.CollectiveError as e:
    outcome, message = "CollectiveError", str(e)
except Exception as e:  # noqa: BLE001 - reported, the test fails on it
    outcome, message = type(e).__name__, str(e)
elapsed = time.monotonic() - start
print(
    f"CONNECT rank={rank} outcome={outcome} elapsed={elapsed:.2f} timeout={args.timeout:g} "
    f"message={message.splitlines()[0] if message else '-'}",
    flush=True,
)
os._exit(0)  # a half-joined group must not delay the exit
