"""TF's parameter-server tutorial (custom loop, metrics, distributed evaluation), translated in
examples/ps_training_tutorial.py, runs on an in-process cluster and under `distrib launch`; its output is printed."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from helpers import launch, run_bounded

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ps_training_tutorial.py"


def _check(out: str, epochs: int) -> None:
    accuracies = [float(a) for a in re.findall(r"Finished epoch \d+, accuracy is ([0-9.]+)\.", out)]
    assert len(accuracies) == epochs and all(0.0 <= a <= 1.0 for a in accuracies), out
    assert re.search(r"Final loss is [0-9.]+", out), out
    assert len(re.findall(r"Evaluation accuracy: [0-9.]+", out)) == 2, out
    # the distributed evaluation's metric saw exactly its 2 scheduled steps of 8 examples
    assert "= 16 examples, each completed step once" in out, out


def test_the_tutorial_runs_on_an_in_process_cluster():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TF_CONFIG", None)
    code, out, _ = run_bounded(
        [sys.executable, str(EXAMPLE), "--epochs", "3", "--steps-per-epoch", "4"], timeout=240, env=env
    )
    print(out)
    assert code == 0, out[-3000:]
    _check(out, epochs=3)


def test_the_tutorial_runs_under_distrib_launch_with_a_process_per_task():
    code, out, _ = launch(
        "--workers", "2", "--ps", "2", str(EXAMPLE), "--epochs", "2", "--steps-per-epoch", "3", timeout=300
    )
    print(out)
    assert code == 0, out[-3000:]
    _check("\n".join(line.removeprefix("[chief 0] ") for line in out.splitlines()), epochs=2)
