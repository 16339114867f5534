"""`distrib` command line: every `train` option reaches the worker processes; strategies come from the registry."""

from __future__ import annotations

import pytest

from distrib.app.cli import build_parser, forwarded_arguments
from distrib.strategies import registry

# a value other than the default for every option of `distrib train`
EVERY_OPTION = [
    "--strategy",
    "multi-worker",
    "--workers",
    "3",
    "--ps",
    "0",
    "--max-restarts",
    "2",
    "--epochs",
    "4",
    "--batch-size-per-replica",
    "16",
    "--replicas",
    "2",
    "--device",
    "cpu",
    "--checkpoint-dir",
    "/c",
    "--data-dir",
    "/d",
    "--seed",
    "7",
    "--compile",
    "--no-progress",
    "--fit",
    "--tensorboard",
    "/tb",
    "--metrics-file",
    "/m.jsonl",
    "--log-every",
    "7",
    "--precision",
    "bf16-mixed",
    "--tls",
    "--no-function",
]


def test_every_train_option_is_forwarded_to_the_workers_except_the_launcher_s_own():
    args = build_parser().parse_args(["train", *EVERY_OPTION])
    child = forwarded_arguments(args)
    assert "--compile" in child and "--workers" not in child and "--max-restarts" not in child and "--tls" not in child
    again = build_parser().parse_args(["train", *child])
    launcher_only = {"workers", "max_restarts", "ps", "tls"}
    for name, value in vars(args).items():
        if name not in launcher_only:
            assert getattr(again, name) == value, name
    # and every option of the parser is in EVERY_OPTION, so a new option cannot be left out of this test
    parser_options = {o for o in build_parser().parse_args(["train"]).__dict__} - {"command", "verbose"}
    assert parser_options == {
        o.lstrip("-").replace("-", "_") for o in EVERY_OPTION if o.startswith("--") and not o.startswith("--no-")
    } | {"progress", "function"}


def test_defaults_are_not_forwarded_and_booleans_keep_their_sense():
    args = build_parser().parse_args(["train", "--progress"])
    assert forwarded_arguments(args) == ["--progress"]


def test_strategy_choices_and_help_come_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name in registry.names():
        assert name in text and registry.get(name).description.split()[0] in text


def test_a_strategy_that_cannot_run_on_workers_is_refused(capsys):
    from distrib.app.cli import main

    assert main(["train", "--strategy", "mirrored", "--workers", "2"]) == 2
    assert "needs a multi-worker strategy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--ps", "-1"],
        ["train", "--max-restarts", "-1"],
        ["train", "--workers", "0"],
        ["train", "--epochs", "-3"],
        ["launch", "--ps", "-1", "x.py"],
        ["launch", "--max-restarts", "-2", "x.py"],
        ["train", "--workers", "two"],
    ],
)
def test_bad_counts_are_an_argparse_error_not_a_traceback(argv, capsys):
    from distrib.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err


def test_version_names_distrib_torch_and_python(capsys):
    import torch

    import distrib
    from distrib.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip().startswith(f"distrib {distrib.__version__} (torch {torch.__version__}")


@pytest.mark.parametrize("command", [None, "train", "launch", "plot"])
def test_every_help_shows_every_meaningful_default(command, capsys):
    """Every option whose default is a value (not None / False) shows it in --help (as argparse's defaults
    formatter does); options whose default is None or False explain themselves."""
    import argparse

    parser = build_parser()
    if command is not None:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    shown = 0
    for action in parser._actions:
        if (
            action.option_strings
            and action.default is not None
            and not isinstance(action.default, bool)
            and action.default != argparse.SUPPRESS
        ):
            assert f"default: {action.default}" in text, (command, action.option_strings)
            shown += 1
    assert shown >= {None: 0, "train": 8, "launch": 3, "plot": 0}[command]
    if command == "train":
        assert "--epochs EPOCHS passes over the training set (default: 10)" in text
        assert "--log-every N" in text and "(default: 50)" in text
    if command == "plot":
        assert "default: RUN_DIR/training.png" in text
