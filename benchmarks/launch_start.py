"""What a task of ``distrib launch`` costs to start: the fork server (the default) against a fresh python per task.

    python benchmarks/launch_start.py [--workers 1 2 4] [--rounds 5] [--json out.json]

Each round launches a probe script under ``--start-method forkserver`` and ``--start-method spawn``, in an order
that alternates from round to round. The probe imports torch, builds a small model and an Adam optimizer (torch
imports ``torch._dynamo`` there, for plain PyTorch too), writes its own CPU time, and exits: what every training
task does before its first step. Per launch:

- ``wall_s``: from starting the launcher to its exit;
- ``cpu_s``: the CPU-seconds of the launcher and of everything it started (this process's ``RUSAGE_CHILDREN``
  across the launch: the launcher is reaped here, and it reaps the fork server and the tasks, its children);
- ``task_cpu_s``: each task's own CPU-seconds when its optimizer is built (a forked task counts from its fork).

Reports the medians over rounds, and the forkserver/spawn ratios taken within each round (a loaded machine's
drift falls on both alike). Prints a JSON object and a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from preemption import run_launch  # distrib launch, bounded (this directory is sys.path[0])

METHODS = ("forkserver", "spawn")
PROBE = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    torch.optim.Adam(model.parameters())  # imports torch._dynamo, as every first optimizer does
    usage = resource.getrusage(resource.RUSAGE_SELF)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(os.path.join(sys.argv[1], f"task{task}.json"), "w") as f:
        json.dump({"cpu_s": usage.ru_utime + usage.ru_stime}, f)
    """
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch_once(workdir: Path, method: str, workers: int, timeout: float = 180) -> dict[str, Any]:
    """One ``distrib launch --workers N --start-method METHOD probe.py``: its wall time, CPU and the tasks' CPU."""
    script = workdir / "probe.py"
    if not script.exists():
        script.write_text(PROBE)
    out = Path(tempfile.mkdtemp(prefix=f"{method}-{workers}-", dir=workdir))
    before, started = _children_cpu(), time.monotonic()
    code, log = run_launch(["--workers", str(workers), "--start-method", method, str(script), str(out)], timeout)
    wall, cpu = time.monotonic() - started, _children_cpu() - before
    if code != 0:
        raise RuntimeError(f"a {method} launch of {workers} failed ({code}):\n{log}")
    tasks = [json.loads((out / f"task{i}.json").read_text())["cpu_s"] for i in range(workers)]
    return {"wall_s": wall, "cpu_s": cpu, "task_cpu_s": tasks}


def run(workers: list[int], rounds: int, workdir: Path) -> dict[str, Any]:
    """Every worker count, ``rounds`` rounds each, both methods per round in alternating order."""
    results: dict[str, Any] = {}
    for n in workers:
        launches: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for r in range(rounds):
            for method in METHODS if r % 2 == 0 else METHODS[::-1]:
                launches[method].append(launch_once(workdir, method, n))
        medians = {
            m: {
                "wall_s": statistics.median(x["wall_s"] for x in runs),
                "cpu_s": statistics.median(x["cpu_s"] for x in runs),
                "task_cpu_s": statistics.median(t for x in runs for t in x["task_cpu_s"]),
            }
            for m, runs in launches.items()
        }
        ratios = {
            key: statistics.median(f[key] / s[key] for f, s in zip(launches["forkserver"], launches["spawn"]))
            for key in ("wall_s", "cpu_s")
        }
        results[str(n)] = {"medians": medians, "forkserver_vs_spawn": ratios, "launches": launches}
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'workers':>7} {'method':>10} {'wall s':>7} {'CPU s':>7} {'task CPU s':>10} | forkserver/spawn wall, CPU",
    ]
    for n, r in results.items():
        for m in METHODS:
            med = r["medians"][m]
            ratio = (
                f" | {r['forkserver_vs_spawn']['wall_s']:.2f}, {r['forkserver_vs_spawn']['cpu_s']:.2f}"
                if m == "forkserver"
                else ""
            )
            lines.append(f"{n:>7} {m:>10} {med['wall_s']:7.2f} {med['cpu_s']:7.2f} {med['task_cpu_s']:10.3f}{ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the JSON object here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="launch-start-") as tmp:
        results = {
            "cpus": len(os.sched_getaffinity(0)),
            "load_before": os.getloadavg()[0],
            "rounds": args.rounds,
            "workers": run(args.workers, args.rounds, Path(tmp)),
        }
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    print(table(results["workers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
