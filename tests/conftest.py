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
            images[i, 2 * label : 2 * label + 3, :] += 180
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


# Files that start a Slurm cluster or network-namespace hosts: one test process runs them one after another (each
# starts daemons and namespaces that take the machine's CPUs; two at once only slow both down)
SERIAL_SCOPE = "slurm-and-hosts"
SERIAL_FILES = {
    "tests/cluster/test_slurm.py",
    "tests/preemption/test_slurm.py",
    "tests/cluster/test_two_hosts.py",
    "tests/faults/test_hosts.py",
    "tests/faults/test_timeouts.py",
    "tests/parameter_server/test_bind_address.py",
}


def scope_of(nodeid: str) -> str:
    """The unit of work of ``pytest -n N`` (scripts/test.sh): a test file, so that its module fixtures (a reference
    run, a checkpoint matrix's saves) are built once, on one process; the files of ``SERIAL_FILES`` share one."""
    file = nodeid.split("::", 1)[0]
    return SERIAL_SCOPE if file in SERIAL_FILES else file


class _FileScheduling:
    """xdist's ``--dist loadfile`` with :func:`scope_of` as the scope. Not ``--dist loadgroup`` with marks: with
    pytest 9.2 its group suffix no longer reaches the scheduler (pytest-xdist issue #1386), and it splits files."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        from xdist.scheduler import LoadScopeScheduling

        class FileScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return scope_of(nodeid)

        return FileScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    # registered only where xdist is installed: pytest refuses a hook nobody declared
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FileScheduling(), "distrib-file-scheduling")
