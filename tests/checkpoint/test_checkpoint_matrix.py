"""The checkpoint matrix: every saver × every loader, through ``ds.Checkpoint`` (tests/scripts/checkpoint_matrix.py).

Savers and loaders: plain PyTorch, OneDevice, Mirrored (2 replicas), ShardedStrategy with 1, 2 and 4
workers (2 and 4 write the sharded format, ``<prefix>.dcp``: every worker its own shards), and
MultiWorkerMirrored with 2. Each saver trains 3 Adam steps and saves; each loader restores every
checkpoint into a model built with another seed and trains 2 more steps: all 49 results equal 5
uninterrupted steps in one process. Then what a sharded checkpoint must survive: a save killed
midway, a flipped bit, a truncated file, a hostile ``.metadata`` pickle.
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

SINGLE = ["plain", "one_device", "mirrored", "sharded"]  # one process
LAUNCHED = [("sharded", 2), ("sharded", 4), ("mwms", 2)]
NAMES = ["plain-1", "one_device-1", "mirrored-1", "sharded-1", "sharded-2", "sharded-4", "mwms-2"]


def _run(mode: str, directory: Path, kind: str | None = None, workers: int = 1) -> str:
    script = [str(SCRIPTS / "checkpoint_matrix.py"), mode, str(directory)]
    if workers == 1:
        code, out, _ = run_bounded([sys.executable, *script, *SINGLE], timeout=180)
    else:
        code, out, _ = launch("--workers", str(workers), *script, *([kind] if kind else []), timeout=240)
    assert code == 0, out
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("matrix")
    _run("save", directory)
    for kind, workers in LAUNCHED:
        out = _run("save", directory, kind, workers)
        assert f"format {'sharded' if kind == 'sharded' else 'plain'}" in out
    _run("load", directory)
    for kind, workers in LAUNCHED:
        _run("load", directory, kind, workers)
    return directory


def _reference(steps: int = 5) -> dict[str, torch.Tensor]:
    model = build(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in batches()[:steps]:
        ((model(x) - y).pow(2).sum(1).sum() / GLOBAL).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_every_saver_loads_under_every_loader_and_resumes_as_one_uninterrupted_run(matrix: Path) -> None:
    for name in ("sharded-2", "sharded-4"):  # written by every worker, in parallel: one shard file each
        shards = sorted(p.name for p in (matrix / name / "ckpt-1.dcp").glob("*.distcp"))
        assert len(shards) == int(name[-1]), shards
        assert not (matrix / name / "ckpt-1.pt").exists()
    for name in ("one_device-1", "mirrored-1", "sharded-1", "mwms-2"):
        assert (matrix / name / "ckpt-1.pt").is_file()
    reference = _reference()
    table = {}
    for saver in NAMES:
        for loader in NAMES:
            got = torch.load(matrix / "results" / f"{saver}__{loader}.pt", weights_only=True)
            table[saver, loader] = max((got["model"][k] - v).abs().max().item() for k, v in reference.items())
            assert set(got["steps"]) == {5.0}, (saver, loader, got["steps"])  # the optimizer's state came along
    worst = max(table.values())
    print("\nlargest difference against 5 uninterrupted steps, saver (rows) x loader (columns):")
    print(" " * 14 + " ".join(f"{n:>12}" for n in NAMES))
    for saver in NAMES:
        print(f"{saver:>14}" + " ".join(f"{table[saver, loader]:12.1e}" for loader in NAMES))
    assert worst < 1e-5, worst


def test_a_sharded_checkpoint_loads_in_plain_pytorch_and_names_nothing_of_distrib(matrix: Path) -> None:
    """What a user without distrib does: torch's dcp.load into a model's own state_dict."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model = build(7)
    state = {"objects": {"model": model.state_dict()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it runs without a process group
        dcp.load(state, checkpoint_id=str(matrix / "sharded-4" / "ckpt-1.dcp"))
    model.load_state_dict(state["objects"]["model"])
    after_3 = _reference(steps=3)
    assert max((model.state_dict()[k] - v).abs().max().item() for k, v in after_3.items()) < 1e-5


def test_a_sharded_checkpoint_consolidates_into_one_file_that_restores_as_the_directory(
    matrix: Path, tmp_path: Path
) -> None:
    from distrib.checkpoint.sharded_export import consolidate

    consolidate(matrix / "sharded-4" / "ckpt-1.dcp", tmp_path / "one.pt")
    states = []
    for path in (tmp_path / "one", matrix / "sharded-4" / "ckpt-1"):
        model = build(7)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        checkpoint = ds.Checkpoint(model=model, optimizer=optimizer, epoch=torch.tensor(0))
        checkpoint.restore(str(path))
        assert checkpoint.save_counter == 1 and int(checkpoint.epoch) == 3
        states.append((model.state_dict(), optimizer.state_dict()["state"]))
    (model_a, opt_a), (model_b, opt_b) = states
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    assert sorted(opt_a) == sorted(opt_b) == [0, 1, 2, 3, 4, 5]
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path: Path) -> None:
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "checkpoint_matrix.py"), "crash", str(tmp_path), timeout=180)
    assert "worker 1 failed with exit code 137" in out, out  # killed while writing its shards of ckpt-2
    if "SAVE FAILED on worker 0" in out:  # unless the launcher stopped the chief first, on worker 1's death
        assert "CheckpointError: Writing the sharded checkpoint" in out, out
    directory = tmp_path / "crash"
    assert ds.latest_checkpoint(str(directory)) == str(directory / "ckpt-1")
    left = sorted(set(os.listdir(directory)) - {"checkpoint", "ckpt-1.dcp"})
    assert all(name.startswith(".ckpt-2.dcp.partial-") for name in left), left  # never taken for a checkpoint
    model = build(7)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ds.Checkpoint(model=model, optimizer=optimizer).restore(str(directory / "ckpt-1"))
    assert optimizer.state_dict()["state"][0]["step"] == 1


def _copy(matrix: Path, tmp_path: Path) -> Path:
    shutil.copytree(matrix / "sharded-2", tmp_path / "c")
    return tmp_path / "c" / "ckpt-1.dcp"


def _restore_fails(path: Path, match: str) -> None:
    model = build(7)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ds.CheckpointError, match=match):
        ds.Checkpoint(model=model, optimizer=torch.optim.Adam(model.parameters())).restore(str(path)[:-4])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing changed


def test_a_flipped_bit_or_a_truncated_shard_is_an_error_naming_the_file(matrix: Path, tmp_path: Path) -> None:
    directory = _copy(matrix, tmp_path)
    shard = directory / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    _restore_fails(directory, "__1_0.distcp")
    shard.write_bytes(bytes(data[: len(data) // 2]))
    _restore_fails(directory, "__1_0.distcp")


def test_a_hostile_metadata_pickle_never_runs(matrix: Path, tmp_path: Path) -> None:
    """A directory without distrib's manifest whose ``.metadata`` is a pickle that would run code on load."""
    directory = _copy(matrix, tmp_path)
    os.remove(directory / sharded_format.MANIFEST)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    (directory / sharded_format.DCP_METADATA).write_bytes(pickle.dumps(Exploit()))
    _restore_fails(directory, "metadata")
    assert not marker.exists()
