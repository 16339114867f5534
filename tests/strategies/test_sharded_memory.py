"""``ds.ShardedStrategy`` trains, under a per-worker memory limit, a model that MultiWorkerMirrored cannot.

tests/scripts/sharded_memory_limit.py (4 workers by ``distrib launch``, gloo over loopback) sets
``RLIMIT_AS`` to each worker's virtual size, once its process group exists, plus ``LIMIT_MB``, then
builds 24 residual ``Linear(1024, 1024)`` blocks (25.2M parameters, 101 MB in float32) with float32
Adam and trains 3 steps.

Calibration (the script's own figures without a limit, virtual memory above the baseline, the
largest worker; 2026-11-26, torch 2.13 CPU): MultiWorkerMirrored 486-487 MB (16 bytes per parameter:
parameters, gradients, Adam's two moments, plus ~65 MB that glibc and gloo reserve), the sharded
strategy 269 MB, reached while the model is built (today the whole model exists on every worker
before it is sharded, and all of it stays until every unit is sharded); its steps need less.
``LIMIT_MB`` = 370 leaves ~115 MB on either side, more than one malloc arena (64 MB) that a run
might reserve or not.

The workers run with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc's default threshold is dynamic, and
freed blocks of a few MB then stay in the heap; FSDP frees a unit's whole parameters and gradients
at every unit of every step, so under the default the sharded workers' peak exceeds
MultiWorkerMirrored's (benchmarks/sharded_memory.py measures both settings; docs/performance.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import SCRIPTS, run_bounded

LIMIT_MB = 370
WORKERS = 4
OUT_OF_MEMORY = 3  # the script's exit code when an allocation fails


def _run(strategy: str) -> tuple[int, str]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    env.pop("TF_CONFIG", None)
    cmd = [
        sys.executable,
        "-m",
        "distrib.app.cli",
        "launch",
        "--workers",
        str(WORKERS),
        str(SCRIPTS / "sharded_memory_limit.py"),
        "--strategy",
        strategy,
        "--limit-mb",
        str(LIMIT_MB),
        "--steps",
        "3",
    ]
    code, log, _ = run_bounded(cmd, timeout=180, env=env)
    return code, log


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_under_the_same_memory_limit_mwms_runs_out_and_sharded_trains_to_the_end() -> None:
    code, log = _run("mwms")
    assert code == OUT_OF_MEMORY, log
    assert "out of memory while" in log and "trained 3 steps" not in log, log
    assert "can't allocate memory" in log or "MemoryError" in log, log  # the limit, not some other failure

    code, log = _run("sharded")
    assert code == 0, log
    assert sum(f"worker {i}: trained 3 steps" in log for i in range(WORKERS)) == WORKERS, log
