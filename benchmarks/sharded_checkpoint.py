"""What ``ds.Checkpoint`` costs under ShardedStrategy: the sharded format against the gathered plain one.

    python benchmarks/sharded_checkpoint.py [--workers 2] [--width 2048] [--blocks 12] [--rounds 3] [--json OUT]

``ds.Checkpoint(model, optimizer).save`` and ``.restore`` of the residual-MLP model of the other sharded
benchmarks (benchmarks/sharded_model.py; 12 x 2048: 50.4M parameters, 806 MB of float32 Adam state) after one
Adam step, under ``ShardedStrategy(checkpoint_format="sharded")`` (each worker writes its own shards into
``<prefix>.dcp``) and ``checkpoint_format="plain"`` (every shard gathered on every worker, the chief writes one
``.pt``), one job per format, ``--rounds`` write + read each. Per variant, the medians over rounds of: save and restore seconds
(the slowest worker), the high-water mark of RSS above the trained state during each (the largest worker), and
the bytes each worker wrote. Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sharded_model as sm  # noqa: E402


def worker(fmt: str, width: int, blocks: int, rounds: int, directory: str, out: str) -> None:
    import torch

    import distrib as ds

    results: dict[str, list[float]] = {"save_s": [], "save_mb": [], "restore_s": [], "restore_mb": [], "written_mb": []}
    strategy = ds.ShardedStrategy(sharding_policy=ds.ShardingPolicy(module_classes=[sm.Block]), checkpoint_format=fmt)
    with strategy.scope():
        model = sm.build_model(width, blocks)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = sm.batches(1, 16, width)[0]
    rows = 16 // strategy.num_workers
    strategy.run(sm.make_step(model, optimizer, 16), args=(x[:rows], y[:rows]))  # Adam's state exists
    checkpoint = ds.Checkpoint(model=model, optimizer=optimizer)
    for i in range(rounds):
        prefix = os.path.join(directory, f"{fmt}-{i}")
        for what in ("save", "restore"):
            strategy.barrier()
            sm.reset_high_water_mark()
            base = sm.vm_status()["VmRSS"]
            start = time.perf_counter()
            if what == "save":
                checkpoint.write(prefix)
            else:
                checkpoint.read(prefix)
            seconds = time.perf_counter() - start
            high = sm.vm_status()["VmHWM"] - base
            strategy.barrier()
            results[f"{what}_s"].append(seconds)
            results[f"{what}_mb"].append(high / 1e6)
        results["written_mb"].append(_written(prefix, strategy.worker_index) / 1e6)
        strategy.barrier()
        if strategy.is_chief:
            shutil.rmtree(prefix + ".dcp", ignore_errors=True)
            if os.path.exists(prefix + ".pt"):
                os.remove(prefix + ".pt")
    gathered = strategy.communicator.all_gather_object(results)
    if strategy.is_chief:
        Path(out).write_text(json.dumps(gathered))


def _written(prefix: str, rank: int) -> int:
    if os.path.isdir(prefix + ".dcp"):
        return sum(
            os.path.getsize(os.path.join(prefix + ".dcp", n))
            for n in os.listdir(prefix + ".dcp")
            if n.startswith(f"__{rank}_")
        )
    return os.path.getsize(prefix + ".pt") if rank == 0 and os.path.exists(prefix + ".pt") else 0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--malloc", default="mmap", help="glibc allocator settings (benchmarks/sharded_model.py)")
    p.add_argument("--json", default=None)
    p.add_argument("--_worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        worker(args._worker[0], args.width, args.blocks, args.rounds, *args._worker[1:])
        return {}
    per_format = {}
    with tempfile.TemporaryDirectory(prefix="sharded-ckpt-") as tmp:
        for fmt in ("sharded", "plain"):  # a fresh job per format: nothing of the other's allocations left
            out = os.path.join(tmp, f"{fmt}.json")
            env = {**os.environ, **sm.worker_env(args.malloc)}
            cmd = [
                sys.executable,
                "-m",
                "distrib.app.cli",
                "launch",
                "--workers",
                str(args.workers),
                __file__,
                "--width",
                str(args.width),
                "--blocks",
                str(args.blocks),
                "--rounds",
                str(args.rounds),
                "--_worker",
                fmt,
                tmp,
                out,
            ]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(
                    f"the {fmt} workers failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
                )
            per_format[fmt] = json.loads(Path(out).read_text())
    summary: dict = {
        "params": sm.params(args.width, args.blocks),
        "workers": args.workers,
        "rounds": args.rounds,
        "variants": {},
    }
    for fmt, per_worker in per_format.items():
        row = {}
        for key in ("save_s", "restore_s"):
            row[key] = round(statistics.median(max(w[key][i] for w in per_worker) for i in range(args.rounds)), 3)
        for key in ("save_mb", "restore_mb"):
            row[key] = round(statistics.median(max(w[key][i] for w in per_worker) for i in range(args.rounds)), 1)
        row["written_mb_per_worker"] = [round(statistics.median(w["written_mb"]), 1) for w in per_worker]
        summary["variants"][fmt] = row
    print(f"{summary['params'] / 1e6:.1f}M parameters, {args.workers} workers, medians of {args.rounds} rounds")
    print(f"{'format':<9} {'save s':>7} {'restore s':>9} {'save +MB':>9} {'restore +MB':>11}  written per worker MB")
    for fmt, row in summary["variants"].items():
        print(
            f"{fmt:<9} {row['save_s']:>7} {row['restore_s']:>9} {row['save_mb']:>9} {row['restore_mb']:>11}  "
            f"{row['written_mb_per_worker']}"
        )
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
