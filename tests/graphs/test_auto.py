"""What ``"auto"`` decides: ``fit(jit_compile="auto")`` and ``distrib train`` run eagerly, as Keras 3 resolves
``jit_compile="auto"`` on the torch backend, even where a graph could be captured (a GPU); ``True`` and
``--function`` turn ``ds.function`` on."""

from __future__ import annotations

import argparse

import pytest
import torch

import distrib as ds
from distrib.app.cli import build_parser
from distrib.app.train import TrainConfig, use_function
from distrib.graphs import paths
from distrib.keras.loop import _graphs_wanted


@pytest.fixture
def capture_would_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where a graph could be captured (a GPU and a strategy that can be), as far as "auto" may ask."""
    monkeypatch.setattr(paths, "pays_here", lambda *args, **kwargs: True, raising=False)


def test_fit_auto_is_eager_even_where_a_graph_could_be_captured(capture_would_pay):
    strategy, model = ds.get_strategy(), torch.nn.Linear(2, 2)
    assert _graphs_wanted("auto", strategy, model) is False
    assert _graphs_wanted(True, strategy, model) is True and _graphs_wanted(False, strategy, model) is False
    with pytest.raises(ValueError, match="jit_compile='xla'"):
        _graphs_wanted("xla", strategy, model)


def test_distrib_train_runs_eagerly_unless_given_function(capture_would_pay):
    strategy = ds.get_strategy()
    assert use_function(TrainConfig(), strategy) is False
    assert use_function(TrainConfig(function=True), strategy) is True
    (subcommands,) = [a for a in build_parser("train")._actions if isinstance(a, argparse._SubParsersAction)]
    help_text = " ".join(subcommands.choices["train"].format_help().split())
    assert "Default: off (eager), as Keras 3 resolves" in help_text, help_text
