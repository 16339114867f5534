"""MultiWorkerMirroredStrategy with real worker processes over loopback (gloo), started by `distrib launch`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distrib as ds
from distrib.cluster import TFConfigClusterResolver, TFConfigError

SCRIPTS = Path(__file__).parent / "scripts"


def launch(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run `distrib launch ARGS` in its own process group; kill the whole group if it overruns."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "distrib.app.cli", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"distrib launch {' '.join(args)} did not finish in {timeout}s:\n{out}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing it started may outlive the test
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - start


def run_script(tmp_path: Path, strategy: str) -> list[torch.Tensor]:
    out = tmp_path / f"{strategy}.pt"
    result = subprocess.run([sys.executable, str(SCRIPTS / "mw_train.py"), "--out", str(out), "--strategy", strategy],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "TF_CONFIG": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(out)


def assert_params_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_two_workers_two_local_replicas_and_one_replica_end_with_the_same_parameters(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_train.py"), "--out", str(tmp_path / "mw.pt"))
    assert code == 0, out
    assert out.count("done") == 2 and "[worker 1] done" in out
    two_workers = torch.load(tmp_path / "mw.pt")
    one_replica = run_script(tmp_path, "default")
    two_replicas = run_script(tmp_path, "mirrored2")
    assert_params_equal(two_workers, one_replica)
    assert_params_equal(two_replicas, one_replica)


def test_a_worker_killed_mid_epoch_resumes_under_max_restarts_to_the_uninterrupted_parameters(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "mw_train.py"), "--out", str(tmp_path / "plain.pt"),
                          "--checkpoint-dir", str(tmp_path / "ckpt-plain"))
    assert code == 0, out
    code, out, _ = launch("--workers", "2", "--max-restarts", "1", str(SCRIPTS / "mw_train.py"),
                          "--out", str(tmp_path / "killed.pt"), "--checkpoint-dir", str(tmp_path / "ckpt-killed"),
                          "--kill-at", "8")
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
    # every worker called save and got its path back; only the chief wrote anything
    assert "[worker 1] saved " in out and (tmp_path / "w0" / "ckpt-1.pt").is_file()
    assert not (tmp_path / "w1").exists()


def test_launch_returns_the_first_failures_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import json, os, sys, time\n"
                      "t = json.loads(os.environ['TF_CONFIG'])['task']\n"
                      "sys.exit(7) if t['index'] == 1 else time.sleep(60)\n")
    code, out, elapsed = launch("--workers", "2", str(script), timeout=60)
    assert code == 7 and "worker 1 failed with exit code 7" in out
    assert elapsed < 30  # the sleeping worker was stopped, not waited for


@pytest.mark.parametrize("config, field", [
    ("{not json", "not valid JSON"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "boss", "index": 0}}', "task.type"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}', "task.index"),
    ('{"cluster": {"worker": ["localhost:1", "localhost:1"]}, "task": {"type": "worker", "index": 0}}',
     r"cluster.worker\[1\]"),
    ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}', r"cluster.worker\[0\]"),
    ('{"cluster": {"wrkr": ["localhost:1"]}, "task": {"type": "worker", "index": 0}}', "cluster.wrkr"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "ps", "index": 0}}', "task.type"),
])
def test_malformed_tf_config_names_the_field_at_fault(config, field):
    with pytest.raises(TFConfigError, match=field):
        TFConfigClusterResolver(environ={"TF_CONFIG": config})


def test_tf_config_chief_and_ranks():
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]}
    r = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})})
    assert (r.task_type, r.task_id, r.is_chief, r.master()) == ("worker", 1, False, "localhost:1")
    from distrib.strategies.multi_worker import worker_rank

    assert worker_rank(r) == (2, 3)
    torchrun = ds.cluster_resolver.resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (torchrun.task_type, torchrun.task_id, torchrun.master()) == ("worker", 1, "h:9")
    slurm = ds.cluster_resolver.SlurmClusterResolver(environ={
        "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "node[01-02]"})
    assert slurm.cluster_spec().as_dict() == {"worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]}
    assert slurm.task_id == 3 and not slurm.is_chief
