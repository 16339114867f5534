"""``ds.fit``'s checkpointing callbacks under ShardedStrategy, unchanged (tests/scripts/sharded_fit.py).

Two workers train 3 epochs with BackupAndRestore (every 2 steps), ModelCheckpoint (every epoch) and a
CheckpointManager keeping 2; worker 1 is killed at step 9 and the launcher restarts the group, which
resumes from the backup. Every callback writes the sharded format (``<prefix>.dcp``: a shard file
per worker). The result equals ``ds.fit`` in one process without interruption.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
from helpers import SCRIPTS, launch

import distrib as ds


def _one_process_reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The same script in this process (the default strategy's ds.fit), its final parameters."""
    argv = sys.argv
    sys.argv = ["sharded_fit.py", str(tmp_path / "reference")]
    try:
        os.makedirs(tmp_path / "reference")
        runpy.run_path(str(SCRIPTS / "sharded_fit.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return torch.load(tmp_path / "reference" / "final.pt", weights_only=True)


def test_backup_model_checkpoint_and_manager_write_shards_and_a_killed_worker_resumes_exactly(tmp_path: Path) -> None:
    code, out, _ = launch(
        "--workers",
        "2",
        "--max-restarts",
        "1",
        str(SCRIPTS / "sharded_fit.py"),
        str(tmp_path / "run"),
        "--kill-at",
        "9",
        timeout=300,
    )
    assert code == 0, out
    assert "worker 1 failed with exit code 137" in out and "restarting the whole group" in out
    run = tmp_path / "run"
    final = torch.load(run / "final.pt", weights_only=True)

    # every callback wrote the sharded format, one shard file per worker
    for epoch in (1, 2, 3):
        assert len(list((run / f"weights.{epoch}.dcp").glob("*.distcp"))) == 2
    assert sorted(os.listdir(run / "manager")) == ["checkpoint", "ckpt-2.dcp", "ckpt-3.dcp"]  # max_to_keep=2
    assert not (run / "backup").exists()  # BackupAndRestore deletes its backup once training ends

    # ModelCheckpoint's last weights load in one plain process: the final parameters
    plain = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    ds.Checkpoint(model=plain).read(str(run / "weights.3")).expect_partial()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in final.items())

    reference = _one_process_reference(tmp_path)
    worst = max((final[k] - v).abs().max().item() for k, v in reference.items())
    assert worst < 1e-5, worst
