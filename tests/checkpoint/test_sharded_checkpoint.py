"""Sharded checkpoints (issue 20, item 6): DCP under torch's own ``fully_shard`` on gloo, with distrib's safety.

Real worker processes (``tests/scripts/sharded_ckpt_worker.py``, a file store, no ports) save at
N=2, load at N=4 and save again, and this process loads that into a plain module (2 -> 4 -> 1);
a save killed midway leaves the previous checkpoint; damaged, truncated and hostile files are
refused naming the file, and run nothing.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from distrib.checkpoint import CheckpointError
from distrib.checkpoint import format as fmt
from distrib.checkpoint import sharded_format as sf
from distrib.checkpoint.sharded import is_sharded_checkpoint, load_sharded, save_sharded
from distrib.checkpoint.sharded_export import consolidate

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "sharded_ckpt_worker.py"


def run_workers(
    mode: str, world: int, workdir: Path, *extra: str, timeout: float = 120, expect_killed: int | None = None
) -> list[str]:
    """Start ``world`` workers (each its own session), wait at most ``timeout`` s, kill whatever is left."""
    store = workdir / f"store-{mode}-{world}-{os.urandom(4).hex()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(r), str(world), str(store), str(workdir), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]
    outs: list[str] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode} x{world} did not finish in {timeout}s")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    if expect_killed is None:
        for r, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0 and "DONE" in out, f"worker {r} of {mode} x{world}:\n{out}"
    else:
        assert procs[expect_killed].returncode == -signal.SIGKILL, outs[expect_killed]
    return outs


def plain_model(seed: int = 11) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
    )


def assert_state_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def load_plain(directory: Path) -> dict[str, Any]:
    """Load a sharded checkpoint into a plain module and Adam in this process (no group): their full state."""
    model = plain_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt), "epoch": torch.tensor(0)}
    load_sharded(directory, sd)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    assert int(sd["epoch"]) == 7
    return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint saved by 2 FSDP2 workers (twice: the second replaces the first), and references."""
    workdir = tmp_path_factory.mktemp("sharded")
    run_workers("save", 2, workdir)
    return workdir


def test_each_worker_writes_only_its_shards(saved: Path) -> None:
    sizes = json.loads((saved / "sizes.json").read_text())
    files, total = sizes["files"], sizes["total_state_bytes"]
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"], files
    for name, size in files.items():  # half of the state each, plus DCP's per-item headers
        assert 0.3 * total < size < 0.75 * total, (name, size, total)
    assert not [n for n in os.listdir(saved) if sf.MANIFEST in n or ".partial-" in n]


def test_saved_by_2_loads_on_4_then_on_1_plain_process(saved: Path) -> None:
    ref = torch.load(saved / "ref.pt", weights_only=True)
    run_workers("load", 4, saved, timeout=180)
    assert_state_equal(ref, torch.load(saved / "loaded4.pt", weights_only=True), "N=4")
    assert_state_equal(ref, load_plain(saved / "ckpt_resaved4"), "4->1")  # 2 -> 4 -> 1
    assert_state_equal(ref, load_plain(saved / "ckpt"), "2->1")
    assert len([n for n in os.listdir(saved / "ckpt_resaved4") if n.endswith(".distcp")]) == 4


def test_consolidated_file_is_the_full_state_and_restores_under_checkpoint(saved: Path, tmp_path: Path) -> None:
    ref = torch.load(saved / "ref.pt", weights_only=True)
    out = consolidate(saved / "ckpt", tmp_path / "whole.pt", save_counter=3)
    data = fmt.load(out)  # distrib's format: every CRC-32 verified
    assert data["save_counter"] == 3 and int(data["objects"]["epoch"]) == 7
    assert_state_equal(ref["model"], data["objects"]["model"], "model")
    assert_state_equal(ref["optim"], data["objects"]["optim"], "optim")
    import distrib as ds

    model = plain_model()
    ckpt = ds.Checkpoint(model=model)
    ckpt.restore(str(tmp_path / "whole")).expect_partial()
    assert_state_equal(ref["model"], model.state_dict(), "restored")


