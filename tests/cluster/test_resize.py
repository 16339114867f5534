"""Jobs that change size (issue 11, item 7), with real workers.

Global batches and the data position are global and gradients are summed, so the math does not
depend on the number of workers: ``tests/scripts/resize_train.py`` stopped on 2 workers, resumed on
3, stopped again and finished on 1 ends with an uninterrupted run's parameters up to float rounding.
The tolerance is float rounding, 8 float32 ulps of each tensor's largest value: the sums over
1, 2 or 3 workers add the same numbers in different orders, and an uninterrupted 2-worker run
already differs from a one-process run by 3.5 such ulps (1.19e-7 at a largest value of 0.57).
``distrib launch --workers MIN:MAX`` (``LaunchConfig(min_workers=MIN, workers=MAX)``) makes it
automatic when a worker is lost: the job continues on the survivors from the last checkpoint.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import SCRIPTS
from scripts.torchrun_processes import clean_env, run_job

from distrib.cluster.launch import LaunchConfig, parse_workers

ULPS = 8  # float rounding: 8 units in the last place of each tensor's largest value (float32)
SCRIPT = str(SCRIPTS / "resize_train.py")


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def max_ulps(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference in float32 ulps of the tensor's largest value (the scale its rounding errors have)."""

    def ulp(t: torch.Tensor) -> torch.Tensor:
        top = t.abs().max()
        return torch.nextafter(top, torch.tensor(float("inf"))) - top

    return max(float((x - y).abs().max() / ulp(y)) for x, y in zip(a, b))


def assert_rounding_only(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    difference, ulps = max_difference(a, b), max_ulps(a, b)
    print(f"RESIZE {what}: max parameter difference {difference:.3g} ({ulps:.1f} float32 ulps)")
    assert ulps <= ULPS, f"{what}: {difference} ({ulps} ulps) is more than float rounding"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[torch.Tensor]:
    """3 epochs (24 steps) in one plain process, never stopped."""
    directory = tmp_path_factory.mktemp("reference")
    code, out, _ = run_job(
        [sys.executable, SCRIPT, "--out", str(directory / "out")], directory / "log", timeout=120, env=clean_env()
    )
    assert code == 0, out
    return torch.load(directory / "out")


def launched(tmp_path, name: str, workers: str, *args: str, max_restarts: int = 0) -> tuple[int, str]:
    """``distrib launch --workers WORKERS --max-restarts R resize_train.py ARGS`` (WORKERS: ``N`` or ``MIN:MAX``)."""
    command = [
        sys.executable,
        "-m",
        "distrib",
        "launch",
        "--workers",
        workers,
        "--max-restarts",
        str(max_restarts),
        str(SCRIPT),
        *args,
    ]
    returncode, out, left = run_job(command, tmp_path / f"{name}.log", timeout=180, env=clean_env())
    assert returncode is not None and not left, out
    return returncode, out


def test_stopped_on_2_resumed_on_3_finished_on_1_equals_the_uninterrupted_run(tmp_path, reference):
    common = ["--out", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    code, out = launched(tmp_path, "two", "2", *common, "--stop-at", "7")
    assert code == 0 and "step 7 on 2 workers" in out and "stopped after step 7" in out, out
    code, out = launched(tmp_path, "three", "3", *common, "--stop-at", "15")
    assert code == 0 and "resumed at step 8 on 3 workers" in out and "step 15 on 3 workers" in out, out
    code, out = launched(tmp_path, "one", "1", *common)
    assert code == 0 and "resumed at step 16 on 1 workers" in out and "step 23 on 1 workers" in out, out
    assert_rounding_only(
        torch.load(tmp_path / "out"),
        reference,
        "2 -> 3 -> 1 workers (stopped after steps 7 and 15 of 24) vs the uninterrupted run",
    )


def test_launch_min_max_continues_on_the_survivors_when_a_worker_is_killed(tmp_path, reference):
    """``--workers 2:3``: worker 1 of 3 is SIGKILLed before step 10 and does not come back. The launcher
    restarts the job on the 2 survivors, which resume at step 10 from the checkpoint and finish with the
    unresized run's parameters (float rounding), equal on both."""
    code, out = launched(
        tmp_path,
        "elastic",
        "2:3",
        "--out",
        str(tmp_path / "out"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--die-at",
        "10",
        "--die-rank",
        "1",
        "--die-once",
        str(tmp_path / "died"),
        "--all-ranks",
    )
    assert code == 0, out
    assert "rank 1 dies before step 10" in out and "worker 1 failed with exit code 137" in out, out
    assert "worker 1 is lost: continuing on the 2 surviving worker(s) (--workers 2:3)" in out, out
    # step 9's line may be lost: worker 0 prints it after the step, and the launcher may stop it first, once worker 1
    # has died; step 8's was printed before worker 1 could finish step 9. Resuming at 10 shows step 9 was saved
    assert "step 8 on 3 workers" in out and "resumed at step 10 on 2 workers" in out, out
    assert "step 23 on 2 workers" in out and "done: worker 1 of 2" in out and "of 3" not in out.split("resumed")[1]
    ranks = [torch.load(tmp_path / f"out.{r}") for r in (0, 1)]
    assert max_difference(*ranks) == 0.0
    assert_rounding_only(
        ranks[0], reference, "launch --workers 2:3, worker 1 killed before step 10, finished on 2, vs the unresized run"
    )


def test_launch_min_max_fails_when_fewer_than_min_would_remain(tmp_path):
    """``--workers 2:2``: a worker that fails cannot be dropped; without restarts left the job fails with its code."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import json, os, sys, time\n"
        "sys.exit(7) if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 0 else time.sleep(60)\n"
    )
    code = (
        "import sys\nfrom distrib.cluster.launch import LaunchConfig, launch\n"
        f"sys.exit(launch(LaunchConfig(command=[{str(script)!r}], workers=2, min_workers=2, grace_seconds=2)))\n"
    )
    returncode, out, left = run_job([sys.executable, "-c", code], tmp_path / "log", timeout=60, env=clean_env())
    assert returncode == 7 and not left, out
    assert "fewer than 2 worker(s) would remain: the job fails" in out and out.count("starting 2 task(s)") == 1, out


def test_workers_ranges_are_parsed_and_checked():
    assert parse_workers("3") == (3, 3) and parse_workers("1:4") == (1, 4)
    for bad in ("0", "3:2", "a:b", "2:", ":2", "0:2"):
        with pytest.raises(ValueError, match="--workers"):
            parse_workers(bad)
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        LaunchConfig(command=["x.py"], workers=2, min_workers=3)
    with pytest.raises(ValueError, match="worker-only clusters"):
        LaunchConfig(command=["x.py"], workers=3, min_workers=2, ps=1)
