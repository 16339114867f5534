"""The training picture: ``training.png`` beside ``metrics.jsonl``, drawn from it.

``distrib train`` draws it when the run ends; ``distrib plot RUN_DIR`` draws it again later
(from a run directory, or from a metrics file). Two panels, loss and accuracy, against the
epoch: the training values every ``--log-every`` steps (running means over the epoch so far,
as the progress bar shows them), and per epoch the training and test values.

matplotlib is an extra (``pip install 'distrib[plot]'``); without it nothing is drawn and
:func:`draw_run` returns one line saying how to get the picture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PICTURE", "Curves", "read_metrics", "draw", "draw_run", "plot_arguments", "plot_command"]

PICTURE = "training.png"
METRICS = "metrics.jsonl"
NO_MATPLOTLIB = "training picture not drawn: matplotlib is missing; pip install 'distrib[plot]', then: distrib plot {}"


@dataclass
class Curves:
    """What a ``metrics.jsonl`` holds, as (x, y) points; x in epochs (2.5: half-way through epoch 3).

    Step lines hold running means over the epoch so far; the step curves of ``loss`` and
    ``accuracy`` are the means over each interval between two step lines instead (from the
    running means and the step counts), so they follow training without a jump at each epoch.

    >>> rows = [{"step": 2, "epoch": 1, "loss": 1.0}, {"step": 4, "epoch": 1, "loss": 0.8},
    ...         {"epoch": 1, "loss": 0.8, "val_loss": 0.9, "steps": 4}]
    >>> c = Curves.from_rows(rows)
    >>> [(x, round(y, 4)) for x, y in c.step["loss"]], c.epoch["val_loss"]
    ([(0.5, 1.0), (1.0, 0.6)], [(1.0, 0.9)])
    """

    step: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    epoch: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]]) -> Curves:
        curves = cls()
        epoch_rows = [r for r in rows if "step" not in r]
        ends = {int(r["epoch"]): int(r["steps"]) for r in epoch_rows if "steps" in r}  # steps done at each epoch's end
        step_rows = [r for r in rows if "step" in r]
        guess = max((ends[e] - ends.get(e - 1, 0) for e in ends), default=0)
        if not guess and step_rows:  # no epoch finished: the steps of the first epoch so far
            guess = max(int(r["step"]) for r in step_rows if int(r["epoch"]) == int(step_rows[0]["epoch"]))
        previous: dict[tuple[int, str], tuple[int, float]] = {}  # (epoch, key): (steps into the epoch, running mean)
        for r in step_rows:
            e = int(r["epoch"])
            known = e == 1 or e - 1 in ends  # where the epoch began, hence how many steps a running mean covers
            begin = ends.get(e - 1, guess * (e - 1))
            length = (ends[e] - begin) if e in ends else guess
            n = int(r["step"]) - begin
            x = (e - 1) + n / max(length, 1)
            for key, value in r.items():
                if key in ("step", "epoch", "seconds") or not isinstance(value, (int, float)):
                    continue
                y = float(value)
                if known and key in ("loss", "accuracy") and (e, key) in previous and n > previous[(e, key)][0]:
                    pn, pm = previous[(e, key)]
                    y = (y * n - pm * pn) / (n - pn)  # the mean over the steps since the previous line
                previous[(e, key)] = (n, float(value))
                curves.step.setdefault(key, []).append((x, y))
        for r in epoch_rows:
            for key, value in r.items():
                if key not in ("epoch", "seconds", "steps") and isinstance(value, (int, float)):
                    curves.epoch.setdefault(key, []).append((float(r["epoch"]), float(value)))
        return curves


def read_metrics(path: str) -> Curves:
    """Read a ``metrics.jsonl`` written by ``distrib train`` (or a ``JsonlLogger``)."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}, line {number}, is not JSON ({e}): give the metrics.jsonl that distrib train wrote"
                    ) from None
    if not rows:
        raise ValueError(f"{path} holds no metrics yet: run distrib train first")
    return Curves.from_rows(rows)


