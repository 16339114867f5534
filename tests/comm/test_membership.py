"""Fault tolerance's pure parts: the plan every member follows after a fault, a global batch's shares, the
launcher's record of dead and stopped tasks, and the switches' refusals."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch

import distrib as ds
from distrib.cluster.fault_watch import FaultWatch, process_stopped
from distrib.cluster.launch import LaunchConfig
from distrib.comm import CollectiveError
from distrib.comm.membership import STORE_VARIABLE, WorkerState, plan, store_key
from distrib.strategies.fault_tolerance import WholeBatch, _shares


def test_a_member_holding_the_step_applies_it_when_another_member_applied_it():
    states = {0: WorkerState(7, True), 1: WorkerState(6, True, held=True), 3: WorkerState(6, True, held=True)}
    assert plan(states, 1) == "apply" and plan(states, 3) == "apply"
    assert plan(states, 0) == "redo"  # it applied step 7 and is in step 8, which nobody applied


def test_nobody_applied_the_step_so_every_member_redoes_it_even_those_holding_its_gradients():
    states = {0: WorkerState(6, True, held=True), 2: WorkerState(6, True)}
    assert plan(states, 0) == "redo" and plan(states, 2) == "redo"


def test_a_collective_between_steps_is_repeated_only_where_every_member_failed_at_the_same_one():
    same = {0: WorkerState(6, False, outside_done=1), 1: WorkerState(6, False, outside_done=1)}
    assert plan(same, 0) == "retry"
    after_apply = {0: WorkerState(6, False), 1: WorkerState(5, True, held=True)}  # 1 applies, then meets 0
    assert plan(after_apply, 0) == "retry" and plan(after_apply, 1) == "apply"
    apart = {0: WorkerState(6, False, outside_done=0), 1: WorkerState(6, False, outside_done=1)}
    with pytest.raises(CollectiveError, match="completed on some workers and not on others"):
        plan(apart, 0)
    with pytest.raises(CollectiveError, match="completed on some workers and not on others"):
        plan({0: WorkerState(6, False, outside_done=1), 1: WorkerState(6, True)}, 1)


def test_members_more_than_one_step_apart_is_an_error_not_a_guess():
    with pytest.raises(CollectiveError, match="more than one step apart"):
        plan({0: WorkerState(8, True), 1: WorkerState(6, True, held=True)}, 1)


def test_a_whole_batch_is_split_over_the_members_of_the_moment_and_other_tensors_are_refused_on_a_redo():
    x, y = torch.arange(7), torch.arange(7) * 10
    batch = WholeBatch((x, y))
    three = [_shares(((batch,), {}), r, 3, 0)[0][0] for r in range(3)]
    two = [_shares(((batch,), {}), r, 2, 0)[0][0] for r in range(2)]
    assert [len(s[0]) for s in three] == [3, 2, 2] and [len(s[0]) for s in two] == [4, 3]
    assert torch.equal(torch.cat([s[0] for s in two]), x) and torch.equal(torch.cat([s[1] for s in three]), y)
    assert _shares(((torch.ones(3), 2.0), {}), 0, 2, 0)[0][1] == 2.0  # a first try takes what it is given
    with pytest.raises(CollectiveError, match="experimental_distribute_dataset"):
        _shares(((torch.ones(3),), {}), 0, 2, 1)


def test_the_launcher_records_a_dead_task_and_a_stopped_one_until_it_continues():
    watch = FaultWatch("127.0.0.1")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", int(watch.address.rpartition(":")[2]), is_master=False)
        assert watch.look([sleeper.pid, 99999999], [None, -9]) == [1]
        assert client.get(store_key("dead", 1)) == b"-9" and not client.check([store_key("stopped", 0)])
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not process_stopped(sleeper.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watch.look([sleeper.pid, None], [None, -9]) == []  # task 1 is reported once
        assert client.check([store_key("stopped", 0)])
        sleeper.send_signal(signal.SIGCONT)
        while process_stopped(sleeper.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        watch.look([sleeper.pid, None], [None, -9])
        assert not client.check([store_key("stopped", 0)])
    finally:
        sleeper.kill()
        sleeper.wait()
        watch.close()


def test_fault_tolerant_launches_refuse_what_would_restart_or_resize_the_group():
    for extra in ({"ps": 1}, {"max_restarts": 1}, {"min_workers": 1, "workers": 2}):
        with pytest.raises(ValueError, match="--fault-tolerant"):
            LaunchConfig(command=["x.py"], fault_tolerant=True, **extra)


def test_a_fault_tolerant_strategy_without_the_launcher_s_store_names_the_launch_flag(monkeypatch):
    monkeypatch.delenv(STORE_VARIABLE, raising=False)
    cluster = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    resolver = ds.cluster_resolver.TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(cluster)})
    with pytest.raises(ValueError, match="distrib launch --fault-tolerant"):
        ds.MultiWorkerMirroredStrategy(cluster_resolver=resolver, devices=["cpu"], fault_tolerant=True)
    with pytest.raises(ValueError, match="one replica per worker"):
        ds.MultiWorkerMirroredStrategy(cluster_resolver=resolver, devices=["cpu:0", "cpu:1"], fault_tolerant=True)
    one = ds.MultiWorkerMirroredStrategy(devices=["cpu"], fault_tolerant=True)  # one worker: nothing to lose
    assert one.num_workers == 1 and not one.fault_tolerant
