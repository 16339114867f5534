"""Tests for distrib.checkpoint: round trips, numbering, atomicity, integrity, all-or-nothing restores, safety."""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

import distrib.checkpoint.format as fmt
from distrib.checkpoint import Checkpoint, CheckpointError, CheckpointManager, LoadStatus, latest_checkpoint


def _trained() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _fresh() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def _snapshot(*objects) -> list:
    """Deep copies of every object's state, to prove that a failed restore changed nothing."""
    return [o.detach().clone() if isinstance(o, torch.Tensor) else copy.deepcopy(o.state_dict()) for o in objects]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------- round trips and numbering
def test_round_trip_linear_adam_epoch(tmp_path):
    model, opt = _trained()
    epoch = torch.tensor(7)
    path = Checkpoint(model=model, optimizer=opt, epoch=epoch).save(tmp_path / "ckpt")

    model2, opt2 = _fresh()
    epoch2 = torch.tensor(0)
    held = epoch2
    assert not torch.equal(model2.weight, model.weight)
    status = Checkpoint(model=model2, optimizer=opt2, epoch=epoch2).restore(path)

    assert isinstance(status, LoadStatus)
    assert status.assert_consumed() is status and status.unused == []
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]  # lr 0.01 restored over 0.5
    assert s1["state"].keys() == s2["state"].keys() and len(s1["state"]) == 2
    for k in s1["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])
    assert held is epoch2 and int(held) == 7  # restored in place
    # The restored optimizer keeps training identically.
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight)


def test_on_disk_format_is_plain_weights_only_and_carries_a_checksum_per_tensor(tmp_path):
    model, opt = _trained()
    path = Checkpoint(model=model, optimizer=opt, step=torch.arange(10)[3]).save(tmp_path / "c")
    data = torch.load(path + ".pt", map_location="cpu", weights_only=True)
    assert data["format"] == "distrib-checkpoint" and data["version"] == 2
    assert set(data["objects"]) == {"model", "optimizer", "step"}
    assert set(data["objects"]["model"]) == {"weight", "bias"}
    assert type(data["objects"]["model"]["weight"]) is torch.Tensor
    assert data["objects"]["optimizer"]["param_groups"][0]["lr"] == 0.01
    step = data["objects"]["step"]
    assert int(step) == 3 and step.untyped_storage().nbytes() == step.element_size()
    checks = data["checksums"]
    assert checks["algorithm"] == "crc32" and isinstance(checks["structure"], int)
    keys = [k for k, _ in checks["tensors"]]
    assert keys[:2] == ["model/weight", "model/bias"] and "optimizer/state/0/exp_avg" in keys and keys[-1] == "step"


def test_save_numbering_and_counter_continues_after_restore(tmp_path):
    prefix = str(tmp_path / "ckpt")
    ckpt = Checkpoint(w=torch.zeros(2))
    assert ckpt.save(prefix) == f"{prefix}-1"
    assert ckpt.save(prefix) == f"{prefix}-2"
    fresh = Checkpoint(w=torch.zeros(2))
    fresh.restore(f"{prefix}-2")
    assert fresh.save_counter == 2
    assert fresh.save(prefix) == f"{prefix}-3"


def test_save_as_is_the_one_write_of_a_save_and_the_manager_uses_it(tmp_path, monkeypatch):
    """Issue 19, item 6: ``save``, ``CheckpointManager.save`` and ``save_as`` write through one method.

    ``save_as`` writes exactly ``<path>.pt`` holding the next counter, runs ``on_written`` after the
    file is written, and advances ``save_counter``; an error in ``on_written`` fails the save and
    leaves the counter. The manager's save goes through it (seen by wrapping it)."""
    w = torch.tensor([1.0, 2.0])
    ckpt = Checkpoint(w=w)
    seen: list[bool] = []
    assert ckpt.save_as(tmp_path / "exact", on_written=lambda: seen.append((tmp_path / "exact.pt").is_file())) == str(
        tmp_path / "exact"
    )
    assert seen == [True] and ckpt.save_counter == 1 and latest_checkpoint(tmp_path) is None  # no index unless asked
    fresh = Checkpoint(w=torch.zeros(2))
    fresh.restore(tmp_path / "exact")
    assert fresh.save_counter == 1 and fresh.w.tolist() == [1.0, 2.0]

    def fail() -> None:
        raise OSError("index not writable")

    with pytest.raises(OSError, match="index not writable"):
        ckpt.save_as(tmp_path / "failed", on_written=fail)
    assert ckpt.save_counter == 1

    calls: list[str] = []
    real = Checkpoint.save_as
    monkeypatch.setattr(Checkpoint, "save_as", lambda self, path, **kw: calls.append(path) or real(self, path, **kw))
    manager = CheckpointManager(ckpt, tmp_path / "run", max_to_keep=1)
    assert manager.save() == calls[0] == str(tmp_path / "run" / "ckpt-2") and ckpt.save_counter == 2
    assert manager.save(checkpoint_number=7) == calls[1] == str(tmp_path / "run" / "ckpt-7")
    assert ckpt.save_counter == 3 and sorted(p.name for p in (tmp_path / "run").glob("*.pt")) == ["ckpt-7.pt"]


