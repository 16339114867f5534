"""Fault tolerance: its cost per step when nothing fails, the time from a fault to the next applied step, goodput.

    python benchmarks/fault_tolerance.py [--workers 3] [--steps 60] [--rounds 6] [--trials 2] [--seed 0]
                                         [--width 256] [--json out.json]

Every run is ``distrib launch`` of ``tests/scripts/ft_train.py`` (an MLP of two hidden layers of ``--width``,
SGD with momentum, global batch 24, one gradient bucket), over gloo on loopback; a 1 s timeout where faults are
made, 30 s elsewhere (the plain strategy's join and first broadcast wait that long for workers that start late).

``overhead``: ``--rounds`` rounds, each one run with ``fault_tolerant=False`` and one with ``True``, in an order
that alternates between rounds; a run's step time is the median interval between worker 0's applied steps
after the first 5. Reports each kind's median and the median of the within-round ratios.

``faults``: ``--trials`` runs per fault kind (``kill``: SIGKILL before its step; ``kill-in-allreduce``: SIGKILL
inside the gradient all-reduce; ``stop``: SIGSTOP, continued 4 s later) of worker ``--workers - 1`` at a step
drawn with ``--seed``: the time from the fault to the survivors' next applied step, the largest parameter
difference to the fault-free run (a plain run of the same steps), and whether the survivors kept their pids.

``goodput``: ``--workers + 1`` workers, two of them SIGKILLed at drawn steps, against a fault-tolerant run of the
same size without faults: examples applied per second (the whole global batch counts at every step) over the
time from the first applied step to the last. On this 2-core machine the survivors compute on fewer processes
sharing the same cores, so a step after a fault is not slower, as it would be on a cluster of one core each.

Prints a JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "ft_train.py")
GLOBAL_BATCH = 24


def run_launch(args: list[str], timeout: float = 300) -> str:
    """``distrib launch ARGS`` in its own session, killed as a whole if it overruns; its output (exit 0 required)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrib.app.cli", "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"distrib launch {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}")
    return out


def applied(out: str, worker: int | None = None) -> dict[int, float]:
    """Step -> the first time a worker (or ``worker``) printed it applied."""
    times: dict[int, float] = {}
    for w, step, t in re.findall(r"\[worker (\d+)\] applied (\d+) at ([\d.]+)", out):
        if worker is None or int(w) == worker:
            times.setdefault(int(step), float(t))
    return times


def step_seconds(out: str, worker: int = 0, skip: int = 5) -> float:
    times = applied(out, worker)
    steps = sorted(times)[skip:]
    return statistics.median(times[b] - times[a] for a, b in zip(steps, steps[1:]))


def run(workdir: Path, name: str, workers: int, common: list[str], *extra: str, ft: bool = True) -> tuple[str, Path]:
    out_dir = workdir / name
    flags = ["--workers", str(workers)] + (["--fault-tolerant"] if ft else [])
    return run_launch([*flags, SCRIPT, "--out", str(out_dir), *common, *extra, *([] if ft else ["--plain"])]), out_dir


