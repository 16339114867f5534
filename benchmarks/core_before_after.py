"""The step time of two versions of distrib, in one run: the main job and 2-worker MultiWorkerMirrored.

    python benchmarks/core_before_after.py --before 653d5ed [--after 6b08412] [--rounds 5] [--steps 60]
        [--clock wall|cpu] [--json out.json]

``--before`` (and ``--after``) are git revisions: each is checked out into a temporary worktree
and imported from there (``PYTHONPATH``); without ``--after``, "after" is this checkout's ``src``. Each round measures both
versions, in alternating order, each in a fresh process:

* ``main_job``: the `distrib train` step (``app.train.make_steps``: the seed's CNN, fused Adam,
  ``compute_average_loss``, the accuracy metric) through ``strategy.run`` + ``strategy.reduce``
  under ``MirroredStrategy()`` (one CPU replica), on random data of Fashion-MNIST's shape, batch 64;
* ``multi_worker_2``: the same step under ``MultiWorkerMirroredStrategy`` on 2 worker processes
  started by ``distrib launch --workers 2`` (gloo over loopback, global batch 128), worker 0's rate;
* ``run_dispatch``: ``strategy.run`` of an empty function, calls per CPU second: the strategy layer's
  own per-step cost without the step (steady where the other two are noisy on a shared machine).

Reported: examples/s per version and setting (medians), and the median of the per-round ratios
after/before (1.0: no slower). Used for issue 19 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 64


def measure_dispatch(calls: int) -> float:
    """``strategy.run`` calls per second of an empty function under ``MirroredStrategy()`` (one CPU replica): the
    strategy layer's own cost per step, alone (its inverse is the microseconds a step pays for the layer)."""
    import torch

    import distrib as ds

    strategy = ds.MirroredStrategy(["cpu"])
    x = torch.ones(1)
    for _ in range(1000):
        strategy.run(lambda t: t, args=(x,))
    start = time.process_time()
    for _ in range(calls):
        strategy.run(lambda t: t, args=(x,))
    return calls / (time.process_time() - start)


def measure(steps: int) -> float:
    """Examples/s of the main job's step under this process's strategy (run inside a measuring process)."""
    if os.environ.get("DISTRIB_BENCH_SETTING") == "run_dispatch":
        return measure_dispatch(steps * 1000)
    import torch

    import distrib as ds
    from distrib.app import models
    from distrib.app.train import make_steps

    workers = int(os.environ.get("DISTRIB_BENCH_WORKERS", "1"))
    strategy = ds.MultiWorkerMirroredStrategy() if workers > 1 else ds.MirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = models.fashion_mnist_cnn()
        opt = models.fashion_mnist_optimizer(model.parameters())
        metrics = (ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean(), ds.metrics.SparseCategoricalAccuracy())
    global_batch = BATCH * strategy.num_replicas_in_sync
    train_step, _ = make_steps(model, opt, global_batch, *metrics)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.rand(global_batch, 1, 28, 28, generator=g), torch.randint(0, 10, (global_batch,), generator=g))
        for _ in range(8)
    ]
    data = iter(strategy.experimental_distribute_dataset(batches * (steps // 8 + 3)))
    total = torch.zeros(())
    for _ in range(10):  # warm-up
        total += strategy.reduce("sum", strategy.run(train_step, args=(next(data),)), axis=None)
    strategy.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        total += strategy.reduce("sum", strategy.run(train_step, args=(next(data),)), axis=None)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert torch.isfinite(total)
    return steps * global_batch / (cpu if os.environ.get("DISTRIB_BENCH_CLOCK") == "cpu" else wall)


def run_version(src: pathlib.Path, setting: str, steps: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("TF_CONFIG", None)
    me = [str(pathlib.Path(__file__).resolve()), "--measure", "--steps", str(steps)]
    env["DISTRIB_BENCH_SETTING"] = setting
    if setting in ("main_job", "run_dispatch"):
        cmd = [sys.executable, *me]
    else:
        env["DISTRIB_BENCH_WORKERS"] = "2"
        cmd = [sys.executable, "-m", "distrib.app.cli", "launch", "--workers", "2", *me]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    # distrib launch prefixes each task's lines with "[worker i] "
    rates = [json.loads(line[line.index('{"rate"') :])["rate"] for line in out.stdout.splitlines() if '{"rate"' in line]
    if out.returncode != 0 or not rates:
        raise RuntimeError(
            f"{setting} with {src} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        )
    return rates[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="HEAD", help="the git revision to compare against (default: HEAD)")
    p.add_argument("--after", default=None, help="a git revision for 'after' (default: this checkout's src)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--settings",
        default="main_job,multi_worker_2,run_dispatch",
        help="run_dispatch: strategy.run calls/s of an empty function (steps x 1000 calls)",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: examples per second of this process's CPU time (a shared, noisy machine: other "
        "processes' load does not count; with 2 workers, worker 0's CPU time)",
    )
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        rate = measure(args.steps)
        if os.environ.get("RANK", os.environ.get("DISTRIB_WORKER_INDEX", "0")) in ("0", ""):
            print(json.dumps({"rate": rate}), flush=True)
        return

    os.environ["DISTRIB_BENCH_CLOCK"] = args.clock
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": args.before, **({"after": args.after} if args.after else {})}
        for name, rev in trees.items():
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(pathlib.Path(tmp) / name), rev],
                check=True,
                capture_output=True,
            )
        try:
            versions = {
                "before": pathlib.Path(tmp) / "before" / "src",
                "after": pathlib.Path(tmp) / "after" / "src" if args.after else ROOT / "src",
            }
            settings = args.settings.split(",")
            rates: dict[str, dict[str, list[float]]] = {s: {v: [] for v in versions} for s in settings}
            for r in range(args.rounds):
                for setting in settings:
                    order = list(versions) if r % 2 == 0 else list(reversed(versions))
                    for v in order:
                        rates[setting][v].append(run_version(versions[v], setting, args.steps))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for name in trees:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(pathlib.Path(tmp) / name)],
                    capture_output=True,
                )

    summary: dict[str, Any] = {
        "before": args.before,
        "after": args.after or "working tree",
        "rounds": args.rounds,
        "steps": args.steps,
        "clock": args.clock,
        "settings": {},
    }
    for setting, by_version in rates.items():
        ratios = [a / b for a, b in zip(by_version["after"], by_version["before"])]
        summary["settings"][setting] = {
            "examples_per_s": {v: round(statistics.median(x), 1) for v, x in by_version.items()},
            "ratio_after_over_before": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "raw": by_version,
        }
    print(json.dumps(summary, indent=1))
    print(f"\n{'setting':<16} {'before ex/s':>12} {'after ex/s':>12} {'after/before':>13}")
    for setting, s in summary["settings"].items():
        e = s["examples_per_s"]
        print(f"{setting:<16} {e['before']:>12} {e['after']:>12} {s['ratio_after_over_before']:>13}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
