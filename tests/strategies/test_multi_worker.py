"""MultiWorkerMirroredStrategy with real worker processes over loopback (gloo), started by `distrib launch`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from helpers import SCRIPTS, assert_params_equal, launch, run_bounded

import distrib as ds


def run_script(tmp_path: Path, strategy: str) -> list[torch.Tensor]:
    out = tmp_path / f"{strategy}.pt"
    code, log, _ = run_bounded(
        [sys.executable, str(SCRIPTS / "mw_train.py"), "--out", str(out), "--strategy", strategy],
        timeout=120,
        env={**os.environ, "TF_CONFIG": ""},
    )
    assert code == 0, log
    return torch.load(out)


def test_two_workers_two_local_replicas_and_one_replica_end_with_the_same_parameters(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_train.py"), "--out", str(tmp_path / "mw.pt"))
    assert code == 0, out
    assert "[worker 1] done: worker 1 of 2, 2 replicas in sync" in out and out.count("done") == 2
    two_workers = torch.load(tmp_path / "mw.pt")
    one_replica = run_script(tmp_path, "default")
    two_replicas = run_script(tmp_path, "mirrored2")
    assert_params_equal(two_workers, one_replica)
    assert_params_equal(two_replicas, one_replica)


def test_two_workers_of_two_local_replicas_each_merge_locally_then_reduce_to_one_replica_s_parameters(tmp_path):
    code, out, _ = launch(
        "--workers",
        "2",
        str(SCRIPTS / "mw_train.py"),
        "--out",
        str(tmp_path / "mw22.pt"),
        "--strategy",
        "multi-worker2",
    )
    assert code == 0, out
    assert "[worker 0] done: worker 0 of 2, 4 replicas in sync" in out
    assert_params_equal(torch.load(tmp_path / "mw22.pt"), run_script(tmp_path, "default"))


def test_a_worker_killed_mid_epoch_resumes_under_max_restarts_to_the_uninterrupted_parameters(tmp_path):
    code, out, _ = launch(
        "--workers",
        "2",
        str(SCRIPTS / "mw_train.py"),
        "--out",
        str(tmp_path / "plain.pt"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt-plain"),
    )
    assert code == 0, out
    code, out, _ = launch(
        "--workers",
        "2",
        "--max-restarts",
        "1",
        str(SCRIPTS / "mw_train.py"),
        "--out",
        str(tmp_path / "killed.pt"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt-killed"),
        "--kill-at",
        "8",
    )
    assert code == 0, out
    assert "worker 1 failed with exit code 137" in out and "restarting the whole group" in out
    assert "resumed at epoch 1 step 2" in out  # 6 steps per epoch: step 8 is epoch 1, step 2
    assert_params_equal(torch.load(tmp_path / "killed.pt"), torch.load(tmp_path / "plain.pt"))


def test_gradient_accumulation_and_clipping_on_two_workers_match_one_device(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_accumulate.py"), str(tmp_path / "acc.pt"))
    assert code == 0, out
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 4, generator=g) for _ in range(4)]
    for a, b, clip in ((xs[0], xs[1], True), (xs[2], xs[3], False)):
        for x in (a, b):
            (model(x).pow(2).sum() / 16).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    assert_params_equal(torch.load(tmp_path / "acc.pt"), [p.detach() for p in model.parameters()])


def test_a_peer_that_stops_answering_is_an_error_on_the_other_worker_within_the_timeout():
    code, out, elapsed = launch("--workers", "2", str(SCRIPTS / "mw_hang.py"), "3", timeout=90)
    assert code == 3, out
    line = next(l for l in out.splitlines() if "COLLECTIVE ERROR" in l)
    assert line.startswith("[worker 0]")
    seconds = float(line.split("after ")[1].split("s:")[0])
    assert seconds < 3 + 2.0, line
    assert "did not answer within 3s" in line


def test_uneven_shards_end_the_epoch_together_and_count_every_example_once(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_uneven.py"), str(tmp_path), timeout=90)
    assert code == 0, out
    # worker 0: 5 batches of 4 (weight 1), worker 1: 2 batches of 4 (weight 2)
    assert out.count("steps=5 examples=28 weight=36") == 2, out
    # every worker called save with a path of its own: each wrote its copy there (as TF), so the path returned exists
    assert f"[worker 1] saved {tmp_path / 'w1' / 'ckpt-1'} exists=True" in out, out
    assert f"[worker 0] saved {tmp_path / 'w0' / 'ckpt-1'} exists=True" in out, out
    restored = torch.tensor(0)
    ds.Checkpoint(steps=restored).restore(str(tmp_path / "w1" / "ckpt-1"))
    assert int(restored) == 5  # worker 1's copy holds the global step count
