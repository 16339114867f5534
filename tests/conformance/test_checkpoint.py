"""TF's ``tensorflow/python/checkpoint/checkpoint_test.py`` (public repository tensorflow/tensorflow), ported.

``Checkpoint.save/write/restore/read`` and the load status (``expect_partial``, ``assert_consumed``, ...).
A ``tf.Variable`` becomes a tracked ``torch.Tensor`` (restored in place); a Trackable with custom saveables
becomes an object with ``state_dict``/``load_state_dict``. TF's tests of its object graph (roots, deferred
restoration, templates, name escaping, graph mode, frozen savers) test machinery distrib does not have; where
a TF behaviour meets a distrib difference the test asserts distrib's behaviour and says why.
"""

from __future__ import annotations

import copy
import os
import pathlib
import warnings

import pytest
import torch

from distrib.checkpoint import Checkpoint, CheckpointError, latest_checkpoint


def exists(path: str) -> bool:
    """TF's ``checkpoint_management.checkpoint_exists`` for distrib's one-file checkpoints."""
    return os.path.isfile(path + ".pt")


class Mirroring:
    """TF's ``_OwnsMirroredVariables``: one saved value restored into two variables."""

    def __init__(self) -> None:
        self.non_dep_variable = torch.tensor(6.0)
        self.mirrored = torch.tensor(15.0)

    def state_dict(self) -> dict:
        return {"value": self.non_dep_variable.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.non_dep_variable.copy_(state["value"])
        self.mirrored.copy_(state["value"])


def test_more_complex_saveable_returned(tmp_path):
    """checkpoint_test.py CheckpointingTests.testMoreComplexSaveableReturned."""
    v = Mirroring()
    checkpoint = Checkpoint(v=v)
    prefix = str(tmp_path / "ckpt")
    v.non_dep_variable.fill_(42.0)
    save_path = checkpoint.save(prefix)
    v.non_dep_variable.fill_(43.0)
    v.mirrored.fill_(44.0)
    checkpoint.restore(save_path).assert_consumed().initialize_or_restore()
    assert float(v.non_dep_variable) == 42.0 and float(v.mirrored) == 42.0
    v.non_dep_variable.fill_(44.0)
    save_path = checkpoint.save(prefix)
    v.non_dep_variable.fill_(45.0)
    checkpoint.restore(save_path).assert_consumed().initialize_or_restore()
    assert float(v.non_dep_variable) == 44.0 and float(v.mirrored) == 44.0


def test_assert_consumed_no_checkpoint(tmp_path):
    """checkpoint_test.py CheckpointingTests.testAssertConsumedNoCheckpoint."""
    v = torch.tensor(0.0)
    ckpt = Checkpoint(v=v)
    save_path = ckpt.save(str(tmp_path / "ckpt"))
    status = ckpt.restore(save_path)
    del ckpt
    status.assert_consumed()


def test_deep_copy_checkpoint(tmp_path):
    """checkpoint_test.py CheckpointingTests.testDeepCopyCheckpoint."""
    v = torch.tensor(1.0)
    original_ckpt = Checkpoint(v=v)
    copied_ckpt = copy.deepcopy(original_ckpt)
    copied_ckpt.v.fill_(2.0)
    assert float(v) == 1.0
    save_path = copied_ckpt.save(str(tmp_path / "ckpt"))
    original_ckpt.restore(save_path).assert_consumed()
    assert float(v) == 2.0


def test_custom_numbering_with_write(tmp_path):
    """checkpoint_test.py CheckpointingTests.testCustomNumbering."""
    prefix = str(tmp_path / "ckpt")
    step = torch.tensor(0)
    checkpoint = Checkpoint(step=step)
    for i in range(5):
        path = checkpoint.write(f"{prefix}-{int(step)}")
        assert path.endswith(f"-{2 * i}")
        step.add_(2)


def _two_variables_saved(tmp_path) -> str:
    return Checkpoint(v1=torch.tensor(2.0), v2=torch.tensor(3.0)).save(str(tmp_path / "ckpt"))


def test_partial_restore_warning_attribute(tmp_path):
    """checkpoint_test.py CheckpointingTests.testPartialRestoreWarningAttribute.

    TF logs the warning when the status is deleted; distrib warns (``warnings.warn``) then too. TF's
    partial root tracks ``v1`` as an empty Trackable; in distrib an untracked name is what is unused.
    """
    save_path = _two_variables_saved(tmp_path)
    partial_root = Checkpoint(v2=torch.tensor(0.0))
    with pytest.warns(UserWarning) as record:
        partial_root.restore(save_path)
    assert float(partial_root.v2) == 3.0
    messages = " ".join(str(w.message) for w in record)
    assert "'v1'" in messages and "'v2'" not in messages and "expect_partial()" in messages


def test_attribute_exception(tmp_path):
    """checkpoint_test.py CheckpointingTests.testAttributeException."""
    save_path = _two_variables_saved(tmp_path)
    status = Checkpoint(v2=torch.tensor(0.0)).restore(save_path)
    with pytest.raises(AssertionError, match=r"Unused attributes(.|\n)*'v1'"):
        status.assert_consumed()


def test_silence_partial_warning(tmp_path):
    """checkpoint_test.py CheckpointingTests.testSilencePartialWarning."""
    save_path = _two_variables_saved(tmp_path)
    partial_root = Checkpoint(v1=torch.tensor(0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        partial_root.restore(save_path).expect_partial()
        assert float(partial_root.v1) == 2.0
        del partial_root


def test_late_dependency_is_not_restored_after_the_fact(tmp_path):
    """checkpoint_test.py CheckpointingTests.testLateDependencyTracking, testDepAfterVar, testRestoreOnAssign.

    Difference: TF defers the restoration of objects added after ``restore``; distrib restores at once
    (PyTorch idiom: ``load_state_dict`` is immediate, objects exist before they are loaded). A late object
    is therefore not restored, and ``assert_consumed`` says so instead of passing later.
    """
    prefix = str(tmp_path / "ckpt")
    original = Checkpoint()
    original.dep = torch.tensor(123.0)
    save_path = original.save(prefix)
    load_into = Checkpoint()
    status = load_into.restore(save_path)
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError):
        status.assert_consumed()
    load_into.dep = torch.tensor(0.0)
    with pytest.raises(AssertionError):
        status.assert_consumed()  # TF: passes here, after the deferred restore
    assert float(load_into.dep) == 0.0
    load_into.restore(save_path).assert_consumed()  # the distrib way: track, then restore
    assert float(load_into.dep) == 123.0


def test_checkpoint_state(tmp_path):
    """checkpoint_test.py CheckpointingTests.testCheckpointState: no checkpoints are deleted by default."""
    prefix = str(tmp_path / "ckpt")
    saver = Checkpoint(obj=torch.nn.Linear(1, 1))
    for _ in range(10):
        saver.save(prefix)
    expected = {"checkpoint"} | {f"ckpt-{n}.pt" for n in range(1, 11)}
    assert expected <= set(os.listdir(tmp_path))


def test_checkpoint_state_changing_var_list(tmp_path):
    """checkpoint_test.py CheckpointingTests.testCheckpointStateChangingVarList.

    Difference: TF restores ``ckpt-6`` into a checkpoint that also tracks ``var_6``..``var_9`` (absent
    from that file) and leaves those alone; distrib refuses, changing nothing, because a tracked object
    silently left unrestored is how a resumed job trains from garbage. Restoring with the names the file
    holds works.
    """
    prefix = str(tmp_path / "ckpt")
    checkpoint = Checkpoint(obj=torch.nn.Linear(1, 1))
    looped = []
    for iteration in range(10):
        new_variable = torch.tensor(iteration)
        setattr(checkpoint, f"var_{iteration}", new_variable)
        checkpoint.save(prefix)
        looped.append(new_variable)
    assert latest_checkpoint(tmp_path) == prefix + "-10"
    for v in looped:
        v.fill_(314)
    with pytest.raises(CheckpointError, match=r"does not hold \['var_6', 'var_7', 'var_8', 'var_9'\]"):
        checkpoint.restore(prefix + "-6")
    assert all(int(v) == 314 for v in looped)  # all or nothing
    partial = Checkpoint(obj=checkpoint.obj, **{f"var_{i}": looped[i] for i in range(6)})
    partial.restore(prefix + "-6").assert_consumed()
    assert [int(v) for v in looped] == [0, 1, 2, 3, 4, 5, 314, 314, 314, 314]
    checkpoint.restore(prefix + "-10").assert_consumed()
    assert [int(v) for v in looped] == list(range(10))


def test_restore_none_then_save(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_restore_after_adding_empty_trackable_data_structure."""
    model = torch.nn.Linear(2, 2)
    checkpoint = Checkpoint(model=model)
    checkpoint.restore(None).initialize_or_restore()
    save_path = checkpoint.save(str(tmp_path / "ckpt"))
    load_status = Checkpoint(model=torch.nn.Linear(2, 2)).restore(save_path)
    load_status.assert_existing_objects_matched().run_restore_ops()


def test_write_then_read(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_write_checkpoint_path_str_from_function
    (and ..._path_tensor_from_function: a path is a str or os.PathLike in distrib)."""
    prefix = str(tmp_path / "ckpt")
    save_checkpoint = Checkpoint(v=torch.tensor(1.0))
    save_checkpoint.write(prefix)
    load_checkpoint = Checkpoint(v=torch.tensor(0.0))
    status = load_checkpoint.read(prefix)
    status.assert_existing_objects_matched()
    status.assert_consumed()
    status.run_restore_ops()
    assert float(load_checkpoint.v) == 1.0
    save_checkpoint.v.fill_(3.0)
    save_checkpoint.write(prefix)
    save_checkpoint.v.fill_(0.0)
    status = load_checkpoint.read(prefix)
    status.assert_existing_objects_matched()
    status.assert_consumed()
    assert float(load_checkpoint.v) == 3.0
    assert load_checkpoint.save_counter == 0  # read: the counter is not restored


def test_write_into_a_directory_that_does_not_exist(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_write_checkpoint_path_tensor_does_not_exist_from_function.

    Difference: TF raises NotFoundError; distrib creates the directory, as CheckpointManager and Keras'
    ModelCheckpoint do (under several workers only the chief can create it, so workers cannot do it first).
    """
    prefix = str(tmp_path / "DOES_NOT_EXIST" / "ckpt")
    Checkpoint(v=torch.tensor(1.0)).write(prefix)
    assert exists(prefix)


def test_initialize_with_data_structures(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_inititialize_with_data_structures.

    Difference: lists and dicts of variables are tracked as ``torch.nn.ParameterList`` /
    ``ParameterDict`` (PyTorch's containers with a state_dict); a bare list or dict is a TypeError that
    says so, not a silently untracked attribute.
    """
    with pytest.raises(TypeError, match="ParameterList / ParameterDict"):
        Checkpoint(a=[torch.tensor(0.0), torch.tensor(1.0)])

    def make(a0, a1, ba, bb):
        p = torch.nn.Parameter
        return Checkpoint(
            a=torch.nn.ParameterList([p(torch.tensor(a0)), p(torch.tensor(a1))]),
            b=torch.nn.ParameterDict({"a": p(torch.tensor(ba)), "b": p(torch.tensor(bb))}),
        )

    save_path = make(0.0, 1.0, 2.0, 3.0).save(str(tmp_path / "ckpt"))
    load_checkpoint = make(4.0, 5.0, 6.0, 7.0)
    load_checkpoint.restore(save_path)
    assert [x.item() for x in load_checkpoint.a] == [0.0, 1.0]
    assert {k: v.item() for k, v in load_checkpoint.b.items()} == {"a": 2.0, "b": 3.0}


def test_restore_incompatible_shape(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_restore_incompatible_shape."""
    save_path = Checkpoint(v=torch.tensor([1.0, 1.0])).save(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=r"shape \(1,\) but the file holds shape \(2,\)"):
        Checkpoint(v=torch.tensor([1.0])).restore(save_path)


def test_save_restore_fspath(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_save_restore_fspath."""
    v, w = torch.tensor(1.0), torch.tensor(0.0)
    save_path = pathlib.Path(Checkpoint(v=v).save(pathlib.Path(tmp_path) / "ckpt"))
    Checkpoint(v=w).restore(save_path)
    assert float(w) == 1.0


def test_read_write_fspath(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_read_write_fspath."""
    v, w = torch.tensor(1.0), torch.tensor(0.0)
    save_path = pathlib.Path(Checkpoint(v=v).write(pathlib.Path(tmp_path) / "ckpt"))
    Checkpoint(v=w).read(save_path)
    assert float(w) == 1.0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to list open files")
def test_ckpt_files_closed_after_restoration(tmp_path):
    """checkpoint_test.py CheckpointingTests.test_ckpt_files_closed_after_restoration (/proc instead of psutil)."""
    save_path = Checkpoint(root=torch.nn.Linear(1, 1)).save(str(tmp_path / "ckpt"))
    Checkpoint(root=torch.nn.Linear(1, 1)).restore(save_path)
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_files.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert not any(save_path in f for f in open_files)


class MultiTensor:
    """TF's SerializeToTensorTest ``MultiTensor``: two tensors serialized under their own keys."""

    def __init__(self, v1: float, v2: float) -> None:
        self.v1, self.v2 = torch.tensor(v1), torch.tensor(v2)

    def state_dict(self) -> dict:
        return {"v1": self.v1, "v2": self.v2}

    def load_state_dict(self, state: dict) -> None:
        self.v1.copy_(state["v1"])
        self.v2.copy_(state["v2"])


def test_keys_and_metadata(tmp_path):
    """checkpoint_test.py SerializeToTensorTest.test_keys_and_metadata (the file read with torch.load,
    distrib's ``tf.train.load_checkpoint``)."""
    root, child = MultiTensor(1, 2), MultiTensor(3, 4)
    save_path = Checkpoint(root=root, child=child).save(str(tmp_path / "ckpt"))
    objects = torch.load(save_path + ".pt", weights_only=True)["objects"]
    assert {k: {n: int(t) for n, t in v.items()} for k, v in objects.items()} == {
        "root": {"v1": 1, "v2": 2},
        "child": {"v1": 3, "v2": 4},
    }
    for t in (root.v1, root.v2, child.v1, child.v2):
        t.zero_()
    Checkpoint(root=root, child=child).restore(save_path).assert_consumed().run_restore_ops()
    assert [int(t) for t in (root.v1, root.v2, child.v1, child.v2)] == [1, 2, 3, 4]
