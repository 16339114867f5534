"""Cancellation on a loaded machine, in real processes: once a scheduled function's error is visible on the
coordinator (its ``fetch()`` raises), no function queued after it starts, on any worker.

``distrib launch --workers 3 --ps 2`` runs the probe below as the chief while busy processes load every CPU. Each
trial schedules two sleeping functions, one that raises, then four more that sleep, on idle workers; the two
sleeping ones end ``margin`` seconds after the raising one raises, so that a worker holding a function for later
(sent ahead while its current one runs) reaches the end of its current one close to when the error arrives: the
window in which a queued function could start after the coordinator has recorded the error. Each function notes
its start with ``time.monotonic()`` (one clock for every process of the host); the coordinator notes when
``fetch()`` of the raising function raised. A queued function that started after that is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import launch

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    import distrib as ds
    from distrib.parameter_server.errors import ClosureCancelledError

    out, repeats = sys.argv[1], int(sys.argv[2])
    log = os.path.join(out, "events")
    RAISE_AFTER = 0.1
    MARGINS = (0.002, 0.004, 0.008, 0.016, 0.3)  # 0.3: test_cancellation.py's probe

    def note(line):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line} {time.monotonic():.6f}\\n".encode())
        finally:
            os.close(fd)

    def sleeper(tag, seconds):
        note(f"start {tag}")
        time.sleep(seconds)
        return tag

    def raiser(tag, seconds):
        note(f"start {tag}")
        time.sleep(seconds)
        note(f"raise {tag}")
        raise ValueError(f"function {tag} failed")

    strategy = ds.ParameterServerStrategy(ds.cluster_resolver.TFConfigClusterResolver())
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    coordinator.join()
    trials = []
    for n in range(repeats):
        for margin in MARGINS:
            trial = f"t{n}m{int(margin * 1000)}"
            deadline = time.monotonic() + 30
            while set(coordinator.worker_states().values()) != {"idle"} and time.monotonic() < deadline:
                time.sleep(0.01)
            sleeping = [coordinator.schedule(sleeper, args=(f"{trial}s{i}", RAISE_AFTER + margin)) for i in range(2)]
            failing = coordinator.schedule(raiser, args=(f"{trial}r", RAISE_AFTER))
            queued = [coordinator.schedule(sleeper, args=(f"{trial}q{i}", 0.2)) for i in range(4)]
            try:
                failing.fetch(timeout=60)
            except ValueError:
                seen = time.monotonic()
            outcomes = []
            for value in queued:
                try:
                    outcomes.append(value.fetch(timeout=60))
                except ClosureCancelledError:
                    outcomes.append("cancelled")
            try:
                coordinator.join(timeout=60)
            except ValueError:
                pass
            trials.append({"trial": trial, "margin": margin, "seen": seen, "outcomes": outcomes})
    with open(os.path.join(out, "trials.json"), "w") as f:
        json.dump(trials, f)
    coordinator.close()
    """
)

SPINNER = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"


def _events(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    return {f"{kind} {tag}": float(t) for kind, tag, t in (line.split() for line in path.read_text().splitlines())}


def _run_probe(tmp_path: Path, repeats: int, load: int) -> tuple[list[dict], dict[str, float], str]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPINNER], start_new_session=True) for _ in range(load)
    ]  # the load: a busy process per CPU
    try:
        code, log, _ = launch(
            "--workers",
            "3",
            "--ps",
            "2",
            "--start-method",
            "forkserver",
            str(script),
            str(out),
            str(repeats),
            timeout=240,
        )
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert code == 0, log
    return json.loads((out / "trials.json").read_text()), _events(out / "events"), log


def test_no_queued_function_starts_after_the_error_is_visible_under_load(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    trials, events, log = _run_probe(tmp_path, repeats=3, load=cpus)
    late, started, report = [], [], []
    for t in trials:
        trial, seen = t["trial"], t["seen"]
        raised = events[f"raise {trial}r"]
        starts = {i: events.get(f"start {trial}q{i}") for i in range(4)}
        ran = [i for i, s in starts.items() if s is not None]
        after = [i for i in ran if starts[i] > seen]
        started.append(len(ran))
        late.append(len(after))
        report.append(
            f"{trial}: error raised on its worker -> visible {1000 * (seen - raised):.1f} ms; queued ones started "
            f"{[f'q{i} {1000 * (starts[i] - raised):+.1f} ms' for i in ran]}; after visible {after}; {t['outcomes']}"
        )
        for i, outcome in enumerate(t["outcomes"]):  # a queued function that did not start was cancelled
            assert (outcome == f"{trial}q{i}") == (starts[i] is not None), report[-1]
    print("\n".join(report))
    for margin in sorted({t["margin"] for t in trials}):
        group = [i for i, t in enumerate(trials) if t["margin"] == margin]
        print(
            f"margin {1000 * margin:g} ms, {len(group)} trials, {cpus} busy processes: a queued function started in "
            f"{sum(started[i] > 0 for i in group)} ({sum(started[i] for i in group)} functions), after the error "
            f"was visible in {sum(late[i] > 0 for i in group)} ({sum(late[i] for i in group)} functions)"
        )
    assert sum(late) == 0, "\n".join(report)
