"""One device per launched process (issue 11, item 2): ``worker_devices`` decides it from the launcher's
variables and a GPU count, so the choice is tested here without a GPU; ``devices=`` overrides it.
"""

from __future__ import annotations

import logging

import pytest
import torch

import distrib as ds
from distrib.strategies.devices import local_process, worker_devices


def test_torchrun_local_rank_takes_its_own_gpu():
    for k in range(4):
        assert worker_devices({"LOCAL_RANK": str(k), "LOCAL_WORLD_SIZE": "4"}, gpus=4) == [f"cuda:{k}"]


def test_one_process_on_the_host_mirrors_over_every_gpu_as_tf():
    assert worker_devices({}, gpus=3) == ["cuda:0", "cuda:1", "cuda:2"]
    # torchrun --nproc-per-node 1: LOCAL_WORLD_SIZE=1 is one process per host, which takes every GPU
    assert worker_devices({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, gpus=2) == ["cuda:0", "cuda:1"]


def test_without_a_gpu_every_launcher_gives_the_cpu():
    for env in ({}, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, {"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2"}):
        assert worker_devices(env, gpus=0) == ["cpu:0"]
    assert worker_devices({}, gpus=0, group=(1, 2)) == ["cpu:0"]


def test_slurm_localid_takes_its_own_gpu():
    env = {"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}
    assert local_process(env) == (1, 2, "SLURM_LOCALID")
    assert worker_devices(env, gpus=2) == ["cuda:1"]


def test_slurm_task_narrowed_to_one_gpu_takes_cuda_0():
    """srun --gpus-per-task=1 makes each task see one GPU: local id 3 then takes cuda:0 (3 modulo 1)."""
    env = {"SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "4"}
    assert worker_devices(env, gpus=1) == ["cuda:0"]


def test_slurm_one_task_per_node_mirrors_over_every_gpu():
    env = {"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}
    assert local_process(env) is None
    assert worker_devices(env, gpus=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_slurm_tasks_per_node_lists_differ_by_node():
    env = {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"}
    assert local_process(env) is None  # node 1 runs one task
    assert worker_devices(env, gpus=2) == ["cuda:0", "cuda:1"]
    assert local_process({**env, "SLURM_NODEID": "0"}) == (0, 3, "SLURM_LOCALID")


def test_local_rank_is_read_before_slurm_localid():
    """torchrun started inside a Slurm step: torchrun's LOCAL_RANK is the process's own."""
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1"}
    assert worker_devices(env, gpus=2) == ["cuda:1"]


def test_an_mp_spawn_group_takes_one_gpu_per_rank():
    assert worker_devices({}, gpus=2, group=(1, 2)) == ["cuda:1"]
    assert worker_devices({}, gpus=2, group=(0, 1)) == ["cuda:0", "cuda:1"]  # a group of one: every GPU


def test_more_processes_than_gpus_warns_and_wraps(caplog):
    with caplog.at_level(logging.WARNING, logger="distrib.strategies"):
        assert worker_devices({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, gpus=2) == ["cuda:1"]
    assert "4 processes on this host share 2 GPU(s)" in caplog.text
    assert "devices=" in caplog.text


def test_as_many_processes_as_gpus_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="distrib.strategies"):
        worker_devices({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, gpus=2)
    assert caplog.text == ""


def test_malformed_variables_are_ignored_not_misread():
    assert local_process({"LOCAL_RANK": "x"}) is None
    assert worker_devices({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, gpus=2) == ["cuda:0", "cuda:1"]


def test_devices_argument_overrides_the_launchers_choice(monkeypatch):
    """Under torchrun's variables for local rank 1 of 2, devices= still decides (one CPU worker here)."""
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    strategy = ds.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert strategy.num_local_replicas == 2
    assert [str(d) for d in strategy.local_devices] == ["cpu:0", "cpu:1"]
    default = ds.MultiWorkerMirroredStrategy()
    assert [str(d) for d in default.local_devices] == ["cpu:0"]


def test_devices_argument_with_an_absent_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="not available"):
        ds.MultiWorkerMirroredStrategy(devices=["cuda:0"])