def test_a_save_killed_midway_leaves_the_previous_checkpoint(saved: Path, tmp_path: Path) -> None:
    import shutil

    previous = torch.load(saved / "ref.pt", weights_only=True)
    workdir = tmp_path / "w"
    shutil.copytree(saved / "ckpt", workdir / "ckpt")
    run_workers("dieall", 2, workdir, expect_killed=1)  # the whole job is killed while writing
    partial = [n for n in os.listdir(workdir) if n.startswith(".ckpt.partial-")]
    assert len(partial) == 1, os.listdir(workdir)
    assert any(n.endswith(".distcp") for n in os.listdir(workdir / partial[0]))  # half written ...
    assert not (workdir / partial[0] / sf.MANIFEST).exists()  # ... and never taken for complete
    with pytest.raises(CheckpointError, match="incomplete"):
        load_plain(workdir / partial[0])
    assert not is_sharded_checkpoint(workdir / partial[0]) and is_sharded_checkpoint(workdir / "ckpt")
    assert_state_equal(previous, load_plain(workdir / "ckpt"), "previous")
    save_sharded(workdir / "other", {"model": plain_model().state_dict()})  # another name: no business of it
    assert len([n for n in os.listdir(workdir) if ".partial-" in n]) == 1
    save_sharded(workdir / "ckpt", {"model": plain_model().state_dict()})  # the next save removes the leftover
    assert not [n for n in os.listdir(workdir) if ".partial-" in n], os.listdir(workdir)

    shutil.rmtree(workdir / "ckpt")
    shutil.copytree(saved / "ckpt", workdir / "ckpt")
    outs = run_workers("die1", 2, workdir, expect_killed=1)  # worker 1 dies, the chief lives on
    assert "SAVE FAILED:" in outs[0], outs[0]
    assert not [n for n in os.listdir(workdir) if ".partial-" in n], os.listdir(workdir)  # the chief cleaned up
    assert_state_equal(previous, load_plain(workdir / "ckpt"), "previous")


def test_a_failed_write_on_one_worker_is_an_error_on_every_worker(saved: Path, tmp_path: Path) -> None:
    import shutil

    workdir = tmp_path / "w"
    shutil.copytree(saved / "ckpt", workdir / "ckpt")
    outs = run_workers("fail1", 2, workdir)
    for out in outs:  # the same error, naming the worker and the cause, on both; then the job goes on (DONE)
        assert "SAVE FAILED: Sharded checkpoint failed on worker 1: OSError" in out and "No space left" in out, out
    assert sorted(n for n in os.listdir(workdir) if not n.startswith("store-")) == ["ckpt"]  # no leftovers
    assert_state_equal(torch.load(saved / "ref.pt", weights_only=True), load_plain(workdir / "ckpt"), "previous")


# --------------------------------------------------------------- one process: damage and hostile files
@pytest.fixture()
def small(tmp_path: Path) -> Path:
    model = plain_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    save_sharded(
        tmp_path / "c",
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt), "epoch": torch.tensor(7)},
    )
    return tmp_path / "c"


def target() -> dict[str, Any]:
    model = plain_model(seed=3)
    return {"model": model.state_dict()}


def test_a_flipped_byte_names_the_file(small: Path) -> None:
    shard = small / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-50] ^= 0x10  # in the last item: everything before it reads well
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*CRC-32"):
        load_plain(small)
    model = plain_model(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for all_or_nothing in (True, False):
        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt), "epoch": torch.tensor(0)}
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*CRC-32"):
            load_sharded(small, sd, all_or_nothing=all_or_nothing)
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert bool(changed) == (not all_or_nothing), changed  # all or nothing: the model did not change
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        consolidate(small, small.parent / "out.pt")
    assert not (small.parent / "out.pt").exists()


def test_a_truncated_file_names_the_file(small: Path) -> None:
    shard = small / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*truncated"):
        load_sharded(small, target())