def test_write_and_read_leave_the_counter_and_index_alone(tmp_path):
    w = torch.tensor([1.0, 2.0])
    ckpt = Checkpoint(w=w)
    ckpt.save(tmp_path / "numbered")
    assert ckpt.write(tmp_path / "exact") == str(tmp_path / "exact")
    assert (tmp_path / "exact.pt").is_file()
    assert ckpt.save_counter == 1 and latest_checkpoint(tmp_path) == str(tmp_path / "numbered-1")
    w.zero_()
    reader = Checkpoint(w=w)
    reader.read(tmp_path / "exact").assert_consumed()
    assert w.tolist() == [1.0, 2.0] and reader.save_counter == 0  # read() restores values, not the counter
    reader.restore(tmp_path / "exact")
    assert reader.save_counter == 1  # restore() does


def test_write_update_latest_records_the_file_for_latest_checkpoint(tmp_path):
    ckpt = Checkpoint(w=torch.ones(1))
    ckpt.write(tmp_path / "weights-1", update_latest=True)
    ckpt.write(tmp_path / "weights-2", update_latest=True)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "weights-2") and ckpt.save_counter == 0


def test_latest_checkpoint_after_three_saves(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    ckpt = Checkpoint(w=torch.zeros(1))
    paths = [ckpt.save(tmp_path / "ckpt") for _ in range(3)]
    assert latest_checkpoint(tmp_path) == paths[2]
    index = json.loads((tmp_path / "checkpoint").read_text())
    assert index["latest"] == "ckpt-3" and index["all"] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    # If the newest data file disappears, fall back to the newest one that exists.
    os.remove(paths[2] + ".pt")
    assert latest_checkpoint(tmp_path) == paths[1]


def test_manager_max_to_keep(tmp_path):
    step = torch.tensor(0)
    manager = CheckpointManager(Checkpoint(step=step), tmp_path / "run", max_to_keep=2)
    assert manager.restore_or_initialize() is None
    for _ in range(4):
        step.add_(1)
        last = manager.save()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("*.pt")) == ["ckpt-3.pt", "ckpt-4.pt"]
    assert manager.checkpoints == [str(run / "ckpt-3"), str(run / "ckpt-4")]
    assert manager.latest_checkpoint == last == latest_checkpoint(run) == str(run / "ckpt-4")
    assert json.loads((run / "checkpoint").read_text())["all"] == ["ckpt-3", "ckpt-4"]

    # A new process: picks up the kept list, restores, and continues numbering.
    step2 = torch.tensor(0)
    manager2 = CheckpointManager(Checkpoint(step=step2), run, max_to_keep=2)
    assert manager2.restore_or_initialize() == str(run / "ckpt-4") and int(step2) == 4
    assert manager2.save() == str(run / "ckpt-5")
    assert sorted(p.name for p in run.glob("*.pt")) == ["ckpt-4.pt", "ckpt-5.pt"]
    assert manager2.save(checkpoint_number=100) == str(run / "ckpt-100")
    assert manager2.checkpoints == [str(run / "ckpt-5"), str(run / "ckpt-100")]


def test_manager_keeps_all_with_none_and_continues_an_index_written_before_timestamps(tmp_path):
    manager = CheckpointManager(Checkpoint(w=torch.zeros(1)), tmp_path, max_to_keep=None)
    for _ in range(7):
        manager.save()
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 7
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(Checkpoint(), tmp_path, max_to_keep=0)
    # An index of the previous format (no timestamps): the names it lists stay managed.
    (tmp_path / "checkpoint").write_text(json.dumps({"latest": "ckpt-7", "all": [f"ckpt-{i}" for i in range(1, 8)]}))
    old = CheckpointManager(Checkpoint(w=torch.zeros(1)), tmp_path, max_to_keep=2)
    assert len(old.checkpoints) == 7 and old.latest_checkpoint == str(tmp_path / "ckpt-7")
    old.save(checkpoint_number=8)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-7.pt", "ckpt-8.pt"]


