"""The training picture: `training.png` from `metrics.jsonl`, `distrib plot RUN_DIR`, and life without matplotlib."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from distrib.app.cli import main
from distrib.app.plot import Curves, draw_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's tab:blue (train) and tab:orange (test)


def write_run(run: Path, epochs: int = 3, steps: int = 8, every: int = 2) -> Path:
    """A metrics.jsonl as distrib train writes it: step lines (with "step") and epoch lines (with "steps")."""
    run.mkdir(parents=True, exist_ok=True)
    rows, step = [], 0
    for epoch in range(1, epochs + 1):
        for _ in range(steps):
            step += 1
            if step % every == 0:
                rows.append(
                    {
                        "step": step,
                        "epoch": epoch,
                        "loss": 2.0 / (step + 1),
                        "accuracy": 1 - 1.0 / (step + 1),
                        "seconds": step * 0.1,
                    }
                )
        rows.append(
            {
                "epoch": epoch,
                "loss": 2.0 / (step + 1),
                "accuracy": 1 - 1.0 / (step + 1),
                "val_loss": 2.2 / (step + 1),
                "val_accuracy": 0.9 - 1.0 / (step + 1),
                "examples_per_sec": 100.0,
                "seconds": step * 0.1,
                "steps": step,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run / "metrics.jsonl"


def check_png(path: Path) -> tuple[int, int]:
    """A real picture: the PNG signature, an IHDR of a sensible size, and drawn curves in both colours."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 2000 and 300 <= height <= 1000
    pixels = (imread(str(path))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert pixels.shape[0] == width * height
    for colour in (BLUE, ORANGE):  # the train and test curves are drawn, not an empty frame
        near = (abs(pixels - colour).sum(axis=1) < 30).sum()
        assert near > 500, (colour, near)
    assert (pixels.min(axis=1) > 245).mean() > 0.5  # mostly white background: a plot, not noise
    return width, height


def test_steps_are_placed_within_their_epoch_and_epochs_at_their_end():
    curves = Curves.from_rows(
        [
            {"step": 2, "epoch": 1, "loss": 1.0},
            {"step": 4, "epoch": 1, "loss": 0.9},
            {"epoch": 1, "loss": 0.9, "val_loss": 1.1, "steps": 4},
            {"step": 6, "epoch": 2, "loss": 0.8},
            {"step": 8, "epoch": 2, "loss": 0.7},
            {"epoch": 2, "loss": 0.7, "val_loss": 1.0, "steps": 8},
            {"step": 10, "epoch": 3, "loss": 0.6},  # an epoch in progress: as long as the last one
        ]
    )
    assert [x for x, _ in curves.step["loss"]] == [0.5, 1.0, 1.5, 2.0, 2.5]
    # running means become the mean over each interval: (0.9 * 4 - 1.0 * 2) / 2 = 0.8, ...
    assert [round(y, 6) for _, y in curves.step["loss"]] == [1.0, 0.8, 0.8, 0.6, 0.6]
    assert curves.epoch["val_loss"] == [(1.0, 1.1), (2.0, 1.0)] and "steps" not in curves.epoch


def test_draw_run_writes_a_valid_png_and_distrib_plot_draws_it_again(tmp_path, capsys):
    metrics = write_run(tmp_path / "run")
    message = draw_run(str(metrics))
    picture = tmp_path / "run" / "training.png"
    assert message == f"Training picture: {picture}"
    size = check_png(picture)
    picture.unlink()
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert check_png(picture) == size and capsys.readouterr().out.strip() == f"Training picture: {picture}"
    assert main(["plot", str(metrics), "--output", str(tmp_path / "again.png")]) == 0
    check_png(tmp_path / "again.png")


def test_without_matplotlib_one_line_says_how_to_get_the_picture(tmp_path, monkeypatch, capsys):
    metrics = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    message = draw_run(str(metrics))
    assert "\n" not in message and "pip install 'distrib[plot]'" in message
    assert f"distrib plot {tmp_path / 'run'}" in message
    assert not (tmp_path / "run" / "training.png").exists()
    assert main(["plot", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "distrib[plot]" in err


def test_plot_refuses_a_missing_run_or_a_file_that_is_not_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "nowhere does not exist; give the --checkpoint-dir" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "loss": 1.0}\nnot json\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "line 2, is not JSON" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no metrics yet" in capsys.readouterr().err
