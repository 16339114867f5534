"""PreemptionCheckpointHandler and TerminationConfig in one process (issue 23): the notice's signal or watcher,
the save at the step, the exit code, the exact resume, the deadline when the save hangs, and user mistakes."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest
import torch
from helpers import run_bounded

import distrib as ds
from distrib.checkpoint import CheckpointError

# a one-process job: 12 runs of SGD on a linear model; NOTICE_AT / HOW choose the notice; prints what happened
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    import distrib as ds
    directory, how, notice_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = ds.Checkpoint(model=model, optimizer=opt)
    flag = os.path.join(directory, "notice")
    if how == "usr1":
        config = ds.experimental.TerminationConfig(signals=signal.SIGUSR1)
    elif how == "watcher":
        config = ds.experimental.TerminationConfig(termination_watcher_fn=lambda: os.path.exists(flag),
                                                   exit_fn=lambda: sys.exit(7))
    elif how == "hang":
        config = ds.experimental.TerminationConfig(grace_period=1.0, save_fn=lambda: time.sleep(60))
    else:
        config = None
    handler = ds.experimental.PreemptionCheckpointHandler(None, checkpoint, os.path.join(directory, "ckpt"), config)
    print("START", handler.total_run_calls, flush=True)
    first = handler.total_run_calls == 0  # the notice comes on the first attempt only
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(12)]

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    while handler.total_run_calls < 12:
        n = handler.total_run_calls
        if n == notice_at and first:
            print("NOTICE", time.time(), flush=True)
            if how == "watcher":
                open(flag, "w").close()
                time.sleep(1.5)  # the watcher looks once a second
            elif how in ("usr1", "hang"):
                os.kill(os.getpid(), signal.SIGUSR1 if how == "usr1" else signal.SIGTERM)
        handler.run(step, *batches[n])
    torch.save([p.detach() for p in model.parameters()], os.path.join(directory, "final.pt"))
    print("DONE", flush=True)
""")


def _run(tmp_path, how: str, notice_at: int, timeout: float = 60) -> tuple[int, str, float]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return run_bounded([sys.executable, str(script), str(tmp_path), how, str(notice_at)], timeout=timeout)


def _uninterrupted(tmp_path) -> list[torch.Tensor]:
    clean = tmp_path / "clean"
    clean.mkdir()
    code, out, _ = _run(clean, "none", -1)
    assert code == 0, out
    return torch.load(clean / "final.pt")


def test_a_chosen_signal_saves_at_the_step_exits_42_and_the_restart_resumes_there(tmp_path):
    expected = _uninterrupted(tmp_path)
    code, out, _ = _run(tmp_path, "usr1", 5)
    assert code == 42, out  # TF's exit code, which distrib launch restarts
    assert "START 0" in out and "preemption checkpoint at run 5 saved" in out and "DONE" not in out
    code, out, _ = _run(tmp_path, "usr1", 5)
    assert code == 0 and "START 5" in out, out  # total_run_calls restored: the data position follows
    for a, b in zip(torch.load(tmp_path / "final.pt"), expected):
        assert torch.equal(a, b)


def test_a_termination_watcher_fn_and_a_custom_exit_fn(tmp_path):
    code, out, _ = _run(tmp_path, "watcher", 3)
    assert code == 7, out
    assert "preemption checkpoint at run 3 saved" in out or "preemption checkpoint at run 4 saved" in out, out


def test_a_save_that_hangs_still_exits_before_the_grace_period_ends(tmp_path):
    code, out, seconds = _run(tmp_path, "hang", 2)
    assert code == 42, out
    assert "no checkpoint saved within 0.8s" in out and "no checkpoint yet" in out, out
    assert seconds < 20
    assert ds.latest_checkpoint(str(tmp_path / "ckpt")) is None  # nothing half-written became the latest


def test_termination_config_refuses_what_cannot_work(monkeypatch):
    TC = ds.experimental.TerminationConfig
    with pytest.raises(ValueError, match="cannot be caught"):
        TC(signals=signal.SIGKILL)
    with pytest.raises(ValueError, match="exit_code"):
        TC(exit_code=0)
    with pytest.raises(ValueError, match="grace_period"):
        TC(grace_period=-1)
    with pytest.raises(TypeError, match="exit_fn"):
        TC(exit_fn=42)
    monkeypatch.setenv("DISTRIB_GRACE_SECONDS", "10")
    assert TC().grace_seconds() == 10.0 and TC().deadline_seconds() == 8.0
    assert TC(grace_period=120).deadline_seconds() == 118.0
    monkeypatch.delenv("DISTRIB_GRACE_SECONDS")
    assert TC().grace_seconds() == 30.0


def test_handler_mistakes_are_errors_naming_the_fix(tmp_path):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        ds.experimental.PreemptionCheckpointHandler(None, ds.Checkpoint(model=model))
    with pytest.raises(TypeError, match="Checkpoint or ds.CheckpointManager"):
        ds.experimental.PreemptionCheckpointHandler(None, model, str(tmp_path))
    # a directory holding a checkpoint saved without a handler: refused, naming the fix
    ds.CheckpointManager(ds.Checkpoint(model=model), str(tmp_path / "old")).save()
    with pytest.raises(CheckpointError, match="directory of its own"):
        ds.experimental.PreemptionCheckpointHandler(None, ds.Checkpoint(model=model), str(tmp_path / "old"))


def test_a_manager_is_used_as_given_and_run_counts_calls(tmp_path):
    model = torch.nn.Linear(2, 1)
    manager = ds.CheckpointManager(ds.Checkpoint(model=model), str(tmp_path / "m"), max_to_keep=3)
    handler = ds.experimental.PreemptionCheckpointHandler(None, manager)
    try:
        assert handler.total_run_calls == 0
        assert [handler.run(lambda a, b=0: a + b, 1, b=2) for _ in range(3)] == [3, 3, 3]
        handler.save_checkpoint_if_preempted()
        with handler.watch_preemption_scope():
            handler.run(lambda: None)
        assert handler.total_run_calls == 5
        assert "checkpointed_runs" in manager.checkpoint.objects  # TF's name, saved with the checkpoint
        assert signal.getsignal(signal.SIGTERM) == handler._on_signal
    finally:
        handler.close()
    assert signal.getsignal(signal.SIGTERM) != handler._on_signal  # the previous handler is back
    assert os.path.isdir(tmp_path / "m")