# --------------------------------------------------------------- partial restores and the load status
def test_restoring_only_the_model_from_a_file_that_also_holds_the_optimizer(tmp_path):
    model, opt = _trained()
    path = Checkpoint(model=model, optimizer=opt, epoch=torch.tensor(4)).save(tmp_path / "ckpt")
    evaluator = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning, match=r"restored partially: 'epoch', 'optimizer'.*expect_partial\(\)"):
        Checkpoint(model=evaluator).restore(path)  # the discarded status warns
    assert torch.equal(evaluator.weight, model.weight)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = Checkpoint(model=torch.nn.Linear(4, 3)).restore(path).expect_partial()
        del status  # silenced: no warning when it goes
    status = Checkpoint(model=torch.nn.Linear(4, 3)).restore(path)
    with pytest.raises(AssertionError, match=r"Unused attributes.*'epoch', 'optimizer'"):
        status.assert_consumed()
    assert status.assert_existing_objects_matched() is status and status.assert_nontrivial_match() is status
    assert status.restored == ["model", "save_counter"] and status.unused == ["epoch", "optimizer"]


def test_tracked_names_missing_from_the_file_are_an_error_and_change_nothing(tmp_path):
    path = Checkpoint(model=torch.nn.Linear(2, 2), epoch=torch.tensor(1)).save(tmp_path / "c")
    net, epoch = torch.nn.Linear(2, 2), torch.tensor(0)
    before = _snapshot(net, epoch)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(net=net, epoch=epoch).restore(path)
    msg = str(info.value)
    assert "does not hold ['net']" in msg and "'model'" in msg and "not tracked" in msg and "c-1.pt" in msg
    assert all(_same(a, b) for a, b in zip(before, _snapshot(net, epoch)))


def test_restore_none_restores_nothing_and_its_assertions_say_so(tmp_path):
    w = torch.ones(2)
    status = Checkpoint(w=w).restore(None)
    status.expect_partial().initialize_or_restore()
    assert w.tolist() == [1.0, 1.0]
    for check in (status.assert_consumed, status.assert_existing_objects_matched, status.assert_nontrivial_match):
        with pytest.raises(AssertionError, match="No checkpoint specified"):
            check()
    with pytest.raises(TypeError, match="read"):
        Checkpoint(w=w).read(None)


def test_assigning_an_attribute_tracks_it(tmp_path):
    ckpt = Checkpoint()
    ckpt.step = torch.tensor(5)
    path = ckpt.save(tmp_path / "c")
    other = Checkpoint()
    other.step = torch.tensor(0)
    other.restore(path).assert_consumed()
    assert int(other.step) == 5 and other.objects.keys() == {"step"}
    with pytest.raises(TypeError, match="ParameterList"):
        other.weights = [torch.zeros(1)]


# --------------------------------------------------------------- all or nothing
def test_a_wrong_shape_deep_in_a_module_changes_no_object(tmp_path):
    model, opt = _trained()
    path = Checkpoint(epoch=torch.tensor(9), optimizer=opt, model=model).save(tmp_path / "c")
    epoch = torch.tensor(0)
    other = torch.nn.Linear(4, 5)  # weight (5, 4): wrong shape, found only after epoch and optimizer
    other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    before = _snapshot(epoch, other_opt, other)
    with pytest.raises(CheckpointError, match=r"'model': 'weight' has shape \(5, 4\) in the module but \(3, 4\)"):
        Checkpoint(epoch=epoch, optimizer=other_opt, model=other).restore(path)
    assert all(_same(a, b) for a, b in zip(before, _snapshot(epoch, other_opt, other)))


def test_a_missing_module_key_changes_no_object(tmp_path):
    saved = torch.nn.Sequential(torch.nn.Linear(2, 2))
    path = Checkpoint(step=torch.tensor(3), model=saved).save(tmp_path / "c")
    step, bigger = torch.tensor(0), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    before = _snapshot(step, bigger)
    with pytest.raises(CheckpointError, match=r"missing from the file: \['1.weight', '1.bias'\]"):
        Checkpoint(step=step, model=bigger).restore(path)
    assert all(_same(a, b) for a, b in zip(before, _snapshot(step, bigger)))


