"""User objects stay the user's under every strategy, parameter servers included.

A model and an optimizer are built in each strategy's scope and trained for a step. Then every
module keeps its class and its parameters (the same ``Parameter`` objects), the optimizer keeps
its class, and the only instance attributes a strategy added are the ones docs/architecture.md
names: ``forward`` on modules whose replicas compute on copies, ``step`` / ``zero_grad`` on
optimizers whose steps the strategy merges, and ``load_state_dict`` under parameter servers
(everything else goes through torch's public hooks). torch's classes are as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import distrib as ds


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _plain() -> tuple[Net, torch.optim.SGD]:
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: Net, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = ds.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=4)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.fixture
def ps_strategy() -> Iterator[Any]:
    resolver = ds.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    try:
        yield ds.ParameterServerStrategy(resolver)
    finally:
        ds.testing.stop_in_process_cluster(resolver)


def _train_synchronously(strategy: Any, model: Net, optimizer: torch.optim.Optimizer) -> None:
    data = strategy.experimental_distribute_dataset([(torch.ones(4, 3), torch.zeros(4, 1))])
    for x, y in data:
        strategy.run(_step, args=(model, optimizer, x, y))


def _train_on_parameter_servers(strategy: Any, model: Net, optimizer: torch.optim.Optimizer) -> None:
    coordinator = ds.coordinator.ClusterCoordinator(strategy)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # model and optimizer travel as references
        return _step(model, optimizer, x, y)

    result = coordinator.schedule(step, args=(torch.ones(4, 3), torch.zeros(4, 1)))
    coordinator.join()
    assert torch.isfinite(result.fetch())


STRATEGIES: dict[str, tuple[Callable[[], Any], set[str], set[str]]] = {
    # name: (strategy, instance attributes added to each module, ... to the optimizer)
    "default": (ds.get_strategy, set(), set()),
    "one_device": (lambda: ds.OneDeviceStrategy("cpu"), set(), set()),
    "mirrored": (lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]), {"forward"}, {"step", "zero_grad"}),
    "central_storage": (
        lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
        {"forward"},
        {"step", "zero_grad"},
    ),
    "multi_worker": (
        lambda: ds.MultiWorkerMirroredStrategy(
            cluster_resolver=ds.cluster_resolver.TFConfigClusterResolver(environ={}), devices=["cpu"]
        ),
        set(),
        set(),
    ),
}


def _class_dicts() -> dict[str, dict[str, int]]:
    classes = [torch.nn.Module, torch.nn.Linear, torch.nn.Sequential, torch.optim.Optimizer, torch.optim.SGD, Net]
    return {c.__qualname__: {k: id(v) for k, v in vars(c).items()} for c in classes}


def _check(
    strategy: Any,
    train: Callable[[Any, Net, torch.optim.Optimizer], None],
    module_attrs: set[str],
    optimizer_attrs: set[str],
) -> None:
    reference_model, reference_optimizer = _plain()
    classes = _class_dicts()
    with strategy.scope():
        model = Net()
        built = [(type(m), set(vars(m))) for m in model.modules()]
        params = list(model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(strategy, model, optimizer)

    assert [type(m) for m in model.modules()] == [t for t, _ in built]
    assert all(a is b for a, b in zip(model.parameters(), params)) and len(list(model.parameters())) == len(params)
    added = {name for m, (_, before) in zip(model.modules(), built) for name in set(vars(m)) - before}
    assert added == module_attrs, f"{type(strategy).__name__} set {added} on the modules"
    assert {name for m in reference_model.modules() for name in vars(m)} | module_attrs >= {
        name for m in model.modules() for name in vars(m)
    }
    assert type(optimizer) is torch.optim.SGD
    assert set(vars(optimizer)) - set(vars(reference_optimizer)) == optimizer_attrs
    assert _class_dicts() == classes, "a torch class was changed"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_user_objects_are_unchanged_under_synchronous_strategies(name: str) -> None:
    make, module_attrs, optimizer_attrs = STRATEGIES[name]
    _check(make(), _train_synchronously, module_attrs, optimizer_attrs)


def test_user_objects_are_unchanged_under_parameter_servers(ps_strategy: Any) -> None:
    _check(ps_strategy, _train_on_parameter_servers, set(), {"step", "zero_grad", "load_state_dict"})


def test_the_check_sees_an_attribute_a_strategy_would_set() -> None:
    """Planted: a strategy that tags the modules it distributes is caught."""
    strategy = ds.OneDeviceStrategy("cpu")
    distribute = strategy.distribute_module

    def tagging(module: torch.nn.Module) -> None:
        distribute(module)
        for m in module.modules():
            m._distrib_owner = strategy  # what the rule forbids

    strategy.distribute_module = tagging  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="_distrib_owner"):
        _check(strategy, _train_synchronously, set(), set())
