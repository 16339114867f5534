"""Train a model under a per-worker memory limit (RLIMIT_AS), run by distrib launch --workers N.

    sharded_memory_limit.py --strategy {sharded,mwms} --limit-mb MB [--width W] [--blocks B] [--steps S]

Once the strategy (its process group) exists and the code every phase needs is loaded, the limit
is set to this process's virtual size plus ``--limit-mb`` (``--limit-mb 0``: no limit, for
calibration). Then ``--blocks`` residual ``Linear(W, W)`` blocks are built in the scope with
float32 Adam and trained ``--steps`` steps: the model, data and probes of benchmarks/sharded_model.py,
which benchmarks/sharded_memory.py measures without a limit. Exit 0 with "trained S steps" at the end; running out
of memory (``MemoryError`` or torch's "can't allocate memory") prints "out of memory while
PHASE: ..." and exits 3. Each worker also prints a JSON line with its virtual and resident peaks
above the baseline (MB), what the test's limit is calibrated against.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import torch

import distrib as ds

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the model the benchmarks measure
from sharded_model import batches, build_model, make_step, make_strategy, reset_high_water_mark, vm_status, warm_up  # noqa: E402

OUT_OF_MEMORY = 3

p = argparse.ArgumentParser()
p.add_argument("--strategy", choices=["sharded", "mwms"], required=True)
p.add_argument("--limit-mb", type=float, required=True)
p.add_argument("--width", type=int, default=1024)
p.add_argument("--blocks", type=int, default=24)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--batch", type=int, default=8)
args = p.parse_args()
torch.set_num_threads(1)

strategy: ds.Strategy = make_strategy(args.strategy)
strategy.barrier()
warm_up()  # FSDP2's modules, autograd and Adam's code paths, loaded before the limit: code is not what is measured
global_batch = args.batch * strategy.num_replicas_in_sync
data = batches(args.steps, global_batch, args.width)
reset_high_water_mark()  # VmHWM restarts from the current RSS (VmPeak cannot be reset: it may predate the baseline)
base = vm_status()
if args.limit_mb > 0:
    limit = base["VmSize"] + int(args.limit_mb * 1e6)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
print(f"worker {strategy.worker_index}: limit {args.limit_mb:g} MB above {base['VmSize'] / 1e6:.0f} MB", flush=True)


phase = "building the model"
try:
    with strategy.scope():
        model = build_model(args.width, args.blocks)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    built = vm_status()
    step = make_step(model, optimizer, global_batch)
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        phase = f"training step {i + 1}"
        loss = strategy.run(step, args=(x, y))
        assert torch.isfinite(loss), loss
except (MemoryError, RuntimeError) as e:
    if not isinstance(e, MemoryError) and "alloc" not in str(e):
        raise
    print(
        f"worker {strategy.worker_index}: out of memory while {phase}: {type(e).__name__}: {str(e)[:200]}", flush=True
    )
    sys.stdout.flush()
    os._exit(OUT_OF_MEMORY)  # a peer may wait in a collective: the launcher stops the group on this exit
end = vm_status()
print(
    json.dumps(
        {
            "memory_worker": strategy.worker_index,
            "virtual_peak_mb": round((end["VmPeak"] - base["VmSize"]) / 1e6, 1),
            "virtual_build_mb": round((built["VmPeak"] - base["VmSize"]) / 1e6, 1),
            "rss_peak_mb": round((end["VmHWM"] - base["VmRSS"]) / 1e6, 1),
        }
    ),
    flush=True,
)
print(f"worker {strategy.worker_index}: trained {args.steps} steps", flush=True)