def largest_difference(a: Path, b: Path) -> float:
    import torch

    x, y = torch.load(a), torch.load(b)
    return max(float((p - q).abs().max()) for p, q in zip(x, y))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rng = random.Random(a.seed)
    common = ["--steps", str(a.steps), "--width", str(a.width), "--bucket-bytes", "0"]
    slow = [*common, "--timeout", "30"]  # the plain strategy's join and first broadcast wait this long for slow starts
    common = [*common, "--timeout", "1"]
    result: dict[str, Any] = {"workers": a.workers, "steps": a.steps, "width": a.width, "global_batch": GLOBAL_BATCH}
    with tempfile.TemporaryDirectory(prefix="fault-tolerance-") as tmp:
        work = Path(tmp)
        # overhead: alternating rounds
        plain_s, ft_s, ratios = [], [], []
        for r in range(a.rounds):
            times = {}
            for ft in (r % 2 == 0, r % 2 == 1):
                out, _ = run(work, f"over-{r}-{ft}", a.workers, slow, ft=ft)
                times[ft] = step_seconds(out)
            plain_s.append(times[False])
            ft_s.append(times[True])
            ratios.append(times[True] / times[False])
            print(f"round {r}: {times}", file=sys.stderr)
        result["overhead"] = {
            "plain_step_ms": round(1e3 * statistics.median(plain_s), 3),
            "fault_tolerant_step_ms": round(1e3 * statistics.median(ft_s), 3),
            "ratio_median": round(statistics.median(ratios), 4),
            "ratios": [round(x, 4) for x in ratios],
        }
        # faults against the fault-free run
        _, reference = run(work, "reference", a.workers, slow, ft=False)
        faults: dict[str, Any] = {}
        for kind in ("kill", "kill-in-allreduce", "stop"):
            trials = []
            for t in range(a.trials):
                at = rng.randint(3, a.steps - 3)
                out, where = run(work, f"{kind}-{t}", a.workers, common, "--fault", kind, "--at", str(at))
                found = re.search(r"fault at ([\d.]+)", out)
                if found is None:
                    raise RuntimeError(f"no fault was made ({kind} at step {at}):\n{out[-4000:]}")
                fault = float(found.group(1))
                print(f"{kind} at {at}: next step after {applied(out)[at] - fault:.3f}s", file=sys.stderr)
                started = dict(re.findall(r"start: worker (\d+) pid (\d+)", out))
                done = dict(re.findall(r"done: worker (\d+) pid (\d+)", out))
                trials.append(
                    {
                        "at": at,
                        "fault_to_next_applied_s": round(applied(out)[at] - fault, 3),
                        "largest_difference": max(
                            largest_difference(where / f"worker-{w}.pt", reference / "worker-0.pt") for w in done
                        ),
                        "survivor_restarts": sum(started[w] != pid for w, pid in done.items()),
                    }
                )
            waits = [x["fault_to_next_applied_s"] for x in trials]
            faults[kind] = {"median_s": statistics.median(waits), "worst_s": max(waits), "trials": trials}
        result["faults"] = faults
        # goodput: two faults in a run of workers + 1
        n = a.workers + 1
        first, second = sorted(rng.sample(range(3, a.steps - 3), 2))
        clean, _ = run(work, "goodput-clean", n, common)
        faulty, _ = run(
            work,
            "goodput-faults",
            n,
            common,
            "--fault",
            "kill",
            "--at",
            str(first),
            "--victim",
            str(n - 1),
            "--then",
            f"{n - 2}:{second}",
        )
        rates = {}
        for name, out in (("fault_free", clean), ("two_faults", faulty)):
            times = applied(out)
            seconds = max(times.values()) - min(times.values())
            rates[name] = GLOBAL_BATCH * (len(times) - 1) / seconds
        result["goodput"] = {
            "workers": n,
            "faults_at": [first, second],
            "examples_per_s": {k: round(v, 1) for k, v in rates.items()},
            "ratio": round(rates["two_faults"] / rates["fault_free"], 4),
        }
    print(json.dumps(result, indent=1))
    o, f, g = result["overhead"], result["faults"], result["goodput"]
    print("\n| measure | value |\n|---|---|")
    print(f"| step, fault_tolerant=False | {o['plain_step_ms']} ms |")
    print(f"| step, fault_tolerant=True | {o['fault_tolerant_step_ms']} ms |")
    print(f"| overhead (median within-round ratio) | {100 * (o['ratio_median'] - 1):+.1f} % |")
    for kind, v in f.items():
        worst = max(t["largest_difference"] for t in v["trials"])
        print(
            f"| {kind}: fault to next applied step | median {v['median_s']} s, worst {v['worst_s']} s; "
            f"largest difference {worst:.1e} |"
        )
    print(f"| goodput, {g['workers']} workers, 2 faults | {100 * g['ratio']:.1f} % of the fault-free run |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
