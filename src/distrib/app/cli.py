"""The ``distrib`` command line, built from a registry of subcommands.

    distrib train [--strategy mirrored] [--epochs 10] ...   the main job (TF's tutorial's workload)
    distrib launch --workers 2 script.py                    a local cluster, one process per task
    distrib plot RUN_DIR                                    draw a run's training.png again

Each subcommand registers a function that adds its arguments to a parser and a
function that runs it; ``main`` returns the process exit code. Strategy names come
from :mod:`distrib.strategies.registry`, imported only by the subcommands that need it: ``distrib launch``
(a process that only starts and watches its tasks) imports no torch and starts in about 0.1 s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["main", "register", "build_parser", "forwarded_arguments"]


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}

# options of `distrib train` that concern the launcher, not the job each worker runs
_LAUNCHER_OPTIONS = ("workers", "ps", "max_restarts", "tls")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, quiet where the default says nothing (None, False, a help that names it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return super()._get_help_string(action)


def register(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Add a subcommand to ``distrib``."""
    COMMANDS[name] = Command(help, add_arguments, run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _workers_range(text: str) -> tuple[int, int]:
    """``--workers N`` or ``MIN:MAX`` for ``distrib launch`` (see :func:`distrib.cluster.launch.parse_workers`)."""
    from distrib.cluster.launch import parse_workers

    try:
        return parse_workers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def _strategy_help() -> str:
    from distrib.strategies import registry  # imports torch: only where train's options are needed

    return "; ".join(f"{name}: {registry.get(name).description}" for name in registry.names())


def _train_options() -> list[tuple[str, dict[str, Any]]]:
    """``distrib train``'s options: (flag, ``add_argument`` keywords). One table adds and forwards them."""
    from distrib.strategies import registry

    return [
        (
            "--strategy",
            dict(
                choices=registry.names(),
                default=None,
                help=f"distribution strategy (default: {registry.default_name()}; "
                f"{registry.default_name(workers=2)} with --workers N; "
                f"{registry.default_name(ps=1)} with --ps M). {_strategy_help()}",
            ),
        ),
        ("--workers", dict(type=_positive, default=1, help="run the job on N worker processes through distrib launch")),
        ("--ps", dict(type=_non_negative, default=0, help="parameter-server tasks for --strategy parameter-server")),
        ("--max-restarts", dict(type=_non_negative, default=0, help="with --workers: restarts of the whole group")),
        (
            "--tls",
            dict(
                action="store_true",
                default=False,
                help="with --ps: mutual TLS between the tasks, with throwaway certificates",
            ),
        ),
        ("--epochs", dict(type=_positive, default=10, help="passes over the training set")),
        (
            "--batch-size-per-replica",
            dict(type=_positive, default=64, help="examples per replica per step (global batch: this x replicas)"),
        ),
        (
            "--replicas",
            dict(
                type=_positive,
                default=None,
                help="number of replicas for --strategy mirrored (logical CPU replicas without a GPU)",
            ),
        ),
        ("--device", dict(default=None, help="device for --strategy one-device (default: cuda:0 or cpu)")),
        (
            "--checkpoint-dir",
            dict(default="./training_checkpoints", help="checkpoints, metrics.jsonl and training.png of the run"),
        ),
        (
            "--data-dir",
            dict(
                default=None,
                help="directory of the Fashion-MNIST IDX files (default: /usr/share/datasets/fashion-mnist)",
            ),
        ),
        ("--seed", dict(type=_non_negative, default=0, help="seed of the model's initial weights and the shuffling")),
        (
            "--compile",
            dict(
                action=argparse.BooleanOptionalAction,
                default=False,
                help="compile the model with torch.compile (falls back to eager if it fails)",
            ),
        ),
        (
            "--function",
            dict(
                action=argparse.BooleanOptionalAction,
                default=None,
                help="run each step as @ds.function: captured once as a CUDA graph, then replayed "
                "(6x the eager step on an H100 at batch 64). Default: off (eager), as Keras 3 resolves "
                'jit_compile="auto" on torch; the graph guards what the step names (docs: Graphs)',
            ),
        ),
        (
            "--progress",
            dict(
                action=argparse.BooleanOptionalAction,
                default=None,
                help="progress during each epoch, with the running loss and accuracy: a bar when "
                "stdout is a terminal, else a progress line every 10 s (DISTRIB_PROGRESS_INTERVAL; "
                "the chief's, under --workers); --no-progress: the epoch lines only (default: on)",
            ),
        ),
        (
            "--fit",
            dict(
                action="store_true",
                default=False,
                help="run the job through ds.fit instead of the custom loop (Keras' progress bar)",
            ),
        ),
        ("--tensorboard", dict(metavar="DIR", default=None, help="write TensorBoard scalars to DIR (chief only)")),
        (
            "--metrics-file",
            dict(
                default=None,
                help="one JSON line per epoch, and one per --log-every steps "
                '(with a "step" key) (default: CHECKPOINT_DIR/metrics.jsonl, '
                "rewritten every run; training.png is drawn beside it)",
            ),
        ),
        (
            "--log-every",
            dict(
                type=_non_negative,
                default=50,
                metavar="N",
                help="every N training steps, write the running loss and accuracy to the metrics "
                "file and TensorBoard (0: per epoch only)",
            ),
        ),
        (
            "--precision",
            dict(
                choices=["32", "bf16-mixed", "16-mixed"],
                default="32",
                help="32: float32; bf16-mixed: autocast to bfloat16 (fast on CPUs with avx512_bf16 "
                "or AMX and on recent GPUs, slow on AVX2-only CPUs); 16-mixed: autocast to float16 "
                "with a GradScaler (fast on GPUs, slow on the CPUs measured); a mixed precision "
                "that is slow here is measured at the start and named in a note with the faster "
                "choice (Lightning's names)",
            ),
        ),
    ]


def _train_arguments(p: argparse.ArgumentParser) -> None:
    for flag, kwargs in _train_options():
        p.add_argument(flag, **kwargs)


def forwarded_arguments(args: argparse.Namespace, skip: Sequence[str] = _LAUNCHER_OPTIONS) -> list[str]:
    """``distrib train``'s ``args`` written back as options, every option but ``skip``.

    What each worker process of ``distrib train --workers N`` is started with: parsing
    the result gives ``args`` again (tested for every option), so no option is lost.
    """
    argv: list[str] = []
    for flag, kwargs in _train_options():
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest)
        if dest in skip or value == kwargs.get("default"):
            continue
        action = kwargs.get("action")
        if action is argparse.BooleanOptionalAction:
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action == "store_true":
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _train(args: argparse.Namespace) -> int:
    from distrib.app.datasets import DatasetNotFoundError
    from distrib.app.train import TrainConfig, train
    from distrib.startup import freeze_imports
    from distrib.strategies import registry

    freeze_imports()  # torch is imported: its objects are never garbage (about 0.6 CPU-s less at exit)

    name = args.strategy or registry.default_name(workers=args.workers, ps=args.ps)
    entry = registry.get(name)
    if args.ps and not entry.parameter_servers:
        print(f"distrib train: --ps needs a parameter-server strategy, not {name}", file=sys.stderr)
        return 2
    if args.workers > 1 or args.ps:
        if not entry.multi_worker:
            print(
                f"distrib train: --workers {args.workers} needs a multi-worker strategy "
                f"({', '.join(n for n in registry.names() if registry.get(n).multi_worker)}), not {name}",
                file=sys.stderr,
            )
            return 2
        if entry.parameter_servers and not args.ps:
            print(f"distrib train: --strategy {name} with --workers needs --ps M (e.g. --ps 1)", file=sys.stderr)
            return 2
        from distrib.cluster.launch import LaunchConfig, launch

        args.strategy = name
        # the workers' output goes through the launcher's pipes: the chief writes progress lines, which
        # reach this terminal prefixed by its task ("[worker 0] epoch 1/10:  40%|...")
        child = ["-m", "distrib", *(["-v"] if args.verbose else []), "train", *forwarded_arguments(args)]
        return launch(
            LaunchConfig(
                command=child,
                workers=args.workers,
                ps=args.ps,
                max_restarts=args.max_restarts,
                tls=args.tls,
                env=entry.worker_env(args.device) if entry.worker_env else {},
            )
        )

    config = TrainConfig(
        strategy=name,
        epochs=args.epochs,
        batch_size_per_replica=args.batch_size_per_replica,
        replicas=args.replicas,
        device=args.device,
        checkpoint_dir=args.checkpoint_dir,
        data_dir=args.data_dir,
        seed=args.seed,
        compile=args.compile,
        progress=args.progress,
        fit=args.fit,
        tensorboard=args.tensorboard,
        metrics_file=args.metrics_file,
        precision=args.precision,
        log_every=args.log_every,
        function=args.function,
    )
    try:
        train(config)
    except DatasetNotFoundError as e:
        print(f"distrib train: {e}", file=sys.stderr)
        return 2
    return 0


