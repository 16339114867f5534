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
    code, log, _ = run_bounded(
        [
            sys.executable,
            str(bench),
            "--workers",
            "2",
            "--batch",
            "8",
            "--cost-ms",
            "0.05",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        timeout=120,
    )
    assert code == 0, log
    run = json.loads(out.read_text())["runs"]["2"]
    loaded = {name: v["loaded_per_step_per_worker"] for name, v in run["variants"].items()}
    assert loaded == {"auto": [4.0, 4.0], "off": [8.0, 8.0], "hand": [4.0, 4.0], "ddp": [4.0, 4.0]}
    assert set(run["ratios"]) == {"auto_vs_off", "auto_vs_hand", "auto_vs_ddp"}


def test_the_sharded_benchmarks_allocator_settings_become_the_workers_environment(monkeypatch):
    """benchmarks/sharded_model.py's --malloc grammar: each part sets its glibc variable, anything inherited from
    the caller is removed (a sweep's "default" must be glibc's default), and a mistyped setting is an error."""
    from sharded_model import TRIM_VARIABLE, allocator_env, worker_env

    assert allocator_env("default") == {}
    assert allocator_env("mmap") == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    assert allocator_env("mmap:4m+trim+arena:2") == {
        "MALLOC_MMAP_THRESHOLD_": str(4 << 20),
        TRIM_VARIABLE: "1",
        "MALLOC_ARENA_MAX": "2",
    }
    assert allocator_env("trimthr:512k+toppad:1m") == {
        "MALLOC_TRIM_THRESHOLD_": "524288",
        "MALLOC_TOP_PAD_": str(1 << 20),
    }
    assert allocator_env("mmap:128k+thp") == {
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    }
    for bad in ("mmap:lots", "arena", "tcmalloc", "trim:1", "jemalloc:soon"):
        with pytest.raises(ValueError, match="unknown allocator setting"):
            allocator_env(bad)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "999")
    monkeypatch.setenv("TF_CONFIG", "{}")
    env = worker_env("default")
    assert "MALLOC_MMAP_THRESHOLD_" not in env and "TF_CONFIG" not in env and env["OMP_NUM_THREADS"] == "1"
    assert worker_env("mmap:1m")["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)


def test_the_sharded_memory_benchmark_runs_both_strategies_and_shards_the_model(tmp_path):
    """benchmarks/sharded_memory.py, tiny (2 workers, 2 steps): MWMS and the sharded strategy both run, under the
    allocator setting asked for; MWMS workers hold every parameter, the sharded ones half each; the figures are
    positive and the ratio is the sharded peak over MWMS's."""
    import json

    from helpers import run_bounded
    from sharded_model import params

    out = tmp_path / "memory.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_memory.py"
    code, log, _ = run_bounded(
        [
            sys.executable,
            str(bench),
            "--workers",
            "2",
            "--malloc",
            "mmap",
            "--width",
            "256",
            "--blocks",
            "4",
            "--steps",
            "2",
            "--batch",
            "4",
            "--json",
            str(out),
        ],
        timeout=120,
    )
    assert code == 0, log
    summary = json.loads(out.read_text())
    total = params(256, 4)
    assert summary["params"] == total and set(summary["runs"]) == {"mmap/2"}
    run = summary["runs"]["mmap/2"]
    for name in ("mwms", "sharded"):
        workers = run[name]["workers"]
        assert [w["worker"] for w in workers] == [0, 1]
        assert all(w["allocator_env"] == {"MALLOC_MMAP_THRESHOLD_": "131072"} for w in workers), workers
        assert run[name]["peak_mb"] > 0 and run[name]["step_wall_s"] > 0 and run[name]["step_cpu_s"] > 0
        assert run[name]["peak_mb"] >= run[name]["steps_mb"]
    assert [w["local_params"] for w in run["mwms"]["workers"]] == [total, total]
    assert [w["local_params"] for w in run["sharded"]["workers"]] == [total // 2, total // 2]
    assert run["ratio_peak"] == round(run["sharded"]["peak_mb"] / run["mwms"]["peak_mb"], 3) > 0


def test_the_sharded_speed_benchmark_times_every_variant(tmp_path):
    """benchmarks/sharded_speed.py, tiny (2 workers, 2 steps, 1 round): distrib's sharded step, the direct
    fully_shard loop and MWMS all run and get positive rates, and the ratios are the rates' quotients."""
    import json

    from helpers import run_bounded

    out = tmp_path / "speed.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_speed.py"
    code, log, _ = run_bounded(
        [
            sys.executable,
            str(bench),
            "--width",
            "64",
            "--blocks",
            "2",
            "--batch",
            "4",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        timeout=120,
    )
    assert code == 0, log
    summary = json.loads(out.read_text())
    assert summary["variants"] == ["distrib", "direct", "mwms"] and set(summary["malloc"]) == {"default"}
    default = summary["malloc"]["default"]
    assert default["env"] == {}
    for kind in ("steps_per_s_wall", "steps_per_s_cpu_estimate"):
        assert set(default[kind]) == {"distrib", "direct", "mwms"} and min(default[kind].values()) > 0, default
    raw = summary["raw"]
    for kind, rates in (("ratios_wall", "wall"), ("ratios_cpu_estimate", "cpu_estimate")):
        assert set(default[kind]) == {"distrib_vs_direct", "distrib_vs_mwms"}
        for other in ("direct", "mwms"):
            expected = raw["distrib/default"][rates][0] / raw[f"{other}/default"][rates][0]
            assert default[kind][f"distrib_vs_{other}"] == pytest.approx(expected, abs=1e-3) and expected > 0
    assert default["distrib_outside_step_fn_ms"] >= 0


def test_the_sharded_checkpoint_benchmark_compares_both_formats(tmp_path):
    """benchmarks/sharded_checkpoint.py, tiny (2 workers, 1 round): both formats write and read; the sharded one
    is written by both workers, the plain one by the chief alone; the figures are positive."""
    import json

    from helpers import run_bounded

    out = tmp_path / "ckpt.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_checkpoint.py"
    code, log, _ = run_bounded(
        [sys.executable, str(bench), "--width", "64", "--blocks", "2", "--rounds", "1", "--json", str(out)], timeout=120
    )
    assert code == 0, log
    summary = json.loads(out.read_text())
    assert summary["params"] == 2 * (64 * 64 + 64) and set(summary["variants"]) == {"sharded", "plain"}
    sharded, plain = summary["variants"]["sharded"], summary["variants"]["plain"]
    assert min(sharded["written_mb_per_worker"]) > 0  # every worker wrote its own shards
    assert plain["written_mb_per_worker"][0] > 0 and plain["written_mb_per_worker"][1] == 0  # the chief alone
    assert all(row[k] > 0 for row in (sharded, plain) for k in ("save_s", "restore_s"))


def test_the_launch_start_benchmark_compares_the_start_methods(tmp_path):
    """benchmarks/launch_start.py, tiny (1 worker, 1 round): a launch each way (its own fork server, fresh, a shared
    server), each with its figures, and the ratios and the table; the shared server stopped, its CPU read. (That a
    forked task finds torch imported is tests/cluster/test_forkserver.py's.)"""
    import json

    from helpers import run_bounded

    out = tmp_path / "start.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_start.py"
    code, log, _ = run_bounded(
        [sys.executable, str(bench), "--workers", "1", "--rounds", "1", "--json", str(out)], timeout=120
    )
    assert code == 0, log
    run = json.loads(out.read_text())["workers"]["1"]
    for method in ("forkserver", "spawn", "shared"):
        (launch,) = run["launches"][method]
        assert launch["wall_s"] > 0 and launch["cpu_s"] > 0 and len(launch["task_cpu_s"]) == 1, launch
    assert set(run["forkserver_vs_spawn"]) == set(run["shared_vs_forkserver"]) == {"wall_s", "cpu_s"}
    assert json.loads(out.read_text())["shared_server_cpu_s"] > 0.5  # it imported torch
    assert "forkserver" in log and "spawn" in log and "shared" in log  # the table


def test_the_keras_benchmark_runs_every_variant(tmp_path):
    """benchmarks/keras_step.py, tiny (1 round of 1 step): every variant trains and the targets' ratios are there."""
    import json

    pytest.importorskip("keras")
    from conftest import make_idx_dir
    from helpers import run_bounded

    out = tmp_path / "keras.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "keras_step.py"
    data = make_idx_dir(tmp_path / "data")
    code, log, _ = run_bounded(
        [sys.executable, str(bench), "--rounds", "1", "--steps", "1", "--warmup", "1", "--data-dir", str(data)]
        + ["--json", str(out)],
        timeout=120,
    )
    assert code == 0, log
    result = json.loads(out.read_text())
    assert result["data"] == "fashion-mnist"
    rates = result["examples_per_s_median"]
    assert set(rates) == {"main_job", "keras_mirrored", "keras_mirrored_fused_adam", "keras_plain", "keras_fit"}
    assert all(rate > 0 for rate in rates.values())
    assert {"keras_mirrored_vs_keras_fit", "keras_mirrored_vs_keras_plain"} <= set(result["ratios_per_round_median"])
