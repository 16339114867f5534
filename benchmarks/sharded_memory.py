"""Peak memory per worker: ``ShardedStrategy`` against ``MultiWorkerMirroredStrategy`` (issue 20, item 4).

    python benchmarks/sharded_memory.py [--workers 1,2,4] [--malloc default,mmap] [--width 2048] [--blocks 12]
                                        [--steps 3] [--batch 16] [--json out.json]

The model: ``--blocks`` residual blocks ``x + relu(Linear(width, width)(x))`` (default 12 x 2048:
50.4M parameters, 201 MB in float32), trained with float32 Adam (``compute_average_loss`` of a
squared error, ``strategy.run``, ``loss.backward(); optimizer.step()``) on ``--batch`` rows per
worker. Each configuration runs in fresh processes started by ``distrib launch --workers N``
(gloo over loopback, one torch thread each); under the sharded strategy every block is a unit
(``ShardingPolicy(module_classes=[Block])``).

Measured in every worker, from ``/proc/self/status`` (RSS: what the process really holds):

* ``baseline``: VmRSS once the strategy (the process group) exists and one collective ran;
* ``build``: the RSS high-water mark (VmHWM) while the model and the optimizer are built in
  ``strategy.scope()`` (the mark is reset at the start through ``/proc/self/clear_refs``);
* ``steps``: VmHWM over the training steps (reset after the build);
* ``peak``: the larger of the two; every figure is reported above the baseline, in MB (10^6 bytes).

Also reported: VmPeak above the baseline VmSize (virtual memory, what ``RLIMIT_AS`` counts),
the figure tests/strategies/test_sharded_memory.py calibrates its limit against.

Each configuration runs under every glibc allocator setting named by ``--malloc`` (comma-separated;
the grammar is ``sharded_model.allocator_env``'s), put in the workers' environment:

* ``default``: glibc as it comes. Its mmap threshold is dynamic: once a block of a few MB was freed,
  later blocks up to that size come from the heap, and freed heap memory stays in the process (it
  counts in RSS and in ``RLIMIT_AS``). FSDP allocates and frees a unit's whole parameters and
  gradients at every unit of every step, so under this setting the freed buffers pile up;
* ``mmap`` (= ``mmap:128k``): ``MALLOC_MMAP_THRESHOLD_=131072``: a fixed threshold, so every block
  over 128 KiB is its own mapping, returned to the system when freed (the same as
  ``mallopt(M_MMAP_THRESHOLD, 131072)`` called in the process); ``mmap:4m`` etc. fix it elsewhere;
* ``trim``: glibc's ``malloc_trim(0)`` after every step; ``arena:N``, ``trimthr:SIZE``, ``toppad:SIZE``:
  ``MALLOC_ARENA_MAX``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``; parts combine with ``+``.

Each worker also times its steps (the median over every step but the first, wall and CPU time): a
rough figure for the setting's speed on this model; benchmarks/sharded_speed.py measures speed properly.

The sharded build records the model's initialisation and replays it shard by shard (deferred init, the
default), so no worker holds the whole model while building either: ``build`` shows that cost apart from
``steps``. Targets (issue 20): the sharded peak <= 0.55x MultiWorkerMirrored's at N=2 and <= 0.35x
at N=4. Prints a JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Any

from sharded_model import (  # sys.path[0]
    MALLOC_VARIABLES,
    after_step,
    allocator_env,
    batches,
    build_model,
    make_step,
    make_strategy,
    params,
    reset_high_water_mark,
    vm_status,
    warm_up,
    worker_env,
)

STRATEGIES = ("mwms", "sharded")


def measure(strategy_name: str, width: int, blocks: int, steps: int, batch: int) -> dict[str, Any]:
    """Build the model under ``strategy_name`` and train it ``steps`` steps; the memory figures (run in a worker)."""
    import time

    import torch

    torch.set_num_threads(1)
    strategy = make_strategy(strategy_name)
    strategy.barrier()  # the group's first collective: its buffers belong to the baseline
    warm_up()  # code loaded on first use (FSDP, Adam, autograd) belongs to the baseline too, not to the model
    base = vm_status()
    reset_high_water_mark()
    with strategy.scope():
        model = build_model(width, blocks)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    built = vm_status()
    reset_high_water_mark()
    global_batch = batch * strategy.num_replicas_in_sync
    data = batches(steps, global_batch, width)

    step = make_step(model, optimizer, global_batch)
    wall: list[float] = []
    cpu: list[float] = []
    for x, y in strategy.experimental_distribute_dataset(data):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = strategy.run(step, args=(x, y))
        after_step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    assert torch.isfinite(loss)
    trained = vm_status()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    mb = 1e6
    timed = slice(1, None) if len(wall) > 1 else slice(None)  # the first step also pays for first-use costs
    return {
        "worker": strategy.worker_index,
        "local_params": local,
        "baseline_rss_mb": round(base["VmRSS"] / mb, 1),
        "build_mb": round((built["VmHWM"] - base["VmRSS"]) / mb, 1),
        "steps_mb": round((trained["VmHWM"] - base["VmRSS"]) / mb, 1),
        "peak_mb": round((max(built["VmHWM"], trained["VmHWM"]) - base["VmRSS"]) / mb, 1),
        "after_build_rss_mb": round((built["VmRSS"] - base["VmRSS"]) / mb, 1),
        "virtual_peak_mb": round((max(built["VmPeak"], trained["VmPeak"]) - base["VmSize"]) / mb, 1),
        "step_wall_s": round(statistics.median(wall[timed]), 4),
        "step_cpu_s": round(statistics.median(cpu[timed]), 4),
        "allocator_env": {k: os.environ[k] for k in MALLOC_VARIABLES if k in os.environ},
    }


def run(strategy_name: str, workers: int, malloc: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One configuration in fresh processes; every worker's figures."""
    env = worker_env(malloc)
    cmd = [
        sys.executable,
        "-m",
        "distrib.app.cli",
        "launch",
        "--workers",
        str(workers),
        str(pathlib.Path(__file__)),
        "--measure",
        strategy_name,
        "--width",
        str(args.width),
        "--blocks",
        str(args.blocks),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line[line.index('{"worker"') :]) for line in out.stdout.splitlines() if '"local_params"' in line]
    if out.returncode != 0 or len(rows) != workers:
        raise RuntimeError(
            f"{strategy_name} N={workers} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return sorted(rows, key=lambda r: r["worker"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument(
        "--malloc",
        default="default,mmap",
        help="glibc allocator settings, comma-separated: default, mmap, mmap:4m, trim, ... (see above)",
    )
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="rows per worker per step")
    p.add_argument("--json", default=None)
    p.add_argument("--measure", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.width, args.blocks, args.steps, args.batch)), flush=True)
        return

    mallocs = args.malloc.split(",")
    for malloc in mallocs:
        allocator_env(malloc)  # a mistyped setting fails now, not after the first runs
    total = params(args.width, args.blocks)
    summary: dict[str, Any] = {
        "params": total,
        "width": args.width,
        "blocks": args.blocks,
        "steps": args.steps,
        "batch_per_worker": args.batch,
        "runs": {},
    }
    for malloc in mallocs:
        for n in [int(w) for w in args.workers.split(",")]:
            entry: dict[str, Any] = {"env": allocator_env(malloc)}
            for name in STRATEGIES:
                rows = run(name, n, malloc, args)
                entry[name] = {
                    "workers": rows,
                    **{
                        k: max(r[k] for r in rows)
                        for k in ("build_mb", "steps_mb", "peak_mb", "virtual_peak_mb", "step_wall_s", "step_cpu_s")
                    },
                    "baseline_rss_mb": statistics.median(r["baseline_rss_mb"] for r in rows),
                }
                print(f"{malloc} N={n} {name}: peak {entry[name]['peak_mb']} MB", file=sys.stderr, flush=True)
            entry["ratio_peak"] = round(entry["sharded"]["peak_mb"] / entry["mwms"]["peak_mb"], 3)
            entry["ratio_steps"] = round(entry["sharded"]["steps_mb"] / entry["mwms"]["steps_mb"], 3)
            default = summary["runs"].get(f"default/{n}")
            if default is not None:  # against MWMS as users get it (glibc's default), when that ran before
                entry["ratio_peak_vs_mwms_default"] = round(entry["sharded"]["peak_mb"] / default["mwms"]["peak_mb"], 3)
            summary["runs"][f"{malloc}/{n}"] = entry
    print(json.dumps(summary, indent=1))
    print(
        f"\n{total / 1e6:.1f}M parameters, fp32 Adam; MB above the process-group baseline, the largest worker; "
        "step: median seconds of the slower worker (wall / CPU)"
    )
    width = max(8, *(len(m) for m in mallocs))
    print(
        f"{'malloc':<{width}} {'N':>2} {'strategy':<8} {'build':>7} {'steps':>7} {'peak':>7} {'virtual':>8} "
        f"{'step wall/cpu':>14} {'peak ratio':>11} {'steps ratio':>12}"
    )
    for key, e in summary["runs"].items():
        malloc, n = key.rsplit("/", 1)
        for name in STRATEGIES:
            r = e[name]
            ratio = f"{e['ratio_peak']:>11} {e['ratio_steps']:>12}" if name == "sharded" else ""
            step = f"{r['step_wall_s']:.3f}/{r['step_cpu_s']:.3f}"
            print(
                f"{malloc:<{width}} {n:>2} {name:<8} {r['build_mb']:>7} {r['steps_mb']:>7} {r['peak_mb']:>7} "
                f"{r['virtual_peak_mb']:>8} {step:>14} {ratio}"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
