"""Metrics updated inside scheduled functions reach the coordinator, each completed call counted exactly once,
also when a call runs again after its worker was lost (the hung-worker case is a scenario of
tests/faults/test_parameter_server.py)."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import torch
import torchmetrics

import distrib as ds
from distrib.parameter_server.client.remote_value import RemoteValueStatus

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module


@pytest.fixture
def in_process():
    resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    yield resolver
    ds.testing.stop_in_process_cluster(resolver)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def test_metrics_built_under_the_scope_and_updated_in_scheduled_functions_reach_the_coordinator(in_process):
    strategy = ds.ParameterServerStrategy(in_process)
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
        accuracy = ds.metrics.SparseCategoricalAccuracy()
        steps = ds.metrics.Sum()
        mean_loss = ds.metrics.Mean()
        micro = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def step(x, y):
        def replica_fn(x, y):
            logits = model(x)
            accuracy.update_state(y, logits)
            mean_loss.update_state(torch.nn.functional.cross_entropy(logits, y, reduction="none"))
            micro.update(logits, y)
            steps.update_state(1.0)

        strategy.run(replica_fn, args=(x, y))

    batches = _batches(12)
    expected_accuracy, expected_loss = ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean()
    with torch.no_grad():
        for x, y in batches:  # the same model, read here: nothing trains
            expected_accuracy.update_state(y, model(x))
            expected_loss.update_state(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
    for epoch in range(2):  # reset between epochs, as the tutorial does
        for m in (accuracy, steps, mean_loss):
            m.reset_state()
        micro.reset()
        for x, y in batches:
            coordinator.schedule(step, args=(x, y))
        coordinator.join()
        print(
            f"epoch {epoch}: steps {float(steps.result())}, accuracy {float(accuracy.result()):.4f} "
            f"(local {float(expected_accuracy.result()):.4f}), torchmetrics {float(micro.compute()):.4f}"
        )
        assert float(steps.result()) == len(batches)
        assert float(accuracy.result()) == pytest.approx(float(expected_accuracy.result()))
        assert float(micro.compute()) == pytest.approx(float(expected_accuracy.result()))
        assert float(mean_loss.result()) == pytest.approx(float(expected_loss.result()), rel=1e-5)
    coordinator.close()


def test_a_call_that_raises_adds_nothing_to_a_metric(in_process):
    strategy = ds.ParameterServerStrategy(in_process)
    with strategy.scope():
        seen = ds.metrics.Sum()
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def count_then_maybe_fail(i):
        seen.update_state(1.0)
        if i == 3:
            raise ValueError("step 3 fails after counting itself")
        return i

    for i in range(3):
        coordinator.schedule(count_then_maybe_fail, args=(i,))
    coordinator.join()
    coordinator.schedule(count_then_maybe_fail, args=(3,))
    with pytest.raises(ValueError, match="step 3 fails"):
        coordinator.join()
    assert float(seen.result()) == 3.0  # the failed call's own update is not counted
    coordinator.close()


class FullStateSum(torchmetrics.Metric):
    """A torchmetrics metric whose update needs its full state: torchmetrics cannot merge two of them."""

    full_state_update = True

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.total += x.sum()

    def compute(self) -> torch.Tensor:
        return self.total


def test_a_metric_whose_state_cannot_merge_is_refused_when_scheduled(in_process):
    strategy = ds.ParameterServerStrategy(in_process)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    pearson = FullStateSum()

    def step(x):
        pearson.update(x)

    with pytest.raises(TypeError, match="cannot add up updates made on several workers"):
        coordinator.schedule(step, args=(torch.ones(3),))
    coordinator.close()


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout}s")
        time.sleep(0.02)


def test_a_call_run_again_after_its_worker_was_killed_counts_once(tmp_path):
    """The first run had already updated the lost worker's copy of the metric: only the second run counts."""
    with ds.testing.LocalCluster(num_workers=2, num_ps=1) as cluster:
        cluster.wait_ready(timeout=120)
        strategy = ds.ParameterServerStrategy(cluster.resolver(), token=cluster.token)
        with strategy.scope():
            calls = ds.metrics.Sum()
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        flag = str(tmp_path / "slow-on-worker-1")

        def step(flag):
            calls.update_state(1.0)  # counted before the worker is lost: must not count twice
            task = strategy.cluster_resolver.task_id
            time.sleep(0.05)  # long enough to go alone (not batched), so that both workers get calls
            if task == 1 and os.path.exists(flag):
                time.sleep(0.5)
            return task

        warm = [coordinator.schedule(step, args=(flag,)) for _ in range(20)]
        coordinator.join(timeout=60)
        assert {v.fetch() for v in warm} == {0, 1}
        open(flag, "w").close()
        values = [coordinator.schedule(step, args=(flag,)) for _ in range(30)]
        _wait_until(
            lambda: any(v.status is RemoteValueStatus.RUNNING and v.worker.endswith("task:1") for v in values),
            60,
            "worker 1 to take a call",
        )
        time.sleep(0.1)
        cluster.kill("worker", 1)
        coordinator.join(timeout=120)
        retried = [v for v in values if v.attempts > 1]
        total = len(warm) + len(values)
        print(
            f"worker 1 killed: {len(retried)} call(s) ran again on worker 0; metric {float(calls.result()):.0f} "
            f"of {total} calls"
        )
        assert all(v.status is RemoteValueStatus.READY for v in values)
        assert retried and all(v.fetch() == 0 for v in retried)
        assert float(calls.result()) == total  # every completed call once, retries included
        coordinator.close()
