"""TF's ``tensorflow/python/checkpoint/checkpoint_management_test.py`` (public repository tensorflow/tensorflow),
ported: ``CheckpointManager`` and ``latest_checkpoint``.

TF's CheckpointState proto is distrib's JSON index (``distrib/checkpoint/index.py``); the proto helpers
(``generate_checkpoint_state_proto``, ``update_checkpoint_state``, ``get_checkpoint_state``) and the v1
``Saver`` utilities (``checkpoint_exists``, ``get_checkpoint_mtimes``, ``remove_checkpoint``) are not distrib
names and are not ported.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

import pytest
import torch

import distrib.checkpoint.manager as manager_module
from distrib.checkpoint import Checkpoint, CheckpointError, CheckpointManager, latest_checkpoint


def exists(path: str) -> bool:
    """TF's ``checkpoint_management.checkpoint_exists`` for distrib's one-file checkpoints."""
    return os.path.isfile(path + ".pt")


def test_relative_path(tmp_path, monkeypatch):
    """checkpoint_management_test.py LatestCheckpointWithRelativePaths.testRelativePath."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("train")
    v0 = torch.tensor(0.0)
    save = Checkpoint(v0=v0)
    for _ in range(3):
        save.save(os.path.join("train", "snapshot"))
        v0.add_(1.0)
    v0 = torch.tensor(-1.0)
    name = latest_checkpoint("train")
    assert name is not None
    Checkpoint(v0=v0).restore(name)
    assert float(v0) == 2.0


def test_name_collision(tmp_path, monkeypatch):
    """checkpoint_management_test.py LatestCheckpointWithRelativePaths.testNameCollision.

    Difference: TF refuses to save to ``train/checkpoint`` (it would overwrite the index); distrib's data
    files end in ``.pt``, so ``train/checkpoint`` writes ``train/checkpoint.pt`` beside the index.
    """
    monkeypatch.chdir(tmp_path)
    os.mkdir("train")
    filepath = os.path.join("train", "checkpoint")
    ckpt = Checkpoint(a=torch.tensor(0.0))
    ckpt.save(filepath)
    assert latest_checkpoint("train") is not None
    ckpt.write(filepath)
    assert os.path.isfile(filepath + ".pt") and latest_checkpoint("train") == filepath + "-1"


def test_checkpoint_state_fails_when_incomplete(tmp_path):
    """checkpoint_management_test.py CheckpointStateTest.testCheckPointStateFailsWhenIncomplete."""
    (tmp_path / "checkpoint").write_text("")
    with pytest.raises(ValueError, match="unreadable"):
        latest_checkpoint(tmp_path)


def test_index_paths_outside_the_directory_are_refused(tmp_path):
    """checkpoint_management_test.py CheckpointStateTest.testCheckPointCompletesRelativePaths, testAbsPath.

    Difference: TF's index may hold absolute paths and ``./`` prefixes, which it resolves; distrib's
    index (JSON) holds plain file names and refuses anything else, so a planted index cannot point a
    restore at a file outside the directory (issue 10, C.6).
    """
    for name in ("./model.ckpt-687529", str(tmp_path / "model-0"), "../model-0"):
        (tmp_path / "checkpoint").write_text(f'{{"latest": "{name}", "all": ["{name}"]}}')
        with pytest.raises(CheckpointError, match="refuses to follow"):
            latest_checkpoint(tmp_path)


def test_manager_deletion(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testDeletion."""
    manager = CheckpointManager(Checkpoint(), tmp_path, max_to_keep=3)
    first, second, third, fourth = (manager.save() for _ in range(4))
    assert exists(fourth) and exists(third) and exists(second) and not exists(first)


def test_manager_keep_all(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testKeepAll."""
    checkpoint = Checkpoint()
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=None)
    first, second, third = manager.save(), manager.save(), manager.save()
    assert all(exists(p) for p in (first, second, third))
    assert manager.latest_checkpoint == third and manager.checkpoints == [first, second, third]
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=None)
    fourth = manager.save()
    assert manager.checkpoints == [first, second, third, fourth]
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=3)
    assert manager.checkpoints == [first, second, third, fourth]
    assert all(exists(p) for p in (first, second, third, fourth))
    fifth = manager.save()
    assert manager.checkpoints == [third, fourth, fifth]
    assert exists(fifth) and exists(fourth) and exists(third) and not exists(second) and not exists(first)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def index_of(directory) -> dict:
    return json.loads((pathlib.Path(directory) / "checkpoint").read_text())


