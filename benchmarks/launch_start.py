"""What a task of ``distrib launch`` costs to start: the fork server (opt-in) against a fresh python per task (the
default), and against a shared fork server (``DISTRIB_FORK_SERVER_DIR``: :mod:`distrib.cluster.shared_forkserver`).

    python benchmarks/launch_start.py [--workers 1 2 4] [--rounds 5] [--json out.json]

Each round launches a probe script under ``--start-method forkserver``, ``--start-method spawn`` and the shared
server (``shared``: warmed up by one launch first), in an order that alternates from round to round. The probe imports torch, builds a small model and an Adam optimizer (torch
imports ``torch._dynamo`` there, for plain PyTorch too), writes its own CPU time, and exits: what every training
task does before its first step. Per launch:

- ``wall_s``: from starting the launcher to its exit;
- ``cpu_s``: the CPU-seconds of the launcher and of everything it started (this process's ``RUSAGE_CHILDREN``
  across the launch: the launcher is reaped here, and it reaps the fork server and the tasks, its children);
- ``task_cpu_s``: each task's own CPU-seconds when its optimizer is built (a forked task counts from its fork).

A shared server is no launch's child, nor are its tasks: a ``shared`` launch's ``cpu_s`` is its launcher's alone,
and the server's CPU is read from /proc at the end (``shared_server_cpu_s``: its start, and its sessions and the
tasks they forked, which it reaped, over the whole run). Reports the medians over rounds, and the forkserver/spawn
and shared/forkserver ratios taken within each round (a loaded machine's drift falls on both alike). Prints a JSON
object and a short table.
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

METHODS = ("forkserver", "spawn", "shared")
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
    env = {k: v for k, v in os.environ.items() if k != "DISTRIB_FORK_SERVER_DIR"}  # the default, unless asked
    if method == "shared":
        env["DISTRIB_FORK_SERVER_DIR"] = str(workdir / "servers")
    start_method = "spawn" if method == "spawn" else "forkserver"
    before, started = _children_cpu(), time.monotonic()
    code, log = run_launch(
        ["--workers", str(workers), "--start-method", start_method, str(script), str(out)], timeout, env
    )
    wall, cpu = time.monotonic() - started, _children_cpu() - before
    if code != 0:
        raise RuntimeError(f"a {method} launch of {workers} failed ({code}):\n{log}")
    tasks = [json.loads((out / f"task{i}.json").read_text())["cpu_s"] for i in range(workers)]
    return {"wall_s": wall, "cpu_s": cpu, "task_cpu_s": tasks}


def run(workers: list[int], rounds: int, workdir: Path) -> dict[str, Any]:
    """Every worker count, ``rounds`` rounds each, both methods per round in alternating order."""
    results: dict[str, Any] = {}
    launch_once(workdir, "shared", 1)  # the shared server's start, measured apart (shared_server_cpu_s)
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
        shared = {
            key: statistics.median(h[key] / f[key] for h, f in zip(launches["shared"], launches["forkserver"]))
            for key in ("wall_s", "cpu_s")
        }
        results[str(n)] = {
            "medians": medians,
            "forkserver_vs_spawn": ratios,
            "shared_vs_forkserver": shared,
            "launches": launches,
        }
    return results


def stop_shared(workdir: Path) -> float:
    """Stop the shared server(s) of ``workdir``; the CPU-seconds they used (from /proc, before the stop)."""
    from distrib.cluster.shared_forkserver import stop_servers

    cpu = 0.0
    for pid_file in (workdir / "servers").glob("*.pid"):
        try:
            fields = Path(f"/proc/{int(pid_file.read_text())}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        cpu += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    stop_servers(str(workdir / "servers"))
    return cpu


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'workers':>7} {'method':>10} {'wall s':>7} {'CPU s':>7} {'task CPU s':>10} | vs spawn (forkserver), "
        "vs forkserver (shared): wall, CPU",
    ]
    for n, r in results.items():
        for m in METHODS:
            med = r["medians"][m]
            against = {"forkserver": "forkserver_vs_spawn", "shared": "shared_vs_forkserver"}.get(m)
            ratio = f" | {r[against]['wall_s']:.2f}, {r[against]['cpu_s']:.2f}" if against else ""
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
        results["shared_server_cpu_s"] = stop_shared(Path(tmp))
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    print(table(results["workers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
