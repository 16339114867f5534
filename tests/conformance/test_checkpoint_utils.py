"""TF's ``tensorflow/python/training/checkpoint_utils_test.py`` (public repository tensorflow/tensorflow), ported:
``checkpoints_iterator`` (``CheckpointIteratorTest``). The v1 sharded-saver test and ``wait_for_new_checkpoint``
(not a distrib name) are not ported.
"""

from __future__ import annotations

import pytest
import torch

import distrib as ds
from distrib.checkpoint import Checkpoint, checkpoints_iterator


def test_iterator_returns_empty_if_no_checkpoints_found(tmp_path):
    """checkpoint_utils_test.py CheckpointIteratorTest.testReturnsEmptyIfNoCheckpointsFound."""
    assert list(checkpoints_iterator(tmp_path / "no_checkpoints_found", timeout=0)) == []


def test_iterator_returns_single_checkpoint_if_one_checkpoint_found(tmp_path):
    """checkpoint_utils_test.py CheckpointIteratorTest.testReturnsSingleCheckpointIfOneCheckpointFound."""
    checkpoint_dir = tmp_path / "one_checkpoint_found"
    Checkpoint(a=torch.tensor(5)).save(checkpoint_dir / "model.ckpt")
    assert len(list(checkpoints_iterator(checkpoint_dir, timeout=0))) == 1


def test_iterator_timeout_fn():
    """checkpoint_utils_test.py CheckpointIteratorTest.testTimeoutFn."""
    calls = [0]

    def timeout_fn():
        calls[0] += 1
        return calls[0] > 3

    assert list(checkpoints_iterator("/non-existent-dir", timeout=0.1, timeout_fn=timeout_fn)) == []
    assert calls[0] == 4


@pytest.mark.skipif(
    not hasattr(ds, "checkpoints_iterator"),
    reason="ds.checkpoints_iterator is exported by distrib/__init__.py (the lead's file)",
)
def test_the_iterator_is_a_public_name():
    """TF's ``tf.train.checkpoints_iterator`` is ``ds.checkpoints_iterator``."""
    assert ds.checkpoints_iterator is checkpoints_iterator
