"""The abstract ``Strategy``: what each strategy must decide, and that a new kind plugs in with a file of its own.

``RecordingStrategy`` below is the shape of the sharded strategy (issue 20): no replica threads,
modules taken over when the scope closes, optimizers after the modules they update. It composes
``InPlaceMerger`` and ``run_in_place`` and touches no other strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

import distrib as ds
from distrib.input import DistributedDataset
from distrib.parameter_server.worker_strategy import ParameterServerWorkerStrategy
from distrib.strategies.base import Strategy
from distrib.strategies.execution import SynchronousExecutor
from distrib.strategies.replica import InPlaceMerger, ReplicaContext, run_in_place
from distrib.strategies.run_options import RunOptions
from distrib.strategies.synchronous import SynchronousStrategy

ABSTRACT = {
    "call_for_each_replica",
    "distribute_module",
    "distribute_optimizer",
    "experimental_distribute_dataset",
    "distribute_datasets_from_function",
    "step_executor",
}


def test_the_base_is_abstract_with_the_members_each_strategy_decides() -> None:
    assert Strategy.__abstractmethods__ == ABSTRACT
    with pytest.raises(TypeError, match="abstract"):
        Strategy([None])  # type: ignore[abstract]


def test_every_strategy_decides_them_and_the_synchronous_ones_compose_the_engine() -> None:
    synchronous = [
        ds.get_strategy(),
        ds.OneDeviceStrategy("cpu"),
        ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        ds.CentralStorageStrategy(["cpu:0"], parameter_device="cpu"),
    ]
    for strategy in synchronous:
        assert isinstance(strategy, SynchronousStrategy) and strategy.gradient_merge is not None
    assert not issubclass(ds.ParameterServerStrategy, SynchronousStrategy)
    assert not issubclass(ParameterServerWorkerStrategy, SynchronousStrategy)
    assert not ParameterServerWorkerStrategy.__abstractmethods__ and not ds.ParameterServerStrategy.__abstractmethods__


def test_the_worker_side_parameter_server_strategy_is_its_own_class() -> None:
    spec = ds.ClusterSpec({"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"], "ps": ["localhost:4"]})
    worker = ds.ParameterServerStrategy.for_worker(spec, 1)
    assert type(worker) is ParameterServerWorkerStrategy
    assert isinstance(worker, ds.ParameterServerStrategy)  # as TF's workers answer
    assert not worker.is_chief and not worker.on_coordinator and worker.cluster_spec is spec
    assert worker.gradient_merge is None and not worker.extended.merges_optimizer_steps(object())
    assert worker.run(lambda x: x * 2, args=(torch.tensor(3),)) == 6
    with worker.scope():
        module = torch.nn.Linear(2, 1)
    assert ds.context.owner_of(module) is None  # a module built in a scheduled function stays the worker's own


class RecordingStrategy(Strategy):
    """One replica, run in place; records what the scope hands over (the sharded strategy's shape)."""

    def __init__(self) -> None:
        super().__init__([None], device_names=["recording"])
        self.replica = ReplicaContext(self, 0, InPlaceMerger())
        self.events: list[str] = []
        self.calls = 0

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        self.calls += 1
        return run_in_place(self.replica, fn, args, kwargs)

    def distribute_module(self, module: torch.nn.Module) -> None:
        self.events.append(f"module {type(module).__name__}")
        for sub in module.modules():
            ds.context.set_owner(sub, self)  # so that fit finds this strategy (context.strategy_of)

    def distribute_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append(f"optimizer {type(optimizer).__name__}")

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Any:
        return DistributedDataset(dataset, self, options=options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Any:
        raise NotImplementedError

    def step_executor(self) -> SynchronousExecutor:
        return SynchronousExecutor(self)


def test_a_new_kind_of_strategy_gets_complete_modules_then_optimizers_and_runs() -> None:
    strategy = RecordingStrategy()
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        assert strategy.events == []  # the model is not complete yet: nothing handed over
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        head = torch.nn.Linear(1, 1)
    assert strategy.events == ["module Sequential", "optimizer SGD", "module Linear"]  # the root, not its layers
    assert head is not None

    def step(x: torch.Tensor) -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is strategy.replica
        loss = ds.compute_average_loss(model(x).pow(2).sum(1))
        loss.backward()
        optimizer.step()
        return ctx.all_reduce("sum", loss.detach())

    batches = strategy.experimental_distribute_dataset([torch.ones(4, 2)])
    losses = [strategy.run(step, args=(x,)) for x in batches]
    assert len(losses) == 1 and torch.isfinite(losses[0])
    assert strategy.reduce("sum", torch.tensor(2.0), axis=None) == 2.0
    calls = strategy.calls
    history = ds.fit(
        model, [(torch.ones(4, 2), torch.zeros(4, 1))], optimizer=optimizer, loss="mse", epochs=2, verbose=0
    )
    assert len(history.history["loss"]) == 2
    assert strategy.calls == calls + 2  # fit ran its 2 steps through this strategy, not the default one