register("train", "train the Fashion-MNIST CNN of the tf.distribute tutorial (the main job)", _train_arguments, _train)


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=_workers_range,
        default="1",
        metavar="N|MIN:MAX",
        help="worker tasks (each prints its lines prefixed by its task: [worker 0] ...); MIN:MAX starts "
        "MAX and, when a worker dies, goes on with the survivors from the last checkpoint while at "
        "least MIN remain",
    )
    p.add_argument(
        "--ps", type=_non_negative, default=0, help="parameter-server tasks (the chief then runs the script)"
    )
    p.add_argument("--chief", action="store_true", default=False, help="add a 'chief' task besides the workers")
    p.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        help="on a failure, stop the whole group and start it again, at most K times. A task exiting "
        "with 42 (it saved a preemption checkpoint: ds.experimental.PreemptionCheckpointHandler) "
        "restarts the group without counting against K",
    )
    p.add_argument(
        "--grace-seconds",
        type=_non_negative_float,
        default=5.0,
        metavar="S",
        help="after forwarding SIGTERM/SIGHUP/SIGINT to the tasks, wait S seconds for them to exit "
        "(e.g. to save a preemption checkpoint) before killing them; the tasks see it as "
        "DISTRIB_GRACE_SECONDS. Set it under the platform's own grace period (Kubernetes' "
        "terminationGracePeriodSeconds, Slurm's KillWait)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="make a throwaway CA and a certificate per task: parameter-server RPCs use mutual TLS "
        "(see docs/security.md)",
    )
    p.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        help="spawn (the default, unless DISTRIB_START_METHOD says otherwise): each task a fresh python SCRIPT "
        "ARGS, as torchrun starts them. forkserver: fork each task from one process that imported torch once, "
        "about 2 CPU-seconds less per task and restart (sweeps, test suites); but torch is imported before the "
        "script runs, so a variable torch reads at import that the script sets in os.environ has no effect (set it "
        "in the launch's environment), ps and /proc/PID/cmdline show the server's command line, and stdin is "
        "/dev/null (docs/multi-node.md)",
    )
    p.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="when a worker dies, the others go on in their processes (MultiWorkerMirroredStrategy("
        "fault_tolerant=True) in the script): the launcher hosts the store they agree through and does not stop "
        "the group; exits 0 when the survivors finish (docs/fault-tolerance.md)",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module each task runs as python -m MODULE does (torchrun's -m)",
    )
    p.add_argument(
        "script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]", help="the script each task runs (or MODULE)"
    )


