"""Fault tolerance on a real cluster (1 ps, 2 worker processes): a worker killed mid-function, a worker
coming back, a parameter server lost, and the cluster restarted from a checkpoint."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.parameter_server.client.remote_value import RemoteValueStatus
from distrib.parameter_server.errors import ParameterServerUnavailableError

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FEATURES = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
LABELS = torch.tensor([[0.3], [0.5], [0.7]])


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout}s")
        time.sleep(0.05)


def build(strategy):
    with strategy.scope():
        model = nn.Linear(2, 1)
        with torch.no_grad():
            model.weight.fill_(0.5)
            model.bias.zero_()
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    return model, optimizer


def loss_of(model) -> float:
    with torch.no_grad():
        return F.mse_loss(model(FEATURES), LABELS).item()


def test_worker_and_ps_failures(tmp_path):
    with ds.testing.LocalCluster(num_workers=2, num_ps=1) as cluster:
        cluster.wait_ready(timeout=120)
        strategy = ds.ParameterServerStrategy(cluster.resolver(), token=cluster.token)
        model, optimizer = build(strategy)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        start = loss_of(model)
        hang = str(tmp_path / "hang-on-worker-1")

        def dataset_fn():
            while True:
                yield FEATURES, LABELS

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))  # rebuilt by a worker that comes back

        def step(iterator, hang_file):
            task = strategy.cluster_resolver.task_id
            x, y = next(iterator)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if task == 1 and os.path.exists(hang_file):
                time.sleep(120)  # stuck here until the test kills this worker
            return task

        # 1. a worker killed while it runs a function: that function runs again on the other worker
        for _ in range(10):
            coordinator.schedule(step, args=(iterator, hang))
        coordinator.join(timeout=60)
        open(hang, "w").close()
        values = [coordinator.schedule(step, args=(iterator, hang)) for _ in range(40)]
        wait_until(
            lambda: any(v.status is RemoteValueStatus.RUNNING and v.worker.endswith("task:1") for v in values),
            60,
            "worker 1 to take a function",
        )
        stuck = next(v for v in values if v.status is RemoteValueStatus.RUNNING and v.worker.endswith("task:1"))
        time.sleep(0.2)
        cluster.kill("worker", 1)
        coordinator.join(timeout=90)
        assert all(v.status is RemoteValueStatus.READY for v in values)  # every function completed
        assert stuck.fetch() == 0 and stuck.attempts == 2  # run again, on worker 0
        assert loss_of(model) < 0.5 * start  # the model still trained

        # 2. the worker comes back and is used again
        os.remove(hang)
        cluster.start_task("worker", 1)
        deadline = time.monotonic() + 90
        used = set()
        while 1 not in used:
            assert time.monotonic() < deadline, "the restarted worker was never used again"
            batch = [coordinator.schedule(step, args=(iterator, hang)) for _ in range(10)]
            coordinator.join(timeout=90)
            used |= set(coordinator.fetch(batch))
        path = ds.CheckpointManager(ds.Checkpoint(model=model, optimizer=optimizer), tmp_path / "ckpt").save()
        saved = {k: v.clone() for k, v in model.state_dict().items()}

        # 3. a parameter server lost: a clear error, and the coordinator stays failed
        cluster.kill("ps", 0)
        coordinator.schedule(step, args=(iterator, hang))
        with pytest.raises(ParameterServerUnavailableError, match="restart the cluster"):
            coordinator.join(timeout=60)
        with pytest.raises(ParameterServerUnavailableError):
            coordinator.schedule(step, args=(iterator, hang))
        coordinator.close()

        # 4. restart the cluster and resume from the checkpoint (the worker processes hold no state
        #    that matters and are kept, to keep the test short; `distrib launch --max-restarts` restarts all)
        cluster.start_task("ps", 0)
        cluster.wait_ready(timeout=120)
        strategy = ds.ParameterServerStrategy(cluster.resolver(), token=cluster.token)
        model, optimizer = build(strategy)
        ds.CheckpointManager(ds.Checkpoint(model=model, optimizer=optimizer), tmp_path / "ckpt").restore_or_initialize()
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), name
        resumed = loss_of(model)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        with pytest.raises(ValueError, match="another ClusterCoordinator"):
            coordinator.schedule(step, args=(iterator, hang))
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        for _ in range(20):
            coordinator.schedule(step, args=(iterator, hang))
        coordinator.join(timeout=60)
        assert loss_of(model) < resumed
        assert int(optimizer.state_dict()["state"][0]["step"]) >= 20
        coordinator.close()
        assert path.endswith("ckpt-1")