def test_wrong_optimizer_groups_change_no_object(tmp_path):
    model, opt = _trained()
    path = Checkpoint(model=model, optimizer=opt).save(tmp_path / "c")
    target, _ = _fresh()
    two_groups = torch.optim.Adam([{"params": [target.weight]}, {"params": [target.bias], "lr": 0.1}], lr=0.5)
    before = _snapshot(target, two_groups)
    with pytest.raises(
        CheckpointError,
        match=r"'optimizer': the file holds 1 parameter group\(s\) but the optimizer "
        r"has 2",
    ):
        Checkpoint(model=target, optimizer=two_groups).restore(path)
    assert all(_same(a, b) for a, b in zip(before, _snapshot(target, two_groups)))
    one_param = torch.optim.Adam([target.weight], lr=0.5)
    with pytest.raises(CheckpointError, match="parameter group 0 holds 2 parameter"):
        Checkpoint(model=target, optimizer=one_param).restore(path)
    assert _same(before[0], _snapshot(target)[0])


def test_a_tensor_of_another_dtype_is_refused(tmp_path):
    path = Checkpoint(step=torch.tensor(3)).save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="has dtype torch.float32 but the file holds torch.int64"):
        Checkpoint(step=torch.tensor(0.0)).restore(path)
    with pytest.raises(CheckpointError, match=r"has shape \(3,\) but the file holds shape \(\)"):
        Checkpoint(step=torch.zeros(3, dtype=torch.int64)).restore(path)


class Flaky:
    """A stateful object whose load_state_dict fails: the objects restored before it are put back."""

    def __init__(self) -> None:
        self.n = 1

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] == 99:
            raise RuntimeError("refusing 99")
        self.n = state["n"]


def test_an_object_failing_its_own_load_rolls_back_every_earlier_object(tmp_path):
    model, opt = _trained()
    flaky = Flaky()
    flaky.n = 99
    path = Checkpoint(model=model, optimizer=opt, flaky=flaky).save(tmp_path / "c")
    target, target_opt = _fresh()
    target(torch.randn(2, 4)).sum().backward()
    target_opt.step()  # some optimizer state to keep
    before = _snapshot(target, target_opt)
    victim = Flaky()
    with pytest.raises(CheckpointError, match="Restoring 'flaky' .* refusing 99.*every object was put back"):
        Checkpoint(model=target, optimizer=target_opt, flaky=victim).restore(path)
    assert all(_same(a, b) for a, b in zip(before, _snapshot(target, target_opt))) and victim.n == 1


class Stubborn:
    """Refuses every state, even its own: the message must not claim a clean rollback."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("never")


def test_a_rollback_that_fails_says_so(tmp_path):
    path = Checkpoint(s=Stubborn()).save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="putting back 's' .* also failed: those objects are partly restored"):
        Checkpoint(s=Stubborn()).restore(path)


class Spy:
    """Counts load_state_dict calls: none may happen when the file does not fit."""

    def __init__(self) -> None:
        self.loads = 0

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        self.loads += 1


def test_everything_is_validated_before_any_object_changes(tmp_path):
    path = Checkpoint(spy=Spy(), step=torch.tensor(1), model=torch.nn.Linear(2, 2)).save(tmp_path / "c")
    spy, step = Spy(), torch.tensor(0)
    with pytest.raises(CheckpointError, match="'weight' has shape"):
        Checkpoint(spy=spy, step=step, model=torch.nn.Linear(3, 2)).restore(path)
    assert spy.loads == 0 and int(step) == 0  # found before the first object was touched, not rolled back


# --------------------------------------------------------------- integrity
def _storage_offset(path: str, key_index: int) -> int:
    """Byte offset in the file of the data of storage number ``key_index``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(f"/data/{key_index}"))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def test_a_flipped_bit_in_a_tensor_is_refused_naming_the_tensor(tmp_path):
    model, opt = _trained()
    path = Checkpoint(model=model, optimizer=opt).save(tmp_path / "c") + ".pt"
    raw = bytearray(open(path, "rb").read())
    raw[_storage_offset(path, 1) + 2] ^= 0x10  # storage 1: model.bias
    open(path, "wb").write(bytes(raw))
    target, target_opt = _fresh()
    before = _snapshot(target, target_opt)
    with pytest.raises(CheckpointError, match=r"c-1.pt' is damaged: tensor 'model/bias' fails its CRC-32 checksum"):
        Checkpoint(model=target, optimizer=target_opt).restore(path[:-3])
    assert all(_same(a, b) for a, b in zip(before, _snapshot(target, target_opt)))


