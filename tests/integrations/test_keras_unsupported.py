"""The strategies that do not take Keras 3 models yet say so when the model is built in their scope, naming what
works instead (never a silent difference)."""

from __future__ import annotations

import pytest

import distrib as ds

keras = pytest.importorskip("keras")

from helpers import SCRIPTS, launch  # noqa: E402


def test_sharded_strategy_on_several_workers_refuses_a_keras_model() -> None:
    code, log, _ = launch("--workers", "2", str(SCRIPTS / "keras_unsupported.py"), timeout=120)
    assert code == 0, log
    assert log.count("refused: Keras model") == 2, log
    assert "MultiWorkerMirroredStrategy" in log and "accepted" not in log


def test_parameter_server_strategy_refuses_a_keras_model() -> None:
    with ds.testing.LocalCluster(num_workers=1, num_ps=1) as cluster:
        cluster.wait_ready(timeout=120)
        strategy = ds.ParameterServerStrategy(cluster.resolver(), token=cluster.token)
        with pytest.raises(NotImplementedError, match="ParameterServerStrategy does not support Keras models"):
            with strategy.scope():
                keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
