"""Shared fixtures: a small Fashion-MNIST-shaped IDX directory made by the tests themselves."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest

# One intra-op thread for every process of the session (this one and what it starts; `distrib launch` already gives
# each of 2 tasks on 2 cores 1): two test processes share the 2 cores, and a process with torch's default, a thread
# per core, spins OpenMP threads waiting for a core the other holds (a one-process `distrib train` epoch: 2x the CPU
# time, 2-4x the wall time when the cores are busy). Set before anything imports torch; a caller's value is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# For the same reason, torch.compile compiles in the process that asks (inductor's default on 2 cores: a pool of 2
# fresh compile processes per worker, each importing torch: `distrib train --workers 2 --compile` took 46 s with
# them, 29 s without, 2026-11-29). A caller's value is kept.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# `distrib launch` forks its tasks from a fork server in this session (about 2 CPU-seconds less per task, over a
# hundred launches), where a user's launch starts fresh interpreters; a caller's value is kept. Tests about the
# default take the `default_start_method` fixture.
os.environ.setdefault("DISTRIB_START_METHOD", "forkserver")
# Keras 3 picks its backend once, when first imported: the Keras tests (and the processes they start) run Keras on
# torch, the one backend distrib distributes. Set, not defaulted: a developer's KERAS_BACKEND=jax would fail them.
os.environ["KERAS_BACKEND"] = "torch"


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


@pytest.fixture(scope="session", autouse=True)
def _shared_fork_servers():
    """Every ``distrib launch`` of this test process forks its tasks from a shared fork server
    (:mod:`distrib.cluster.shared_forkserver`): one per import environment, started by the first launch that needs
    it, instead of one per launch (about 2 CPU-seconds each, over a hundred launches). Stopped at the end. Tests
    that look at a launcher's own process tree take the ``own_fork_server`` fixture instead.
    ``DISTRIB_TEST_OWN_FORK_SERVERS=1`` gives each launch a server of its own (to compare, or to rule this out)."""
    import shutil
    import tempfile

    from distrib.cluster.shared_forkserver import DIRECTORY_VARIABLE, stop_servers

    if os.environ.get("DISTRIB_TEST_OWN_FORK_SERVERS") == "1":  # each launch its own server
        yield
        return
    # this test process's own (the other's may still run), and short: a socket's path must fit in 108 bytes
    directory = tempfile.mkdtemp(prefix="distrib-fs-")
    saved = {k: os.environ.get(k) for k in (DIRECTORY_VARIABLE, "DISTRIB_FORK_SERVER_IDLE_SECONDS")}
    os.environ[DIRECTORY_VARIABLE] = directory
    # longer than a pause between launches; and the servers go soon after a pytest that was killed
    os.environ["DISTRIB_FORK_SERVER_IDLE_SECONDS"] = "300"
    yield
    stop_servers(directory)
    shutil.rmtree(directory, ignore_errors=True)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def own_fork_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """``distrib launch --start-method forkserver`` starts a fork server of its own: its tasks are the launcher's
    children (their process tree, ``os.getppid()``, a signal to the parent), which a shared server's are not."""
    monkeypatch.delenv("DISTRIB_FORK_SERVER_DIR", raising=False)


@pytest.fixture
def default_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """``distrib launch`` starts its tasks as a user's launch does (fresh interpreters), not as this session's
    launches do (``DISTRIB_START_METHOD=forkserver``, set above)."""
    monkeypatch.delenv("DISTRIB_START_METHOD", raising=False)
    monkeypatch.delenv("DISTRIB_FORK_SERVER_DIR", raising=False)


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


# Seconds each of the slowest files took (pytest -n 2 --durations=0, summed per file, on the 2 quiet cores;
# the slurm-and-hosts scope: its files together). Only the order matters: the scheduler hands out the longest first,
# so that no long file starts last while the other test process has nothing left to do (xdist's own order is by test
# count: a file of one long test, test_gpu_check's, came last). The files not named here follow in collection order.
EXPECTED_SECONDS = {
    SERIAL_SCOPE: 159,
    "tests/test_gpu_check.py": 54,
    "tests/test_benchmarks.py": 41,
    "tests/app/test_train_cli.py": 39,
    "tests/test_ports.py": 34,
    "tests/checkpoint/test_checkpoint_matrix.py": 32,
    "tests/strategies/test_multi_worker.py": 32,
    "tests/cluster/test_torchrun.py": 30,
    "tests/faults/test_parameter_server.py": 28,
    "tests/cluster/test_launch.py": 28,
    "tests/test_doc_blocks.py": 28,
    "tests/strategies/test_sharded.py": 27,
    "tests/test_checkpoint_strategies.py": 27,
    "tests/preemption/test_torchrun.py": 27,
    "tests/cluster/test_forkserver.py": 26,
    "tests/checkpoint/test_sharded_checkpoint.py": 26,
    "tests/strategies/test_mesh_checkpoints.py": 21,
    "tests/input/test_dataloader_workers.py": 21,
    "tests/strategies/test_deferred_init.py": 20,
    "tests/preemption/test_preemption_launch.py": 20,
    "tests/cluster/test_resize.py": 19,
    "tests/preemption/test_preemption_train.py": 18,
    "tests/strategies/test_mesh.py": 18,
    "tests/test_examples.py": 17,
    "tests/comm/test_collectives.py": 17,
    "tests/preemption/test_handler.py": 17,
    "tests/strategies/test_sharded_memory.py": 16,
    "tests/faults/test_launch.py": 15,
    "tests/parameter_server/test_cancellation_load.py": 25,
    "tests/faults/test_torchrun.py": 13,
    "tests/keras/test_fit.py": 13,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest scopes first (:data:`EXPECTED_SECONDS`; a stable sort: each file keeps its tests' order, and
    the files of the serial scope stay together)."""
    items.sort(key=lambda item: -EXPECTED_SECONDS.get(scope_of(item.nodeid), 0))


class _FileScheduling:
    """xdist's ``--dist loadfile`` with :func:`scope_of` as the scope. Not ``--dist loadgroup`` with marks: with
    pytest 9.2 its group suffix no longer reaches the scheduler (pytest-xdist issue #1386), and it splits files."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        from xdist.scheduler import LoadScopeScheduling

        class FileScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return scope_of(nodeid)

        # the scopes in collection order, which pytest_collection_modifyitems made longest first (not xdist's
        # reordering by test count)
        config.option.loadscopereorder = False
        return FileScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    # registered only where xdist is installed: pytest refuses a hook nobody declared
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FileScheduling(), "distrib-file-scheduling")