def test_a_damaged_manifest_is_refused(small: Path) -> None:
    manifest = small / sf.MANIFEST
    manifest.write_text(manifest.read_text().replace('"length": ', '"length": 1', 1))  # still valid JSON
    with pytest.raises(CheckpointError, match=r"distrib-sharded\.json.*checksum"):
        load_sharded(small, target())


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_metadata_pickle_never_runs(small: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    size = (small / sf.DCP_METADATA).stat().st_size
    evil = pickle.dumps(_Evil(marker))
    (small / sf.DCP_METADATA).write_bytes(evil + b"\0" * (size - len(evil)))  # same size: only the CRC differs
    with pytest.raises(CheckpointError, match=r"\.metadata.*checksum"):  # beside a manifest: its CRC fails
        load_sharded(small, target())
    (small / sf.MANIFEST).unlink()  # a plain DCP directory: the restricted unpickler refuses it
    with pytest.raises(CheckpointError, match=r"\.metadata.*refused.*(posix|os)\.system"):
        load_sharded(small, target())
    with pytest.raises(CheckpointError, match=r"\.metadata.*refused"):
        consolidate(small, tmp_path / "out.pt")
    assert not marker.exists()


def test_a_hostile_value_with_matching_checksums_never_runs(small: Path, tmp_path: Path) -> None:
    """An attacker who rewrites a shard and the manifest's CRCs still gets nothing run (weights_only)."""
    marker = tmp_path / "pwned"
    manifest = json.loads((small / sf.MANIFEST).read_text())
    fqn, entry = next(iter(manifest["objects"].items()))  # a non-tensor value (an Adam hyperparameter)
    import io

    evil = io.BytesIO()
    torch.save(_Evil(marker), evil)
    payload = evil.getvalue()
    shard = small / entry["file"]
    raw = shard.read_bytes()
    shard.write_bytes(raw[: entry["offset"]] + payload + raw[entry["offset"] + entry["length"] :])
    delta = len(payload) - entry["length"]
    for item in [*manifest["objects"].values(), *(c for t in manifest["tensors"].values() for c in t["chunks"])]:
        if item["file"] == entry["file"] and item["offset"] > entry["offset"]:
            item["offset"] += delta
    entry["length"], entry["crc"] = len(payload), zlib.crc32(payload)
    manifest["files"][entry["file"]]["size"] += delta
    del manifest["checksum"]
    manifest["checksum"] = zlib.crc32(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    (small / sf.MANIFEST).write_text(json.dumps(manifest))
    model = plain_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt), "epoch": torch.tensor(0)}
    with pytest.raises(CheckpointError, match=r"distcp.*refused"):
        load_sharded(small, sd)
    with pytest.raises(CheckpointError, match=r"distcp.*refused"):
        consolidate(small, tmp_path / "out.pt")
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_plain_dcp_directory_loads_through_the_restricted_unpickler(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = plain_model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    sd = target()
    load_sharded(tmp_path / "plain", sd)
    assert_state_equal(model.state_dict(), sd["model"])


def test_not_a_checkpoint_and_missing_keys_are_errors(small: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        load_sharded(tmp_path / "empty", target())
    with pytest.raises(CheckpointError, match="does not exist"):
        load_sharded(tmp_path / "nowhere", target())
    with pytest.raises(CheckpointError, match="extra"):
        load_sharded(small, {"model": plain_model().state_dict(), "extra": torch.zeros(1)})


def test_consolidate_holds_one_whole_tensor_at_a_time(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export never gathers the model: each whole tensor is gone before the next is assembled."""
    import weakref

    import distrib.checkpoint.sharded_export as export

    held: list[weakref.ref[torch.Tensor]] = []
    real = export.fill_tensor

    def fill(directory: str, manifest: Any, fqn: str, into: torch.Tensor) -> None:
        assert not [r for r in held if r() is not None], f"a whole tensor is still held when {fqn!r} is assembled"
        held.append(weakref.ref(into))
        real(directory, manifest, fqn, into)

    monkeypatch.setattr(export, "fill_tensor", fill)
    out = consolidate(small, tmp_path / "whole.pt")
    n_tensors = len(json.loads((small / sf.MANIFEST).read_text())["tensors"])
    assert len(held) == 2 * n_tensors  # pass one (checksums) and pass two (the bytes)
    assert int(fmt.load(out)["objects"]["epoch"]) == 7


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_saving_over_a_checkpoint_replaces_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic_exchange: bool
) -> None:
    """Linux swaps the directories in one renameat2; elsewhere two renames. Either way: the new one, no leftovers."""
    import distrib.checkpoint.sharded as sharded

    if not atomic_exchange:
        monkeypatch.setattr(sharded, "_exchange", lambda a, b: False)
    first, second = plain_model(seed=1), plain_model(seed=2)
    save_sharded(tmp_path / "c", {"model": first.state_dict()})
    save_sharded(tmp_path / "c", {"model": second.state_dict()})
    sd = target()
    load_sharded(tmp_path / "c", sd)
    assert_state_equal(second.state_dict(), sd["model"])
    assert sorted(os.listdir(tmp_path)) == ["c"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_pytorch_loads_a_distrib_sharded_checkpoint(small: Path) -> None:
    """Without distrib: torch's own dcp.load reads the directory (DCP's .metadata is kept for it)."""
    import torch.distributed.checkpoint as dcp

    saved = target()
    load_sharded(small, saved)
    sd = target()
    dcp.load(sd, checkpoint_id=str(small), no_dist=True)
    assert_state_equal(saved["model"], sd["model"])
    assert not torch.equal(sd["model"]["0.weight"], plain_model(seed=3).state_dict()["0.weight"])
