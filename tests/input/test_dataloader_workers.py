"""DataLoader worker processes under every strategy (issue 21, item 3): ``num_workers`` 1 and 2, ``persistent_workers``
on and off, ``pin_memory`` on (a no-op on the CPU, where torch warns once), under the default strategy, Mirrored with
two replica threads training between batches, MultiWorkerMirrored on 2 processes (auto-sharded and hand-sharded), and
parameter servers (a per-worker dataset on an in-process cluster). Each case: it ends within its time bound (no
deadlock), its batches are the seeded plain DataLoader's, epoch after epoch, and no loader process outlives it.
"""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import sys
import time
import warnings
from typing import Any

import pytest
import torch
from helpers import SCRIPTS, launch
from torch.utils.data.distributed import DistributedSampler

import distrib as ds

SCRIPT = SCRIPTS / "input_loader_workers.py"
if str(SCRIPTS) not in sys.path:  # importable by name: spawned loader processes unpickle its dataset by reference
    sys.path.insert(0, str(SCRIPTS))
script: Any = importlib.import_module("input_loader_workers")
MATRIX, loader = script.MATRIX, script.loader  # the same loaders as the 2-worker script's
IDS = [f"num_workers={w}-persistent={p}" for w, p in MATRIX]


def reference(num_workers: int, persistent: bool, epochs: int = 2) -> list[list[list[int]]]:
    """Labels per batch per epoch of the same loader iterated plainly (torch draws its workers' base seed from the
    generator at each epoch's start, but only once with persistent workers: the order depends on both settings)."""
    plain = loader(num_workers, persistent)
    return [[b[1].tolist() for b in plain] for _ in range(epochs)]


def wait_no_children(timeout: float = 15.0) -> list[Any]:
    """The loader processes still alive once ``timeout`` has passed (empty as soon as there are none)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        left = multiprocessing.active_children()
        if not left or time.monotonic() > deadline:
            return left


@pytest.fixture(autouse=True)
def _quiet_pin_memory():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        yield


def strategies() -> dict[str, Any]:
    return {"default": ds.get_strategy, "mirrored_2_replicas": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])}


@pytest.mark.parametrize("name", list(strategies()))
@pytest.mark.parametrize("num_workers,persistent", MATRIX, ids=IDS)
def test_loader_processes_in_one_process(name, num_workers, persistent):
    assert not multiprocessing.active_children()
    strategy = strategies()[name]()
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(b: Any) -> torch.Tensor:
        x, y = b
        loss = ds.compute_average_loss(model(x).sum(1), global_batch_size=4)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return y

    data = loader(num_workers, persistent)
    dist = strategy.experimental_distribute_dataset(data)
    epochs = []
    for _ in range(2):  # replica threads train between batches; non-persistent loaders fork anew each epoch
        epochs.append(
            [
                [
                    i
                    for part in strategy.experimental_local_results(strategy.run(step, args=(b,)))
                    for i in part.tolist()
                ]
                for b in dist
            ]
        )
    assert epochs == reference(num_workers, persistent)
    per_worker = strategy.distribute_datasets_from_function(lambda ctx: loader(num_workers, persistent))
    local = [strategy.experimental_local_results(b) for b in per_worker]  # replicas take consecutive batches
    assert [p[1].tolist() for parts in local for p in parts if len(p[1])] == reference(num_workers, persistent, 1)[0]
    del dist, data, per_worker, local
    assert wait_no_children() == []


@pytest.mark.parametrize("kind", ["multi-worker", "sharded"])
def test_loader_processes_on_two_workers(tmp_path, kind):
    code, log, _ = launch("--workers", "2", str(SCRIPT), str(tmp_path), kind, timeout=240)
    assert code == 0 and log.count("DONE") == 2, log
    results = [json.loads((tmp_path / f"w{w}.json").read_text()) for w in range(2)]
    for w, p, policy in ((w, p, policy) for policy in ("auto", "hand") for w, p in MATRIX):
        case, expected = f"{policy}-{w}-{p}", reference(w, p)
        for epoch in range(2):
            if policy == "auto":  # the union of the workers' parts is the global batch, in order
                got = [
                    results[0][case][epoch][step] + results[1][case][epoch][step]
                    for step in range(len(results[0][case][epoch]))
                ]
                assert got == expected[epoch], case
            else:  # each worker reads its DistributedSampler's share in the sampler's seeded order
                for worker in range(2):
                    sampler = DistributedSampler(script.Squares(), 2, worker, seed=5)
                    sampler.set_epoch(epoch)
                    order = list(sampler)
                    assert results[worker][case][epoch] == [order[i : i + 2] for i in range(0, len(order), 2)], case
    assert [r["children_left"] for r in results] == [0, 0]


@pytest.mark.parametrize("num_workers,persistent", [(1, False), (2, True)], ids=[IDS[0], IDS[3]])
def test_loader_processes_under_parameter_servers(num_workers, persistent):
    """With a forkserver: forked from a process running gRPC, a loader process can abort (distrib warns)."""
    cloudpickle = pytest.importorskip("cloudpickle")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    resolver = ds.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    try:
        strategy = ds.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = torch.nn.Linear(2, 1)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        iterator = iter(
            coordinator.create_per_worker_dataset(lambda ctx: loader(num_workers, persistent, context="forkserver"))
        )

        def step(it: Any) -> torch.Tensor:
            x, y = next(it)
            strategy.run(lambda v: model(v).sum(), args=(x,))
            return y

        values = [coordinator.schedule(step, args=(iterator,)) for _ in range(3)]  # one epoch: 3 batches
        coordinator.join(timeout=60)
        # the loader's batches, each whole; which scheduled step takes which is the coordinator's (asynchronous) call
        assert sorted(v.fetch().tolist() for v in values) == sorted(reference(num_workers, persistent, 1)[0])
        coordinator.close()
        del iterator, coordinator
    finally:
        ds.testing.stop_in_process_cluster(resolver)
    assert wait_no_children() == []


def test_a_per_worker_loader_that_would_fork_under_grpc_is_warned_about():
    from distrib.parameter_server.datasets import call_dataset_fn

    with pytest.warns(UserWarning, match="multiprocessing_context='forkserver'"):
        call_dataset_fn(lambda ctx: loader(1, False), ds.InputContext())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call_dataset_fn(lambda ctx: loader(1, False, context="forkserver"), ds.InputContext())
        call_dataset_fn(lambda ctx: loader(0, False), ds.InputContext())
