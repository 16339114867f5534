"""Worker 1 stops answering (SIGSTOP) after the first all-reduce; worker 0 must get an error within the timeout.

distrib launch --workers 2 tests/scripts/mw_hang.py TIMEOUT_SECONDS
"""

import os
import signal
import sys
import time

import torch

import distrib as ds
from distrib.comm import CollectiveError

timeout = float(sys.argv[1])
strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=timeout))
strategy.reduce("SUM", torch.ones(3))
if strategy.worker_index == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
start = time.monotonic()
try:
    strategy.reduce("SUM", torch.ones(3))
except CollectiveError as e:
    print(f"COLLECTIVE ERROR after {time.monotonic() - start:.2f}s: {e}", flush=True)
    sys.exit(3)
print("no error", flush=True)