def _launch(args: argparse.Namespace) -> int:
    from distrib.cluster.launch import LaunchConfig, launch

    command = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not command:
        print("distrib launch: name the script to run, e.g. distrib launch --workers 2 train.py", file=sys.stderr)
        return 2
    if args.module:
        command = ["-m", *command]
    low, high = args.workers
    return launch(
        LaunchConfig(
            command=command,
            workers=high,
            min_workers=low if low != high else None,
            ps=args.ps,
            chief=args.chief,
            max_restarts=args.max_restarts,
            tls=args.tls,
            grace_seconds=args.grace_seconds,
            fault_tolerant=args.fault_tolerant,
            **({"start_method": args.start_method} if args.start_method else {}),  # else LaunchConfig's default
        )
    )


register("launch", "run a local cluster: one process per task, each with its TF_CONFIG", _launch_arguments, _launch)


def _plot_arguments(p: argparse.ArgumentParser) -> None:
    from distrib.app.plot import plot_arguments

    plot_arguments(p)


def _plot(args: argparse.Namespace) -> int:
    from distrib.app.plot import plot_command

    return plot_command(args)


register("plot", "draw a run's training.png again from its metrics.jsonl (needs distrib[plot])", _plot_arguments, _plot)


class _VersionAction(argparse.Action):
    """``--version``: distrib's, torch's and Python's versions (torch imported only when asked)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        default: str = argparse.SUPPRESS,
        help: str | None = None,
    ) -> None:
        super().__init__(
            option_strings=option_strings,
            dest=dest,
            default=default,
            nargs=0,
            help=help or "show the versions of distrib, torch and Python and exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        import torch

        from distrib import __version__

        print(f"distrib {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})")  # as argparse's
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``distrib`` parser, with every registered subcommand.

    ``only``: add the arguments of that subcommand alone (the others are listed, without their options),
    so that parsing ``distrib launch ...`` does not import what ``distrib train``'s options need (torch)."""
    parser = argparse.ArgumentParser(
        prog="distrib", description="tf.distribute-style training for PyTorch", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(name, help=command.help, description=command.help, formatter_class=HelpFormatter)
        if only is None or name == only:
            command.add_arguments(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # the subcommand is the first word that is not an option (distrib's own options take no value)
    named = next((word for word in arguments if not word.startswith("-")), None)
    args = build_parser(only=named if named in COMMANDS else None).parse_args(arguments)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