def _panel(ax: Any, curves: Curves, name: str, scale: float, unit: str) -> None:
    styles = {"": ("tab:blue", "train"), "val_": ("tab:orange", "test")}
    last = {p: curves.epoch[p + name][-1][1] for p in styles if p + name in curves.epoch}
    top = max(last, key=lambda p: last[p]) if last else ""  # its value is written above its point, the other below
    for prefix, (color, label) in styles.items():
        key = prefix + name
        if key in curves.step:
            xs, ys = zip(*curves.step[key])
            ax.plot(
                xs,
                [y * scale for y in ys],
                color=color,
                alpha=0.45,
                linewidth=1,
                label=f"{label}, per step (mean of each interval)",
            )
        if key in curves.epoch:
            xs, ys = zip(*curves.epoch[key])
            ax.plot(xs, [y * scale for y in ys], color=color, marker="o", linewidth=2, label=f"{label}, per epoch")
            ax.annotate(
                f"{ys[-1] * scale:.{2 if scale == 100 else 4}f}",
                (xs[-1], ys[-1] * scale),
                textcoords="offset points",
                xytext=(4, 4 if prefix == top else -11),
                color=color,
                fontsize=8,
            )
    ax.set_title(name.capitalize() + unit)
    ax.set_xlabel("epoch")
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.15, y=0.08)  # room for the last values written beside their points
    ax.legend(fontsize=8)


def draw(curves: Curves, output: str, title: str = "") -> str:
    """Draw ``curves`` into the PNG ``output`` (needs matplotlib); returns ``output``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    names = [n for n in ("loss", "accuracy") if n in curves.step or n in curves.epoch]
    if not names:
        raise ValueError(f"nothing to draw into {output}: the metrics have no loss or accuracy")
    fig = Figure(figsize=(5.5 * len(names), 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        _panel(ax, curves, name, 100.0 if name == "accuracy" else 1.0, " (%)" if name == "accuracy" else "")
    if title:
        fig.suptitle(title)
    fig.savefig(output, format="png")
    return output


def draw_run(metrics_file: str, output: str | None = None) -> str:
    """Draw ``training.png`` beside ``metrics_file``; return the line to print (where it went, or how to get it)."""
    run_dir = os.path.dirname(os.path.abspath(metrics_file))
    output = output or os.path.join(run_dir, PICTURE)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return NO_MATPLOTLIB.format(run_dir)
    curves = read_metrics(metrics_file)
    last = dict(curves.epoch.get("val_accuracy", []))
    title = os.path.basename(run_dir)
    if last:
        title += f": test accuracy {last[max(last)] * 100:.2f}% after epoch {max(last):.0f}"
    draw(curves, output, title)
    return f"Training picture: {output}"


def plot_arguments(p: argparse.ArgumentParser) -> None:
    """``distrib plot``'s arguments."""
    p.add_argument(
        "run", metavar="RUN_DIR", help="a run's checkpoint directory (holding metrics.jsonl), or a metrics file"
    )
    p.add_argument("-o", "--output", default=None, help="where to write the PNG (default: RUN_DIR/training.png)")


def plot_command(args: argparse.Namespace) -> int:
    """``distrib plot RUN_DIR``: draw the run's picture again."""
    path = os.path.join(args.run, METRICS) if os.path.isdir(args.run) else args.run
    if not os.path.exists(path):
        print(
            f"distrib plot: {path} does not exist; give the --checkpoint-dir of a distrib train run "
            "(or its --metrics-file)",
            file=sys.stderr,
        )
        return 2
    try:
        message = draw_run(path, args.output)
    except ValueError as e:
        print(f"distrib plot: {e}", file=sys.stderr)
        return 2
    if message.startswith("training picture not drawn"):
        print(f"distrib plot: {message}", file=sys.stderr)
        return 1
    print(message)
    return 0
