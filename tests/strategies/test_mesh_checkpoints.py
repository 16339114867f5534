"""Checkpoints across meshes: saved under one, loaded under another (tests/scripts/mesh_checkpoint_matrix.py).

Savers and loaders: hybrid 2x2 (HSDP), FSDP x TP 2x2, FSDP over 4 and 2 (ShardedStrategy), MWMS 2,
one process (OneDevice) and plain PyTorch. Each saver trains 3 Adam steps and saves; each loader
restores every checkpoint into a model built with another seed and trains 2 more steps: all 49 cells
equal 5 uninterrupted steps in one process. Then the sharded format's safety under the meshes: a save
killed midway under FSDP x TP, a flipped bit and a truncated shard of each mesh's checkpoint, a
hostile ``.metadata`` pickle.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, launch, run_bounded

import distrib as ds
from distrib.checkpoint import sharded_format

sys.path.insert(0, str(SCRIPTS))
from checkpoint_matrix import GLOBAL, batches, build  # noqa: E402

SCRIPT = str(SCRIPTS / "mesh_checkpoint_matrix.py")
# (workers, kinds) per launch; MWMS apart: a process that made a ShardedStrategy first may hang at its exit
RUNS = [(4, ["hybrid", "fsdp_tp", "sharded"]), (2, ["sharded"]), (2, ["mwms"]), (1, ["plain", "one_device"])]
NAMES = ["hybrid-4", "fsdp_tp-4", "sharded-4", "sharded-2", "mwms-2", "one_device-1", "plain-1"]
# the README's suite: the two meshes and plain PyTorch, each saved and loaded under the others (9 cells, 4
# launches instead of 8); the whole matrix (49 cells) is faults_full's (bash scripts/faults.sh)
FAST_RUNS = [(4, ["hybrid", "fsdp_tp"]), (1, ["plain"])]
FAST_NAMES = ["hybrid-4", "fsdp_tp-4", "plain-1"]


def _run(mode: str, directory: Path, workers: int, kinds: list[str]) -> str:
    if workers == 1:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
        code, out, _ = run_bounded([sys.executable, SCRIPT, mode, str(directory), *kinds], timeout=180, env=env)
    else:
        code, out, _ = launch("--workers", str(workers), SCRIPT, mode, str(directory), *kinds, timeout=300)
    assert code == 0, out
    return out


def _matrix(directory: Path, runs: list[tuple[int, list[str]]]) -> Path:
    for mode in ("save", "load"):
        for workers, kinds in runs:
            _run(mode, directory, workers, kinds)
    return directory


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _matrix(tmp_path_factory.mktemp("mesh_matrix"), FAST_RUNS)


def test_the_meshes_and_plain_pytorch_load_each_others_checkpoints_and_resume_exactly(matrix: Path) -> None:
    _check_matrix(matrix, FAST_NAMES)


@pytest.mark.faults_full
def test_every_mesh_loads_under_every_other_and_resumes_as_one_uninterrupted_run(tmp_path: Path) -> None:
    _check_matrix(_matrix(tmp_path, RUNS), NAMES)


def _check_matrix(matrix: Path, names: list[str]) -> None:
    for name in ("hybrid-4", "fsdp_tp-4"):  # the sharded format: every worker wrote its own shard file
        assert len(list((matrix / name / "ckpt-1.dcp").glob("*.distcp"))) == 4
    model = build(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in batches():
        ((model(x) - y).pow(2).sum(1).sum() / GLOBAL).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = model.state_dict()
    table = {}
    for saver in names:
        for loader in names:
            got = torch.load(matrix / "results" / f"{saver}__{loader}.pt", weights_only=True)
            table[saver, loader] = max((got["model"][k] - v).abs().max().item() for k, v in reference.items())
            assert set(got["steps"]) == {5.0}, (saver, loader, got["steps"])
    print("\nlargest difference against 5 uninterrupted steps, saver (rows) x loader (columns):")
    print(" " * 14 + " ".join(f"{n:>12}" for n in names))
    for saver in names:
        print(f"{saver:>14}" + " ".join(f"{table[saver, loader]:12.1e}" for loader in names))
    assert max(table.values()) < 1e-5


def _restore_fails(path: Path, match: str) -> None:
    model = build(7)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ds.CheckpointError, match=match):
        ds.Checkpoint(model=model, optimizer=torch.optim.Adam(model.parameters())).restore(str(path)[:-4])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing changed


@pytest.mark.parametrize("mesh", ["hybrid-4", "fsdp_tp-4"])
def test_a_flipped_bit_a_truncated_shard_or_a_hostile_pickle_of_a_mesh_checkpoint_is_refused(
    matrix: Path, tmp_path: Path, mesh: str
) -> None:
    shutil.copytree(matrix / mesh, tmp_path / "c")
    directory = tmp_path / "c" / "ckpt-1.dcp"
    shard = directory / "__3_0.distcp"  # the last worker's: on the model axis under FSDP x TP
    data = bytearray(shard.read_bytes())
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(flipped))
    _restore_fails(directory, "__3_0.distcp")
    shard.write_bytes(bytes(data[: len(data) // 2]))
    _restore_fails(directory, "__3_0.distcp")
    shard.write_bytes(bytes(data))
    os.remove(directory / sharded_format.MANIFEST)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    (directory / sharded_format.DCP_METADATA).write_bytes(pickle.dumps(Exploit()))
    _restore_fails(directory, "metadata")
    assert not marker.exists()


def test_a_save_killed_midway_under_fsdp_x_tp_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    code, out, _ = launch("--workers", "4", SCRIPT, "crash", str(tmp_path), "fsdp_tp", timeout=240)
    assert "worker 1 failed with exit code 137" in out, out
    directory = tmp_path / "crash-fsdp_tp"
    assert ds.latest_checkpoint(str(directory)) == str(directory / "ckpt-1")
    left = sorted(set(os.listdir(directory)) - {"checkpoint", "ckpt-1.dcp"})
    assert all(name.startswith(".ckpt-2.dcp.partial-") for name in left), left
    model = build(7)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ds.Checkpoint(model=model, optimizer=optimizer).restore(str(directory / "ckpt-1"))
    assert optimizer.state_dict()["state"][0]["step"] == 1
