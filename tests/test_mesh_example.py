"""examples/mesh_decoder.py runs as its docstring says: FSDP x TP on 4 workers gives one process's losses."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers import launch, run_bounded

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mesh_decoder.py"


def _losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"step \d+ loss ([\d.]+)", log)]


def test_mesh_decoder_on_four_workers_gives_one_process_losses(tmp_path: Path) -> None:
    code, one, _ = run_bounded([sys.executable, str(EXAMPLE), "--steps", "6"], timeout=120)
    assert code == 0, one
    code, four, _ = launch(
        "--workers", "4", str(EXAMPLE), "--steps", "6", "--checkpoint", str(tmp_path / "ckpt"), timeout=240
    )
    assert code == 0, four
    reference, got = _losses(one), _losses(four)
    assert len(reference) == len(got) == 6 and reference[-1] < reference[0]
    assert max(abs(a - b) for a, b in zip(reference, got)) <= 1e-5, (reference, got)
    assert (tmp_path / "ckpt-1.dcp").is_dir(), four  # every worker wrote its own shards