def test_manager_save_restore_state(tmp_path, monkeypatch):
    """checkpoint_management_test.py CheckpointManagerTest.testSaveRestoreState (keep_checkpoint_every_n_hours;
    TF's CheckpointState proto is distrib's JSON index)."""
    clock = Clock(3.0)
    monkeypatch.setattr(manager_module, "time", clock)
    d = str(tmp_path)
    checkpoint = Checkpoint()
    first_manager = CheckpointManager(checkpoint, d, max_to_keep=2)
    first_time, first_name = 10000.0, os.path.join(d, "ckpt-1")
    clock.now = first_time
    first_manager.save()
    second_time, second_name = first_time + 3610.0, os.path.join(d, "ckpt-2")
    clock.now = second_time
    first_manager.save()
    state = index_of(d)
    assert [state["timestamps"][n] for n in state["all"]] == [first_time, second_time]
    assert first_manager.checkpoints == [first_name, second_name] and first_manager.latest_checkpoint == second_name
    del first_manager

    second_manager = CheckpointManager(checkpoint, d, max_to_keep=2, keep_checkpoint_every_n_hours=1.5)
    assert second_manager.checkpoints == [first_name, second_name]
    assert second_manager.latest_checkpoint == second_name
    third_name, third_time = os.path.join(d, "ckpt-3"), second_time + 3600.0 * 0.2
    clock.now = third_time
    second_manager.save()
    assert exists(first_name) and exists(second_name)
    assert second_manager.checkpoints == [second_name, third_name]
    assert index_of(d)["last_preserved_timestamp"] == first_time
    fourth_time, fourth_name = third_time + 3600.0 * 0.5, os.path.join(d, "ckpt-4")
    clock.now = fourth_time
    second_manager.save()
    assert exists(first_name) and not exists(second_name)
    assert second_manager.checkpoints == [third_name, fourth_name]
    fifth_time, fifth_name = fourth_time + 3600.0 * 0.5, os.path.join(d, "ckpt-5")
    clock.now = fifth_time
    second_manager.save()
    assert second_manager.checkpoints == [fourth_name, fifth_name]
    assert index_of(d)["last_preserved_timestamp"] == first_time
    del second_manager

    third_manager = CheckpointManager(checkpoint, d, max_to_keep=2, keep_checkpoint_every_n_hours=1.5)
    assert third_manager.latest_checkpoint == fifth_name
    clock.now += 10.0
    third_manager.save()
    sixth_name = os.path.join(d, "ckpt-6")
    assert index_of(d)["last_preserved_timestamp"] == fourth_time
    assert all(exists(p) for p in (first_name, fourth_name, fifth_name, sixth_name))
    assert not exists(second_name) and not exists(third_name)
    assert third_manager.checkpoints == [fifth_name, sixth_name]


