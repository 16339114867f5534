"""The strategy registry: every name builds its strategy; unknown names are refused with the choices."""

from __future__ import annotations

import pytest

import distrib as ds
from distrib.strategies import registry


def test_every_synchronous_name_builds_its_strategy():
    assert registry.build("default") is ds.get_strategy()
    assert isinstance(registry.build("one-device", registry.StrategyRequest(device="cpu")), ds.OneDeviceStrategy)
    mirrored = registry.build("mirrored", registry.StrategyRequest(replicas=3))
    assert isinstance(mirrored, ds.MirroredStrategy) and mirrored.num_replicas_in_sync == 3
    one_worker = registry.build("multi-worker", registry.StrategyRequest(replicas=2))
    assert isinstance(one_worker, ds.MultiWorkerMirroredStrategy) and one_worker.num_workers == 1


def test_the_parameter_server_entry_builds_an_in_process_cluster_without_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = registry.build("parameter-server", registry.StrategyRequest(workers=1, ps=1))
    try:
        assert isinstance(strategy, ds.ParameterServerStrategy) and strategy.should_use_with_coordinator
    finally:
        ds.testing.stop_in_process_cluster(strategy.cluster_resolver)


def test_entries_say_what_the_launcher_may_start():
    assert [n for n in registry.names() if registry.get(n).multi_worker] == [
        "multi-worker",
        "sharded",
        "parameter-server",
    ]
    assert [n for n in registry.names() if registry.get(n).parameter_servers] == ["parameter-server"]


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="unknown strategy 'mirored'; choose one of: default, one-device, mirrored"):
        registry.get("mirored")


def test_the_default_strategy_of_each_job_shape_comes_from_the_registry():
    from distrib.strategies import registry

    shapes = {
        "one process": registry.default_name(),
        "--workers 3": registry.default_name(workers=3),
        "--ps 2": registry.default_name(workers=1, ps=2),
    }
    assert shapes == {"one process": "mirrored", "--workers 3": "multi-worker", "--ps 2": "parameter-server"}
    assert registry.get(shapes["--workers 3"]).multi_worker and registry.get(shapes["--ps 2"]).parameter_servers


def test_the_cli_names_no_strategy_itself():
    """Every strategy name the command line uses comes from the registry: no registered name is a string
    literal in app/cli.py or app/train.py (a new default, or a renamed strategy, changes one place)."""
    import ast
    from pathlib import Path

    import distrib.app
    from distrib.strategies import registry

    app = Path(distrib.app.__file__).parent
    names = set(registry.names()) - {"default"}  # also argparse's word for a default value, used as such there
    found = [
        (path.name, node.lineno, node.value)
        for path in (app / "cli.py", app / "train.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    assert not found, f"strategy names written out instead of taken from the registry: {found}"
