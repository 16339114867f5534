"""ds.fit with BackupAndRestore(save_before_preemption=True) under `distrib launch` (issue 23): a SIGTERM to one
worker before a batch makes both save the backup before the same batch and exit 42; the launcher restarts the
group, fit resumes at that batch (mid-epoch), and the parameters equal an uninterrupted fit's."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from helpers import SCRIPTS, launch


def _fit(tmp_path: Path, name: str, *extra: str) -> tuple[str, list[torch.Tensor]]:
    out = tmp_path / f"{name}.pt"
    code, text, _ = launch(
        "--workers",
        "2",
        str(SCRIPTS / "preempt_fit.py"),
        "--out",
        str(out),
        "--backup-dir",
        str(tmp_path / f"{name}-backup"),
        *extra,
        timeout=240,
    )
    assert code == 0, text
    return text, torch.load(out)


def test_fit_saves_before_the_agreed_batch_and_resumes_there(tmp_path):
    _, expected = _fit(tmp_path, "clean")
    text, got = _fit(tmp_path, "preempted", "--notice-at", "13")  # epoch 2, batch 3 of 10
    saved = re.findall(r"worker (\d): preemption checkpoint at run (\d+) saved", text)
    assert len(saved) == 2 and len({run for _, run in saved}) == 1, text  # both, at the same batch
    assert "not counted against --max-restarts" in text
    resumed = set(re.findall(r"START worker=\d restart=1 epoch=(\d+) step=(\d+)", text))
    # the notice came during batch 13's begin hooks, after the handler's look: seen before batch 14, where the
    # worker proposed the next batch (TF's +1: a peer may already be inside batch 14), so both saved before batch 15
    assert resumed == {("1", "5")}, text
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
