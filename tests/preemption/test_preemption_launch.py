"""Preemption under `distrib launch` (issue 23): a SIGTERM at a random step becomes one checkpoint that both
workers save at the same step, the launcher restarts the group (not counted against --max-restarts, which is 0
here), and training ends with the parameters of an uninterrupted run, bit for bit, no step lost.

The trials are benchmarks/preemption.py's (which runs 10 of them and prints the figures); here one at a random
step through each path: the signal to one worker, and the signal to the launcher (which forwards it to every task,
exits with 42, and is started again as a scheduler would).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import preemption as bench  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return bench.reference(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("via", ["self", "launcher"])
def test_a_notice_at_a_random_step_is_one_agreed_checkpoint_and_an_exact_resume(tmp_path, reference, via, request):
    if via == "launcher":  # preempt_train.py signals os.getppid(): the launcher only when it forked the task itself
        request.getfixturevalue("own_fork_server")
    notice_at = random.Random().randint(1, bench.last_notice(via))
    result = bench.trial(tmp_path, notice_at, via, reference)
    print(
        f"PREEMPTION via {via}: notice at run {notice_at}, saved at {result['saved_at']}, runs at exit "
        f"{result['runs_at_exit']}, resumed at {result['resumed_at']}, steps lost {result.get('steps_lost')}, "
        f"notice to exit {result.get('notice_to_exit_s')}s, launcher exit codes {result['launcher_exit_codes']}"
    )
    assert len(result["saved_at"]) == 2 and len(set(result["saved_at"].values())) == 1, result.get("output")
    saved = next(iter(result["saved_at"].values()))
    if via == "self":
        assert saved == notice_at + 1, result  # TF's rule: the run after the one where the notice was seen
    else:
        assert notice_at < saved < 20, result  # the launcher forwards it within a few 20 ms steps
    assert result["runs_at_exit"] == [saved, saved] and result["resumed_at"] == [saved], result
    assert result["steps_lost"] == 0
    assert result["params_equal"] is True
    if via == "launcher":
        assert result["launcher_exit_codes"] == [42, 0]  # 42: every task saved; the scheduler restarts the job
    else:
        assert result["launcher_exit_codes"] == [0]  # restarted by the launcher itself, with --max-restarts 0
    assert result["notice_to_exit_s"] < 4.0  # within the default 5 s grace period, less the handler's margin


def test_under_the_sharded_strategy_each_worker_saves_its_shards_and_the_resume_is_exact(tmp_path):
    """The handler's checkpoint under ShardedStrategy is the sharded format (one shard file per worker)."""
    expected = bench.reference(tmp_path, strategy="sharded")
    notice_at = random.Random().randint(1, 18)
    result = bench.trial(tmp_path, notice_at, "self", expected, strategy="sharded")
    print(
        f"PREEMPTION under ShardedStrategy: notice at run {notice_at}, saved at {result['saved_at']}, "
        f"resumed at {result['resumed_at']}, notice to exit {result.get('notice_to_exit_s')}s"
    )
    assert set(result["saved_at"].values()) == {notice_at + 1} and len(result["saved_at"]) == 2, result.get("output")
    assert result["resumed_at"] == [notice_at + 1] and result["steps_lost"] == 0, result
    assert result["params_equal"] is True, result
    shards = list(tmp_path.glob("self-*/ckpt/*.dcp/*.distcp"))
    assert len(shards) == 2, shards