def test_a_changed_setting_outside_the_tensors_is_refused(tmp_path):
    model, opt = _trained()
    path = Checkpoint(model=model, optimizer=opt).save(tmp_path / "c") + ".pt"
    data = torch.load(path, weights_only=True)
    data["objects"]["optimizer"]["param_groups"][0]["lr"] = 0.02  # same checksums, a different learning rate
    torch.save(data, path)
    with pytest.raises(CheckpointError, match="names, shapes, dtypes or settings .* fail their checksum"):
        Checkpoint(model=model, optimizer=opt).restore(path[:-3])


def test_version_1_files_load_with_a_note_and_unknown_versions_are_refused(tmp_path, caplog):
    v1 = tmp_path / "old-1.pt"
    torch.save(
        {"format": "distrib-checkpoint", "version": 1, "save_counter": 4, "objects": {"w": torch.tensor([1.0, 2.0])}},
        v1,
    )
    w = torch.zeros(2)
    ckpt = Checkpoint(w=w)
    with caplog.at_level(logging.WARNING, logger="distrib.checkpoint"):
        ckpt.restore(tmp_path / "old-1").assert_consumed()
    assert w.tolist() == [1.0, 2.0] and ckpt.save_counter == 4
    assert "format version 1" in caplog.text and "cannot be verified" in caplog.text
    torch.save({"format": "distrib-checkpoint", "version": 3, "objects": {}}, tmp_path / "new-1.pt")
    with pytest.raises(CheckpointError, match="format version 3; this distrib reads versions"):
        ckpt.restore(tmp_path / "new-1")


def test_checksums_cover_every_kind_of_state(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).to(torch.float64)
    model[0].weight.data = model[0].weight.data.t()  # a non-contiguous parameter
    objects = dict(
        model=model,
        half=torch.ones(2, dtype=torch.bfloat16),
        flag=torch.tensor(True),
        sched=torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 2),
    )
    path = Checkpoint(**objects).save(tmp_path / "c")
    fmt.load(path + ".pt")  # verifies
    Checkpoint(**objects).restore(path).assert_consumed()


# --------------------------------------------------------------- bad files
class Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_pickled_payload_is_refused_without_running_it(tmp_path):
    pwned = tmp_path / "pwned"
    bad = tmp_path / "ckpt-1.pt"
    torch.save({"format": "distrib-checkpoint", "version": 1, "objects": {"x": Evil(str(pwned))}}, bad)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(x=torch.zeros(1)).restore(tmp_path / "ckpt-1")
    msg = str(info.value)
    assert "pickled Python object" in msg and str(bad) in msg and "system" in msg
    assert "torch.load" in msg
    assert not pwned.exists()


def test_truncated_and_foreign_files(tmp_path):
    ckpt = Checkpoint(w=torch.randn(1000))
    path = ckpt.save(tmp_path / "ckpt")
    data = open(path + ".pt", "rb").read()
    open(path + ".pt", "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is truncated or not a distrib checkpoint") as info:
        ckpt.restore(path)
    assert isinstance(info.value, CheckpointError) and "ckpt-1.pt" in str(info.value)

    for content in (b"", b"garbage bytes", b"PK\x03", data[:10]):
        (tmp_path / "junk.pt").write_bytes(content)
        with pytest.raises(CheckpointError, match="junk.pt. is truncated or not a distrib"):
            ckpt.restore(tmp_path / "junk")
    torch.save({"weight": torch.ones(1)}, tmp_path / "plain.pt")  # valid torch, not ours
    with pytest.raises(CheckpointError, match="not a distrib checkpoint"):
        ckpt.restore(tmp_path / "plain")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="latest_checkpoint") as info:
        Checkpoint(w=torch.zeros(1)).restore(tmp_path / "nope-3")
    assert "nope-3" in str(info.value)


@pytest.mark.parametrize("entry", ["../outside", "/etc/passwd", "sub/../../x", "", ".."])
def test_index_entries_that_leave_the_directory_are_refused(tmp_path, entry):
    (tmp_path / "outside.pt").write_bytes(b"")
    d = tmp_path / "run"
    d.mkdir()
    for index in ({"latest": entry, "all": []}, {"latest": None, "all": ["ckpt-1", entry]}):
        (d / "checkpoint").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="not a file inside .*refuses to follow it") as info:
            latest_checkpoint(d)
        assert repr(entry) in str(info.value)
        with pytest.raises(CheckpointError, match="refuses to follow"):
            CheckpointManager(Checkpoint(), d)


