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

Each configuration runs under two settings of glibc's allocator (``--malloc``):

* ``default``: glibc as it comes. Its mmap threshold is dynamic: once a block of a few MB was freed,
  later blocks up to that size come from the heap, and freed heap memory stays in the process (it
  counts in RSS and in ``RLIMIT_AS``). FSDP allocates and frees a unit's whole parameters and
  gradients at every unit of every step, so under this setting the freed buffers pile up;
* ``mmap``: ``MALLOC_MMAP_THRESHOLD_=131072`` in the workers' environment: a fixed threshold, so
  every block over 128 KiB is its own mapping, returned to the system when freed (the same as
  ``mallopt(M_MMAP_THRESHOLD, 131072)`` called in the process; jemalloc or tcmalloc behave alike).

Today the sharded build holds the whole model on every worker for a moment (the user's code builds
it normally in the scope; it is sharded when the scope closes): ``build`` shows that cost apart from
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRATEGIES = ("mwms", "sharded")
#: the workers' environment for each --malloc setting (see the module docstring)
MALLOC = {"default": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def status() -> dict[str, int]:
    """This process's ``Vm*`` figures from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Vm"):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_high_water_mark() -> None:
    """Reset VmHWM (and the kernel's peak RSS) to the current RSS (Linux >= 4.0, ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def warm_up() -> None:
    """Load what the measured phases would otherwise load on first use: FSDP2's modules, Adam, autograd."""
    import torch
    import torch.distributed.fsdp  # noqa: F401  (the sharded strategy imports it when it first shards)
    import torch.distributed.tensor  # noqa: F401

    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def measure(strategy_name: str, width: int, blocks: int, steps: int, batch: int) -> dict[str, Any]:
    """Build the model under ``strategy_name`` and train it ``steps`` steps; the memory figures (run in a worker)."""
    import torch
    from torch import nn

    import distrib as ds

    torch.set_num_threads(1)

    class Block(nn.Module):
        """A residual block: a natural sharding unit."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.fc(x))

    if strategy_name == "sharded":
        strategy: Any = ds.ShardedStrategy(sharding_policy=ds.ShardingPolicy(module_classes=[Block]))
    else:
        strategy = ds.MultiWorkerMirroredStrategy()
    strategy.barrier()  # the group's first collective: its buffers belong to the baseline
    warm_up()  # code loaded on first use (FSDP, Adam, autograd) belongs to the baseline too, not to the model
    base = status()
    reset_high_water_mark()
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(width) for _ in range(blocks)])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    built = status()
    reset_high_water_mark()
    global_batch = batch * strategy.num_replicas_in_sync
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(global_batch, width, generator=g), torch.randn(global_batch, width, generator=g))
            for _ in range(steps)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss((model(x) - y).pow(2).mean(1), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for x, y in strategy.experimental_distribute_dataset(data):
        loss = strategy.run(step, args=(x, y))
    assert torch.isfinite(loss)
    trained = status()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    mb = 1e6
    return {"worker": strategy.worker_index, "local_params": local,
            "baseline_rss_mb": round(base["VmRSS"] / mb, 1),
            "build_mb": round((built["VmHWM"] - base["VmRSS"]) / mb, 1),
            "steps_mb": round((trained["VmHWM"] - base["VmRSS"]) / mb, 1),
            "peak_mb": round((max(built["VmHWM"], trained["VmHWM"]) - base["VmRSS"]) / mb, 1),
            "after_build_rss_mb": round((built["VmRSS"] - base["VmRSS"]) / mb, 1),
            "virtual_peak_mb": round((max(built["VmPeak"], trained["VmPeak"]) - base["VmSize"]) / mb, 1)}


def run(strategy_name: str, workers: int, malloc: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One configuration in fresh processes; every worker's figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **MALLOC[malloc]}
    env.pop("TF_CONFIG", None)
    if malloc == "default":
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    cmd = [sys.executable, "-m", "distrib.app.cli", "launch", "--workers", str(workers), str(pathlib.Path(__file__)),
           "--measure", strategy_name, "--width", str(args.width), "--blocks", str(args.blocks), "--steps",
           str(args.steps), "--batch", str(args.batch)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line[line.index('{"worker"'):]) for line in out.stdout.splitlines() if '"local_params"' in line]
    if out.returncode != 0 or len(rows) != workers:
        raise RuntimeError(f"{strategy_name} N={workers} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["worker"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--malloc", default="default,mmap", help="glibc allocator settings: default, mmap (see above)")
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

    params = args.blocks * (args.width * args.width + args.width)
    summary: dict[str, Any] = {"params": params, "width": args.width, "blocks": args.blocks, "steps": args.steps,
                               "batch_per_worker": args.batch, "runs": {}}
    for malloc in args.malloc.split(","):
        for n in [int(w) for w in args.workers.split(",")]:
            entry: dict[str, Any] = {}
            for name in STRATEGIES:
                rows = run(name, n, malloc, args)
                entry[name] = {"workers": rows, **{k: max(r[k] for r in rows) for k in
                                                   ("build_mb", "steps_mb", "peak_mb", "virtual_peak_mb")},
                               "baseline_rss_mb": statistics.median(r["baseline_rss_mb"] for r in rows)}
                print(f"{malloc} N={n} {name}: peak {entry[name]['peak_mb']} MB", file=sys.stderr, flush=True)
            entry["ratio_peak"] = round(entry["sharded"]["peak_mb"] / entry["mwms"]["peak_mb"], 3)
            entry["ratio_steps"] = round(entry["sharded"]["steps_mb"] / entry["mwms"]["steps_mb"], 3)
            summary["runs"][f"{malloc}/{n}"] = entry
    print(json.dumps(summary, indent=1))
    print(f"\n{params / 1e6:.1f}M parameters, fp32 Adam; MB above the process-group baseline, the largest worker")
    print(f"{'malloc':<8} {'N':>2} {'strategy':<8} {'build':>7} {'steps':>7} {'peak':>7} {'virtual':>8} "
          f"{'peak ratio':>11} {'steps ratio':>12}")
    for key, e in summary["runs"].items():
        malloc, n = key.split("/")
        for name in STRATEGIES:
            r = e[name]
            ratio = (f"{e['ratio_peak']:>11} {e['ratio_steps']:>12}" if name == "sharded" else "")
            print(f"{malloc:<8} {n:>2} {name:<8} {r['build_mb']:>7} {r['steps_mb']:>7} {r['peak_mb']:>7} "
                  f"{r['virtual_peak_mb']:>8} {ratio}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
