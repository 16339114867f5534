"""``torch.amp.GradScaler`` inside functions scheduled on parameter-server workers (real ps and worker processes).

The coordinator's scaler is the one authority: each scheduled call runs torch's own scaler on a copy
on its worker, starting from the coordinator's scale; the outcome of each ``update()`` comes back with
the result and is replayed on the coordinator's scaler (see ``distrib/parameter_server/scaler.py``).
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.cluster import ClusterSpec, SimpleClusterResolver

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

LR = 0.1


@pytest.fixture(scope="module")
def cluster():
    with ds.testing.LocalCluster(num_workers=2, num_ps=1) as c:
        c.wait_ready(timeout=120)
        yield c


def strategy_on(cluster, workers: int) -> ds.ParameterServerStrategy:
    """A strategy using the cluster's ps and its first ``workers`` worker processes."""
    spec = {**cluster.cluster, "worker": cluster.cluster["worker"][:workers]}
    return ds.ParameterServerStrategy(SimpleClusterResolver(ClusterSpec(spec), "chief", 0), token=cluster.token)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(n: int, poisoned: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        if i in poisoned:
            x[3, 2] = float("nan")
        out.append((x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()))
    return out


def new_scaler(**kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **{"init_scale": 256.0, "growth_interval": 2, **kwargs})


def plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """One step exactly as in plain PyTorch: the scale it ran with, and its loss."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return scale, float(loss.detach())


def single_device(data, **scaler_kwargs) -> tuple[nn.Module, torch.amp.GradScaler, list[float]]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = new_scaler(**scaler_kwargs)
    scales = [plain_step(model, optimizer, scaler, x, y)[0] for x, y in data]
    return model, scaler, scales


def scheduled(cluster, workers: int, **scaler_kwargs):
    """A model and optimizer on the ps task, a coordinator, a scaler, and the step to schedule."""
    strategy = strategy_on(cluster, workers)
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    scaler = new_scaler(**scaler_kwargs)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
        scale, loss = strategy.run(plain_step, args=(model, optimizer, scaler, x, y))
        return scale, loss, time.monotonic_ns()  # when it ran, on its worker

    return model, coordinator, scaler, step


def run_order(values: list) -> list[int]:
    """The order one worker ran the calls in (two requests in flight to it may overtake each other)."""
    return sorted(range(len(values)), key=lambda i: values[i].fetch()[2])


def parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.state_dict().values()]  # read back from the ps task


def test_clean_steps_on_one_worker_equal_single_device_training_with_the_same_scaler(cluster):
    data = batches(8)
    model, coordinator, scaler, step = scheduled(cluster, workers=1)
    values = [coordinator.schedule(step, args=batch) for batch in data]
    coordinator.join(timeout=120)
    order = run_order(values)
    scales = [values[i].fetch()[0] for i in order]
    reference, reference_scaler, reference_scales = single_device([data[i] for i in order])
    # the scale grew every 2 clean steps (256 -> 4096): on the worker, step by step, as on one device...
    assert reference_scales == [256.0, 256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0, 2048.0]
    assert scales == reference_scales
    # ...and on the coordinator, which replayed every outcome: the state a checkpoint of the scaler saves
    assert scaler.state_dict() == reference_scaler.state_dict()
    assert scaler.get_scale() == 4096.0
    for p, q in zip(parameters(model), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    coordinator.close()


def test_a_poisoned_batch_is_not_applied_and_backs_the_coordinators_scale_off_once(cluster):
    data = batches(6, poisoned=(3,))
    kwargs = dict(backoff_factor=0.25, growth_interval=2)
    model, coordinator, scaler, step = scheduled(cluster, workers=1, **kwargs)
    first = [coordinator.schedule(step, args=batch) for batch in data[:3]]
    coordinator.join(timeout=120)
    before, scale_before = parameters(model), scaler.get_scale()
    assert scale_before == 512.0 and scaler.state_dict()["_growth_tracker"] == 1  # 3 clean steps, grown once

    poisoned = coordinator.schedule(step, args=data[3])
    coordinator.join(timeout=120)
    scale, loss, _ = poisoned.fetch()
    assert scale == 512.0 and loss != loss  # the worker ran it at the coordinator's scale: a NaN loss
    after = parameters(model)
    assert all(torch.equal(p, q) for p, q in zip(after, before))  # the step was not pushed to the ps task
    assert scaler.get_scale() == scale_before * 0.25  # backed off exactly once (twice would be / 16)
    assert scaler.state_dict()["_growth_tracker"] == 0

    values = [coordinator.schedule(step, args=batch) for batch in data[4:]]
    coordinator.join(timeout=120)
    assert [v.fetch()[0] for v in values] == [128.0, 128.0]  # training goes on from there
    order = run_order(first) + [3] + [4 + i for i in run_order(values)]
    reference, reference_scaler, reference_scales = single_device([data[i] for i in order], **kwargs)
    assert reference_scales == [256.0, 256.0, 512.0, 512.0, 128.0, 128.0]
    assert scaler.state_dict() == reference_scaler.state_dict()
    assert not all(torch.equal(p, q) for p, q in zip(parameters(model), after))
    for p, q in zip(parameters(model), reference.state_dict().values()):  # equal to one device skipping it too
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    coordinator.close()


def test_two_workers_the_coordinators_scale_is_every_outcome_replayed(cluster):
    n, interval = 40, 3
    model, coordinator, scaler, step = scheduled(cluster, workers=2, init_scale=1.0, growth_interval=interval)

    def slow_step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
        time.sleep(0.02)  # long enough that both workers take functions
        return step(x, y)

    values = [coordinator.schedule(slow_step, args=batch) for batch in batches(n)]
    coordinator.join(timeout=120)
    scales = [v.fetch()[0] for v in values]
    assert {v.worker for v in values} == {"/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"}
    # n clean outcomes, replayed one by one: the scale doubled every `interval` of them, whichever worker ran them
    assert scaler.get_scale() == 2.0 ** (n // interval)
    assert scaler.state_dict()["_growth_tracker"] == n % interval
    # the workers started from the coordinator's growing scale (not each from its own copy of 1.0)
    assert all(s in {2.0**k for k in range(n // interval + 1)} for s in scales) and max(scales) >= 2.0**5
    # the same n clean steps through torch's own update() on one device give the same state
    plain, reference = new_scaler(init_scale=1.0, growth_interval=interval), make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for x, y in batches(n):
        plain_step(reference, optimizer, plain, x, y)
    assert plain.state_dict() == scaler.state_dict()
    coordinator.close()


def test_a_call_that_fails_after_update_leaves_the_coordinators_scale_alone(cluster):
    model, coordinator, scaler, step = scheduled(cluster, workers=1, growth_interval=1)

    def failing(x: torch.Tensor, y: torch.Tensor) -> None:
        step(x, y)  # a clean step: on the worker the scale grew
        raise RuntimeError("after update")

    data = batches(2)
    coordinator.schedule(step, args=data[0])
    coordinator.join(timeout=120)
    assert scaler.get_scale() == 512.0
    coordinator.schedule(failing, args=data[1])
    with pytest.raises(Exception, match="after update"):
        coordinator.join(timeout=120)
    assert scaler.get_scale() == 512.0  # counted only from calls whose result is kept, as metric updates
    value = coordinator.schedule(step, args=data[1])
    coordinator.join(timeout=120)
    assert value.fetch()[0] == 512.0 and scaler.get_scale() == 1024.0  # the failed call's outcome was dropped
    coordinator.close()


# ---------------------------------------------------------------------------------------------- the bookkeeping
STATE = {
    "enabled": True,
    "scale": 4.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1,
    "_growth_tracker": 0,
}
KEY = "s/scaler0"


def bundle(stamp: int, acks: list, scale: float = 4.0) -> dict:
    return {"session": "s", "stamp": stamp, "acks": acks, "states": {KEY: {**STATE, "scale": scale}}}


def test_a_worker_starts_from_the_newest_snapshot_plus_its_outcomes_not_replayed_in_it():
    from distrib.parameter_server.scaler import WorkerScalers

    workers = WorkerScalers("me")
    copies = [(KEY, workers.copy(KEY, "cpu"))]
    assert workers.copy(KEY, "cpu") is copies[0][1]  # one copy per coordinator scaler
    scale = copies[0][1].get_scale
    workers.receive(bundle(2, ["", []]))
    workers.receive(bundle(1, ["", []], scale=1024.0))  # an older request that overtook the newer one: ignored
    mark = workers.prepare(copies)
    assert scale() == 4.0
    workers.record(KEY, "inf", 0.0)
    workers.record(KEY, "inf", 0.0)
    assert workers.finish(mark, copies) == {
        "worker": "me",
        "outcomes": [[KEY, 1, "inf", 0.0], [KEY, 2, "inf", 0.0]],
        "acked": [],
    }
    workers.prepare(copies)
    assert scale() == 16.0  # the snapshot, then this worker's two clean steps
    workers.receive(bundle(3, ["me", [2]], scale=8.0))  # the coordinator replayed outcome 2 only (1 is still out)
    workers.prepare(copies)
    assert scale() == 16.0
    mark = workers.prepare(copies)
    assert workers.finish(mark, copies) == {"worker": "me", "outcomes": [], "acked": [2]}  # echoed once
    assert workers.finish(mark, copies) is None
    workers.receive(bundle(4, ["someone else", [1]], scale=16.0))  # another process's numbers: nothing replayed
    workers.prepare(copies)
    assert scale() == 32.0
    workers.receive(bundle(5, ["me", [1]], scale=16.0))
    mark = workers.prepare(copies)
    assert scale() == 16.0
    workers.record(KEY, "inf", 1.0)
    workers.discard(mark)  # the call failed: its outcome is never replayed
    workers.prepare(copies)
    assert scale() == 16.0 and workers.finish(mark, copies) == {"worker": "me", "outcomes": [], "acked": [1]}
    with pytest.raises(RuntimeError, match="no state for its GradScaler 'other/scaler0'"):
        workers.prepare([("other/scaler0", workers.copy("other/scaler0", "cpu"))])
    with pytest.raises(TypeError, match="malformed GradScaler snapshot"):
        workers.receive({"session": "s", "stamp": 9, "states": {}})


def test_the_coordinator_replays_in_order_and_refuses_malformed_outcomes():
    from distrib.parameter_server.errors import RemoteProtocolError
    from distrib.parameter_server.scaler import Acknowledgements, ScalerAuthority

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2, backoff_factor=0.25)
    authority = ScalerAuthority("s")
    key = authority.key(scaler)
    assert authority.key(scaler) == key
    acks = Acknowledgements()
    snapshot = authority.snapshot(acks)
    assert snapshot["states"] == {key: {"enabled": True, **scaler.state_dict()}} and snapshot["acks"] == ["", []]
    authority.merge(
        {"worker": "a", "outcomes": [[key, 1, "inf", 0.0], [key, 2, "inf", 3.0], [key, 3, "set", 64.0]], "acked": []},
        acks,
    )
    assert scaler.state_dict()["scale"] == 64.0 and scaler.state_dict()["_growth_tracker"] == 0
    assert authority.snapshot(acks)["acks"] == ["a", [1, 2, 3]]
    authority.merge({"worker": "a", "outcomes": [[key, 4, "inf", 0.0]], "acked": [1, 3]}, acks)
    assert authority.snapshot(acks)["acks"] == ["a", [2, 4]] and scaler.state_dict()["_growth_tracker"] == 1
    authority.merge({"worker": "b", "outcomes": [[key, 1, "inf", 0.0]], "acked": []}, acks)  # a restarted worker
    assert authority.snapshot(acks)["acks"] == ["b", [1]] and scaler.get_scale() == 128.0
    with pytest.raises(RemoteProtocolError, match="malformed GradScaler outcomes"):
        authority.merge({"worker": "b", "outcomes": [[key, 2, "grow", 0.0]], "acked": []}, acks)
    assert authority.snapshot(acks)["stamp"] == 5
    del scaler
    assert authority.snapshot(acks) is None  # a scaler garbage-collected is no longer sent
