"""A barrier longer than the communication timeout (the chief writes a checkpoint), and one that is not.

    distrib launch --workers 2 tests/scripts/mw_barrier.py SLEEPER
Communication timeout 2 s. Worker SLEEPER sleeps 3 s (1 s past the timeout) before each barrier.
`barrier(timeout=30)` must succeed on both; the plain `barrier()` must fail with CollectiveError within about
2 s on the other.
"""

import sys
import time

import distrib as ds

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=2))
sleeper = int(sys.argv[1])
if strategy.worker_index == sleeper:
    time.sleep(3)
start = time.monotonic()
strategy.barrier(timeout=30)
print(f"long barrier passed after {time.monotonic() - start:.1f}s", flush=True)
if strategy.worker_index == sleeper:
    time.sleep(3)
start = time.monotonic()
try:
    strategy.barrier()
    print("short barrier passed", flush=True)
except ds.CollectiveError as e:
    print(f"short barrier failed after {time.monotonic() - start:.1f}s: {str(e)[:80]}", flush=True)
