"""benchmarks/preemption.py's overhead run works end to end (tiny here; its figures are in docs/multi-node.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import preemption as bench  # noqa: E402


def test_the_overhead_benchmark_times_each_way_and_run_costs_next_to_nothing():
    result = bench.overhead(steps=5, rounds=1)
    assert set(result["ms_per_step"]) == {"plain", "handler", "flag_allreduce"}
    assert result["ratio_to_plain"]["plain"] == 1.0 and all(v > 0 for v in result["ms_per_step"].values())
    # run() around an empty function: an attribute read and a call (~0.5 us); a store request or a collective
    # per call would cost tens of microseconds at least
    assert result["run_call_cost_us"] < 20
