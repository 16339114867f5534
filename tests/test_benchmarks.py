"""The figures docs/performance.md derives from benchmarks/flop_ceiling.py rest on a FLOP count that is checked here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_main_job_step_has_the_flops_its_layers_imply():
    from flop_ceiling import step_flops

    flops = step_flops()
    conv1 = 2 * 64 * 32 * 26 * 26 * 9  # batch 64, 1 -> 32 channels, 3x3, 26x26 outputs
    conv2 = 2 * 64 * 64 * 11 * 11 * 32 * 9  # 32 -> 64 channels, 11x11 outputs
    dense1, dense2 = 2 * 64 * 1600 * 64, 2 * 64 * 64 * 10
    assert flops["convolution"] == conv1 + conv2
    # backward: conv 2's input and weight gradients, conv 1's weight gradient only (its input needs none)
    assert flops["convolution_backward"] == 2 * conv2 + conv1
    assert flops["addmm"] == dense1 + dense2
    assert flops["mm"] == 2 * (dense1 + dense2)
    assert sum(flops.values()) == pytest.approx(945.8e6, rel=1e-4)


def test_the_input_benchmark_runs_and_each_sharded_worker_loads_half(tmp_path):
    """benchmarks/input_sharding.py, tiny (2 workers, 2 steps, 1 round): it runs every variant, and the loads it
    reports are the policies' (auto and the hand-sharded pipelines load half a global batch per worker, off all)."""
    import json

    from helpers import run_bounded  # kills the benchmark's worker processes too, whatever happens

    out = tmp_path / "input.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "input_sharding.py"
    code, log, _ = run_bounded([sys.executable, str(bench), "--workers", "2", "--batch", "8", "--cost-ms", "0.05",
                                "--steps", "2", "--rounds", "1", "--json", str(out)], timeout=120)
    assert code == 0, log
    run = json.loads(out.read_text())["runs"]["2"]
    loaded = {name: v["loaded_per_step_per_worker"] for name, v in run["variants"].items()}
    assert loaded == {"auto": [4.0, 4.0], "off": [8.0, 8.0], "hand": [4.0, 4.0], "ddp": [4.0, 4.0]}
    assert set(run["ratios"]) == {"auto_vs_off", "auto_vs_hand", "auto_vs_ddp"}
