"""``bash scripts/gpu_check.sh --dry-run``: the prepared GPU check, proven on the CPU so that it cannot rot.

It must pass; the CUDA tests must have run on the CPU (counted from the junit XML, not all skipped);
the benchmark JSON must hold every variant with a positive examples/s, the overheads, and the
2-process run. (Here, not in tests/scripts/: that folder holds helper scripts and is not collected.)
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import run_bounded

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_passes_runs_the_cuda_tests_on_the_cpu_and_benchmarks_every_variant(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DISTRIB_CHECK_DEVICE"}
    env["OUT"] = str(tmp_path)
    code, text, took = run_bounded(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], timeout=330, env=env)
    assert code == 0, text[-6000:]
    assert "DRY RUN on the CPU" in text and "=== summary" in text and "FAIL" not in text.split("=== summary")[1], text

    suite = ET.parse(tmp_path / "cuda-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    assert int(suite.get("failures", 0)) == 0 and int(suite.get("errors", 0)) == 0
    assert tests >= 15 and tests - skipped >= 12, (tests, skipped)  # most ran on the CPU; NCCL/pinned skip there

    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert not result["failed"], result["failed"]
    rates = result["examples_per_s_median"]
    for prec in ("fp32", "bf16", "fp16"):
        for kind in ("plain_eager", "plain_same_step", "default", "one_device", "mirrored"):
            assert rates[f"{kind}/{prec}/eager/b8"] > 0
    for kind in ("plain_eager", "plain_same_step", "default", "one_device", "mirrored"):
        assert rates[f"{kind}/fp32/compiled/b8"] > 0 and rates[f"{kind}/fp32/eager/b32"] > 0
    assert all(v is not None for v in result["overhead_us_per_step_vs_plain_same_step"].values())
    assert set(result["dispatch_overhead"]["overhead_us_per_call"]) == {"default", "one_device", "mirrored"}
    assert result["dispatch_overhead"]["bare_us_per_call"] > 0
    assert result["multi_worker_2_processes_one_device"]["examples_per_s_median"] > 0
    assert result["multi_worker_2_processes_one_device"]["backend"] == "gloo"
    function = json.loads((tmp_path / "function-benchmark.json").read_text())
    assert not function["failed"], function["failed"]
    assert function["ratios"]["function_vs_one_device_eager"] > 0
    table = [json.loads(line) for line in (tmp_path / "function-table.jsonl").read_text().splitlines()]
    assert {row["feature"] for row in table} >= {"plain", "accumulate", "checkpoint", "fp16_fused"}, table
    for name in ("gpu_check.log", "env.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
