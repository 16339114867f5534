"""The ``distrib`` command line, built from a registry of subcommands.

    distrib train [--strategy mirrored] [--epochs 10] ...   the main job (seed 000's workload)

Each subcommand registers a function that adds its arguments to a parser and a
function that runs it; ``main`` returns the process exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, NamedTuple, Optional, Sequence

__all__ = ["main", "register"]


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add a subcommand to ``distrib``."""
    COMMANDS[name] = Command(help, add_arguments, run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", choices=["default", "one-device", "mirrored", "multi-worker", "parameter-server"],
                   default=None,
                   help="distribution strategy (default: mirrored over every local device; "
                        "multi-worker with --workers N)")
    p.add_argument("--workers", type=_positive, default=1,
                   help="run the job on N worker processes (MultiWorkerMirroredStrategy) through distrib launch")
    p.add_argument("--ps", type=int, default=0, help="parameter-server tasks for --strategy parameter-server")
    p.add_argument("--max-restarts", type=int, default=0, help="with --workers: restarts of the whole group")
    p.add_argument("--epochs", type=_positive, default=10)
    p.add_argument("--batch-size-per-replica", type=_positive, default=64)
    p.add_argument("--replicas", type=_positive, default=None,
                   help="number of replicas for --strategy mirrored (logical CPU replicas when there is no GPU)")
    p.add_argument("--device", default=None, help="device for --strategy one-device (default: cuda:0 or cpu)")
    p.add_argument("--checkpoint-dir", default="./training_checkpoints")
    p.add_argument("--data-dir", default=None,
                   help="directory of the Fashion-MNIST IDX files (default: /usr/share/datasets/fashion-mnist)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="compile the model with torch.compile (falls back to eager if it fails)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar during each epoch (default: when stdout is a terminal)")
    p.add_argument("--fit", action="store_true", help="run the job through ds.fit instead of the custom loop")
    p.add_argument("--tensorboard", metavar="DIR", default=None, help="write TensorBoard scalars to DIR (chief only)")
    p.add_argument("--metrics-file", default=None,
                   help="one JSON line per epoch (default: CHECKPOINT_DIR/metrics.jsonl, rewritten every run)")


def _train(args: argparse.Namespace) -> int:
    from distrib.datasets import DatasetNotFoundError
    from distrib.train import TrainConfig, train

    strategy = args.strategy or ("parameter-server" if args.ps else "multi-worker" if args.workers > 1 else "mirrored")
    if args.ps and strategy != "parameter-server":
        print(f"distrib train: --ps needs --strategy parameter-server, not {strategy}", file=sys.stderr)
        return 2
    if args.workers > 1 or args.ps:
        if strategy not in ("multi-worker", "parameter-server"):
            print(f"distrib train: --workers {args.workers} needs --strategy multi-worker or parameter-server, "
                  f"not {strategy}", file=sys.stderr)
            return 2
        if strategy == "parameter-server" and not args.ps:
            print("distrib train: --strategy parameter-server with --workers needs --ps M (e.g. --ps 1)",
                  file=sys.stderr)
            return 2
        from distrib.launch import LaunchConfig, launch

        child = ["-m", "distrib.cli", "train", "--strategy", strategy, "--epochs", str(args.epochs),
                 "--batch-size-per-replica", str(args.batch_size_per_replica), "--checkpoint-dir",
                 args.checkpoint_dir, "--seed", str(args.seed), "--no-progress"]
        for flag, value in (("--replicas", args.replicas), ("--data-dir", args.data_dir),
                            ("--tensorboard", args.tensorboard), ("--metrics-file", args.metrics_file)):
            if value is not None:
                child += [flag, str(value)]
        if args.fit:
            child.append("--fit")
        return launch(LaunchConfig(command=child, workers=args.workers, ps=args.ps, max_restarts=args.max_restarts))

    config = TrainConfig(
        strategy=strategy, epochs=args.epochs, batch_size_per_replica=args.batch_size_per_replica,
        replicas=args.replicas, device=args.device, checkpoint_dir=args.checkpoint_dir, data_dir=args.data_dir,
        seed=args.seed, compile=args.compile, progress=args.progress, fit=args.fit, tensorboard=args.tensorboard,
        metrics_file=args.metrics_file,
    )
    try:
        train(config)
    except DatasetNotFoundError as e:
        print(f"distrib train: {e}", file=sys.stderr)
        return 2
    return 0


register("train", "train the Fashion-MNIST CNN of the tf.distribute tutorial (the main job)", _train_arguments, _train)


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_positive, default=1, help="worker tasks")
    p.add_argument("--ps", type=int, default=0, help="parameter-server tasks (the chief then runs the script)")
    p.add_argument("--chief", action="store_true", help="add a 'chief' task besides the workers")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="on a failure, stop the whole group and start it again, at most K times")
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                   help="the script each task runs (or -m MODULE)")


def _launch(args: argparse.Namespace) -> int:
    from distrib.launch import LaunchConfig, launch

    command = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not command:
        print("distrib launch: name the script to run, e.g. distrib launch --workers 2 train.py", file=sys.stderr)
        return 2
    return launch(LaunchConfig(command=command, workers=args.workers, ps=args.ps, chief=args.chief,
                               max_restarts=args.max_restarts))


register("launch", "run a local cluster: one process per task, each with its TF_CONFIG", _launch_arguments, _launch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distrib", description="tf.distribute-style training for PyTorch")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
