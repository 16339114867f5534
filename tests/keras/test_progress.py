"""Progress (`Progbar`): Keras' bar for fit, and tqdm's (`style="tqdm"`) for `distrib train`'s custom loop."""

from __future__ import annotations

import io
import re

import pytest

from distrib.app.train import _postfix
from distrib.keras.progress import LINE_INTERVAL, Progbar, line_interval


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_is_redrawn_in_place_with_the_logs(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = Terminal()
    bar = Progbar(4, verbose=1, stream=out, interval=0)
    for step in range(1, 5):
        bar.update(step, {"loss": 1.0 / step, "accuracy": 0.25 * step}, finalize=step == 4)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "\r1/4 [======>" in text and "ETA: " in text and "loss: 0.5000 - accuracy: 0.5000" in text
    assert re.search(r"\r4/4 \[=+\] - \d+s \d+[mu]?s/step - loss: 0\.2500 - accuracy: 1\.0000", text)


def test_on_a_narrow_terminal_the_bar_narrows_instead_of_wrapping(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the tmux window of issue 13
    out = Terminal()
    bar = Progbar(938, verbose=1, stream=out, interval=0)
    logs = {"loss": 0.5082, "accuracy": 0.8154, "val_loss": 0.3802, "val_accuracy": 0.8638}
    bar.update(400, logs)
    bar.update(938, logs, finalize=True)
    lines = out.getvalue().strip("\n").split("\r")[1:]
    assert len(lines) == 2 and all(len(line.rstrip()) <= 119 for line in lines), lines
    assert lines[1].startswith("938/938 [==========") and lines[1].rstrip().endswith("val_accuracy: 0.8638")


def test_on_a_pipe_verbose_1_writes_bar_lines_every_interval_then_the_epoch_line():
    out = io.StringIO()
    bar = Progbar(3, verbose=1, stream=out, line_interval=0)
    for step in range(1, 4):
        bar.update(step, {"loss": 0.5}, finalize=step == 3)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(" [")[0] for line in lines[:2]] == ["1/3", "2/3"] and "loss: 0.5000" in lines[1]
    assert re.fullmatch(r"3/3 - \d+s - loss: 0\.5000 - \d+s/epoch - \d+[mu]?s/step", lines[2])


def test_on_a_pipe_a_short_epoch_writes_only_its_epoch_line_as_verbose_2():
    for verbose in (1, 2):
        out = io.StringIO()
        bar = Progbar(50, verbose=verbose, stream=out)  # 10 s between lines: none in a fast loop
        for step in range(1, 51):
            bar.update(step, {"loss": 0.5}, finalize=step == 50)
        assert out.getvalue().count("\n") == 1 and out.getvalue().startswith("50/50 - ")


def test_the_line_interval_comes_from_distrib_progress_interval(monkeypatch):
    monkeypatch.delenv("DISTRIB_PROGRESS_INTERVAL", raising=False)
    assert line_interval() == LINE_INTERVAL == 10.0
    monkeypatch.setenv("DISTRIB_PROGRESS_INTERVAL", "2.5")
    assert line_interval() == 2.5 and Progbar(3).line_interval == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("DISTRIB_PROGRESS_INTERVAL", bad)
        with pytest.raises(ValueError, match=f"DISTRIB_PROGRESS_INTERVAL='{bad}'.*0 or more"):
            line_interval()


def test_the_custom_loop_s_progress_lines_carry_the_running_loss_and_accuracy(capsys):
    bar = Progbar(4, verbose=1, style="tqdm", desc="epoch 1/3", line_interval=0, postfix=_postfix)
    for step in range(1, 5):
        bar.update(step, {"loss": 1.0 / step, "accuracy": 0.2 * step} if step % 2 == 0 else None)
    bar.update(4, finalize=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("epoch 1/3: ") for line in lines)
    assert "| 1/4 [" in lines[0] and "loss=" not in lines[0]
    assert lines[3].startswith("epoch 1/3: 100%|") and lines[3].endswith("loss=0.2500, accuracy=80.00]")


def test_the_tqdm_style_is_silent_at_verbose_0_and_refuses_an_unknown_style(capsys):
    bar = Progbar(4, verbose=0, style="tqdm", desc="epoch 1/1", line_interval=0)
    bar.update(1, {"loss": 1.0, "accuracy": 0.5})
    bar.update(1, finalize=True)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="style='rich'.*'keras' or 'tqdm'"):
        Progbar(4, style="rich")