def test_a_damaged_index_is_an_error_naming_it(tmp_path):
    for content in ("", "{not json", "[]", '{"all": "ckpt-1"}', '{"latest": 3}'):
        (tmp_path / "checkpoint").write_text(content)
        with pytest.raises(CheckpointError, match="checkpoint'"):
            latest_checkpoint(tmp_path)


def test_untrackable_objects_and_bad_names():
    with pytest.raises(TypeError) as info:
        Checkpoint(x=3)
    assert "'x'" in str(info.value) and "int" in str(info.value)
    assert "torch.nn.Module" in str(info.value) and "state_dict" in str(info.value)
    with pytest.raises(ValueError, match="identifier"):
        Checkpoint(**{"not valid": torch.zeros(1)})
    with pytest.raises(ValueError, match="identifier"):
        Checkpoint(save=torch.zeros(1))


def test_duck_typed_state_and_attribute_access(tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    c = Counter()
    c.n = 5
    ckpt = Checkpoint(counter=c)
    assert ckpt.counter is c
    path = ckpt.save(tmp_path / "c")
    c2 = Counter()
    Checkpoint(counter=c2).restore(path)
    assert c2.n == 5


# --------------------------------------------------------------- failed writes and crash leftovers
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, whose writes fail with ENOSPC")
def test_a_full_disk_is_a_checkpoint_error_and_keeps_everything_previous(tmp_path, monkeypatch):
    w = torch.arange(4096.0)
    manager = CheckpointManager(Checkpoint(w=w), tmp_path, max_to_keep=1)
    first = manager.save()
    w.fill_(9.0)
    real_fdopen = os.fdopen

    def full_disk(fd, mode):  # the new file's descriptor now writes to /dev/full: the kernel's ENOSPC
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, fd)
        os.close(full)
        return real_fdopen(fd, mode)

    monkeypatch.setattr(os, "fdopen", full_disk)
    with pytest.raises(CheckpointError) as info:
        manager.save()
    monkeypatch.undo()
    msg = str(info.value)
    assert "ckpt-2.pt" in msg and "No space left on device (ENOSPC)" in msg and "previous checkpoint is intact" in msg
    assert isinstance(info.value.__cause__, OSError)
    assert latest_checkpoint(tmp_path) == first == manager.latest_checkpoint and manager.checkpoints == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-1.pt"]  # no temp file left
    assert manager.checkpoint.save_counter == 1  # the failed save did not consume a number
    Checkpoint(w=w).restore(first)
    assert w[5].item() == 5.0


def test_save_dying_halfway_keeps_previous(tmp_path, monkeypatch):
    w = torch.tensor([1.0, 2.0])
    manager = CheckpointManager(Checkpoint(w=w), tmp_path)
    first = manager.save()
    w.fill_(9.0)

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk died")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(CheckpointError, match="ckpt-2.pt' failed: OSError: disk died"):
        manager.save()
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == first == manager.latest_checkpoint
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["ckpt-1.pt"]
    assert not list(tmp_path.glob(".tmp-*"))  # the half-written temp file was removed
    Checkpoint(w=w).restore(latest_checkpoint(tmp_path))
    assert w.tolist() == [1.0, 2.0]


def test_crash_before_index_replace_keeps_previous_and_the_next_save_cleans_up(tmp_path, monkeypatch):
    w = torch.tensor([1.0])
    ckpt = Checkpoint(w=w)
    first = ckpt.save(tmp_path / "ckpt")
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == "checkpoint":
            raise KeyboardInterrupt("killed before the index was replaced")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert ckpt.save_counter == 1  # the failed save did not consume a number
    manager = CheckpointManager(Checkpoint(w=torch.zeros(1)), tmp_path)
    assert manager.restore_or_initialize() == first

    # Leftovers of crashed saves: an older distrib's, and a dead process's, go; a live writer's stays.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (".tmp-leftover", f".tmp-{host}-{dead.pid}-abcd1234", f".tmp-{host}-{live.pid}-abcd1234"):
            (tmp_path / name).write_bytes(b"junk")
        ckpt.save(tmp_path / "ckpt")
        assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == [f".tmp-{host}-{live.pid}-abcd1234"]
    finally:
        live.kill()
        live.wait()