def test_manager_continue_from_unmanaged(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testContinueFromUnmanaged."""
    prefix = str(tmp_path / "unusual_prefix")
    checkpoint = Checkpoint()
    first_path, second_path = checkpoint.save(prefix), checkpoint.save(prefix)
    del checkpoint
    checkpoint = Checkpoint()
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    checkpoint.restore(manager.latest_checkpoint).run_restore_ops()
    assert checkpoint.save_counter == 2
    third_path = manager.save()
    assert manager.checkpoints == [third_path]
    fourth_path = manager.save()
    assert manager.checkpoints == [third_path, fourth_path]
    fifth_path = manager.save()
    assert manager.checkpoints == [fourth_path, fifth_path]
    assert exists(first_path) and exists(second_path) and not exists(third_path)
    assert exists(fourth_path) and exists(fifth_path)


def test_manager_clock_reset(tmp_path, monkeypatch, caplog):
    """checkpoint_management_test.py CheckpointManagerTest.testClockReset."""
    clock = Clock(10000.0)
    monkeypatch.setattr(manager_module, "time", clock)
    d = str(tmp_path)
    checkpoint = Checkpoint()
    first_manager = CheckpointManager(checkpoint, d, max_to_keep=1, keep_checkpoint_every_n_hours=1.0)
    first_path = first_manager.save()
    clock.now += 3600.0
    second_path = first_manager.save()
    clock.now += 3600.0
    third_path = first_manager.save()
    assert not exists(first_path) and exists(second_path) and exists(third_path)
    assert first_manager.checkpoints == [third_path]
    assert index_of(d)["last_preserved_timestamp"] == 13600.0
    clock.now = 5000.0  # the clock goes back
    del first_manager
    with caplog.at_level(logging.WARNING, logger="distrib.checkpoint"):
        second_manager = CheckpointManager(checkpoint, d, max_to_keep=1)
    assert "behind the last preserved checkpoint timestamp" in caplog.text
    assert exists(second_path)
    assert second_manager.latest_checkpoint == third_path and second_manager.checkpoints == []
    clock.now += 10.0
    fourth_path = second_manager.save()
    assert exists(second_path) and exists(third_path)
    assert second_manager.latest_checkpoint == fourth_path and second_manager.checkpoints == [fourth_path]
    clock.now += 10.0
    fifth_path = second_manager.save()
    assert exists(second_path) and exists(third_path) and second_manager.checkpoints == [fifth_path]
    state = index_of(d)
    assert state["last_preserved_timestamp"] == 5000.0 and list(state["timestamps"].values()) == [5020.0]


def test_manager_custom_numbering(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testCustomNumbering."""
    step = torch.tensor(0)
    checkpoint = Checkpoint(step=step)
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    for i in range(5):
        path = manager.save(checkpoint_number=step)
        assert path.endswith(f"-{2 * i}")
        step.add_(2)
    assert checkpoint.save_counter == 5
    last_path = manager.save(checkpoint_number=32)
    assert "-32" in last_path
    assert last_path == manager.latest_checkpoint == latest_checkpoint(tmp_path)
    assert [os.path.join(tmp_path, n) for n in index_of(tmp_path)["all"]] == [path, last_path]


def test_manager_custom_checkpoint_prefix(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testCustomCheckpointPrefix."""
    checkpoint = Checkpoint()
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=2, checkpoint_name="ckpt_name")
    assert os.path.basename(manager.save(checkpoint_number=5)) == "ckpt_name-5"
    manager = CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    assert os.path.basename(manager.save(checkpoint_number=5)) == "ckpt-5"


def test_manager_restore_or_initialize(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testRestoreOrInitialize."""
    init_path = Checkpoint(v=torch.tensor(2.0)).save(str(tmp_path / "init"))
    v = torch.tensor(1.0)
    checkpoint = Checkpoint(v=v)
    manager = CheckpointManager(
        checkpoint, tmp_path / "ckpt", max_to_keep=None, init_fn=lambda: checkpoint.restore(init_path).run_restore_ops()
    )
    assert manager.restore_or_initialize() is None
    assert float(v) == 2.0
    manager.save()
    assert manager.restore_or_initialize() is not None


def test_manager_fspath_directory(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testCheckpointManagerFSpathDirectory."""
    directory = pathlib.Path(tmp_path)
    manager = CheckpointManager(Checkpoint(v=torch.tensor(0.0)), directory, max_to_keep=2, checkpoint_name="ckpt_name")
    assert manager.save() == str(directory / "ckpt_name-1")
    assert manager.restore_or_initialize() == str(directory / "ckpt_name-1")


def test_latest_checkpoint_fspath_directory(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testLatestCheckpointFSpathDirectory."""
    directory = pathlib.Path(tmp_path)
    CheckpointManager(Checkpoint(), directory, max_to_keep=2, checkpoint_name="ckpt_name").save()
    assert latest_checkpoint(directory) == str(directory / "ckpt_name-1")


def test_manager_checkpoint_interval(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testCheckpointInterval."""
    step_counter = torch.tensor(0)
    manager = CheckpointManager(
        Checkpoint(v=torch.tensor(1.0)), tmp_path, max_to_keep=None, step_counter=step_counter, checkpoint_interval=2
    )
    path = manager.save(check_interval=True)
    assert exists(path)
    step_counter.add_(1)
    assert manager.save(check_interval=True) is None
    step_counter.add_(1)
    assert exists(manager.save(check_interval=True))
    assert manager.save(check_interval=True) is None  # the same step again
    step_counter.add_(1)
    assert manager.save(check_interval=True) is None
    assert exists(manager.save(check_interval=False))
    with pytest.raises(ValueError, match="step_counter"):
        CheckpointManager(Checkpoint(), tmp_path, checkpoint_interval=2)


def test_manager_checkpoint_interval_with_last_checkpoint_step(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testCheckpointIntervalWithLastCheckpointStep."""
    step_counter = torch.tensor(1)
    manager = CheckpointManager(
        Checkpoint(v=torch.tensor(1.0)),
        tmp_path,
        max_to_keep=None,
        step_counter=step_counter,
        checkpoint_interval=2,
        last_checkpoint_step=1,
    )
    assert manager.save(check_interval=True) is None
    step_counter.add_(1)
    assert manager.save(check_interval=True) is None
    step_counter.add_(1)
    assert exists(manager.save(check_interval=True))


def test_manager_checkpoint_interval_with_restore(tmp_path):
    """checkpoint_management_test.py CheckpointManagerTest.testCheckpointIntervalWithRestore."""
    step_counter = torch.tensor(0)
    checkpoint = Checkpoint(v=torch.tensor(1.0))
    checkpoint.save(str(tmp_path / "ckpt"))
    manager = CheckpointManager(
        checkpoint, tmp_path, max_to_keep=None, step_counter=step_counter, checkpoint_interval=2
    )
    assert manager.restore_or_initialize() is not None
    assert manager.save() is None
