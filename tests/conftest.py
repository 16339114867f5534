"""Shared fixtures: a small Fashion-MNIST-shaped IDX directory made by the tests themselves."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def make_idx_dir(directory: Path, n_train: int = 512, n_test: int = 256, seed: int = 0) -> Path:
    """Learnable fake data: the label decides which image rows are bright."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for i, label in enumerate(labels):
            images[i, 2 * label:2 * label + 3, :] += 180
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory


@pytest.fixture
def idx_dir(tmp_path: Path) -> Path:
    return make_idx_dir(tmp_path / "fashion")

# helper scripts run as their own processes; never import them as test modules
collect_ignore = ["scripts", "helpers.py"]


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it: an in-process cluster sets GLOO_SOCKET_IFNAME (and
    launch helpers set ranks), which later tests' subprocesses (srun passes the environment on) would inherit."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
