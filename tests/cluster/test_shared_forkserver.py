"""``DISTRIB_FORK_SERVER_DIR``: launches share one fork server per import environment
(:mod:`distrib.cluster.shared_forkserver`). A task's exit code comes back through the process that forked it, a new
import environment or edited distrib sources get another server, an idle server exits, a dead one is replaced, and
nothing of it holds a launch's output."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from helpers import alive, launch

from distrib.cluster import shared_forkserver
from distrib.cluster.shared_forkserver import DIRECTORY_VARIABLE, server_key, stop_servers

TASK = (
    "import gc, json, os, signal, sys, torch\n"  # torch: forkable
    "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    "print('frozen', gc.get_freeze_count() > 0, 'pid', os.getpid(), flush=True)\n"
    "if sys.argv[1] == 'kill' and index == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
    "sys.exit(0 if sys.argv[1] == 'kill' else int(sys.argv[1]))\n"
)


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch):
    """A directory of shared servers of this test's own (not the session's), stopped and removed at the end. Not
    under tmp_path: a socket's path must fit in 108 bytes, and pytest's paths under xdist do not leave room."""
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="distrib-fs-"))
    monkeypatch.setenv(DIRECTORY_VARIABLE, str(directory))
    yield directory
    stop_servers(str(directory))
    shutil.rmtree(directory, ignore_errors=True)


def _pids(directory: Path) -> set[int]:
    return {int(p.read_text()) for p in directory.glob("*.pid")}


def test_launches_share_one_server_and_each_task_s_exit_code_comes_back(tmp_path: Path, servers: Path) -> None:
    script = tmp_path / "task.py"
    script.write_text(TASK)
    code, log, _ = launch("--workers", "2", str(script), "0", timeout=120)
    assert code == 0 and log.count("frozen True") == 2, log  # forked from a server that froze its objects
    (server,) = _pids(servers)
    assert alive({server})  # it outlives the launch
    code, log, _ = launch("--workers", "1", str(script), "7", timeout=120)
    assert code == 7 and "worker 0 failed with exit code 7" in log and "frozen True" in log, log
    code, log, _ = launch("--workers", "2", str(script), "kill", timeout=120)
    assert code == 128 + 9 and "worker 0 failed with exit code 137" in log, log  # killed by a signal: -9
    assert _pids(servers) == {server}  # no second server: each launch took a session of the first
    assert stop_servers(str(servers)) == 1
    assert not alive({server})


def test_another_import_environment_gets_a_server_of_its_own(
    tmp_path: Path, servers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "task.py"
    script.write_text("import torch._inductor.config as c\nprint('compile_threads', c.compile_threads)\n")
    code, log, _ = launch("--workers", "1", str(script), timeout=120)
    assert code == 0 and "compile_threads" in log, log
    # read once, when the server imports torch._dynamo: a task of the first server would print its value
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "5")
    code, log, _ = launch("--workers", "1", str(script), timeout=120)
    assert code == 0 and "compile_threads 5" in log, log
    assert len(_pids(servers)) == 2
    first, second = sorted(servers.glob("*.pid"))
    assert first.stem != second.stem


def test_the_key_follows_the_import_environment_and_distrib_s_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server never forks a task from older distrib code: an edited source is another key."""
    import distrib

    package = tmp_path / "distrib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "module.py").write_text("x = 1\n")
    monkeypatch.setattr(distrib, "__file__", str(package / "__init__.py"))
    env = {"PATH": "/bin"}
    key = server_key(env)
    assert server_key({**env, "TF_CONFIG": "{}"}) == key  # not an import-time variable
    assert server_key({**env, "OMP_NUM_THREADS": "3"}) != key
    # read by glibc when a process starts: a task forked from a server without it would keep the server's allocator
    assert server_key({**env, "MALLOC_MMAP_THRESHOLD_": "131072"}) != key
    assert server_key({**env, "PYTHONWARNINGS": "ignore"}) != key  # read when Python starts
    assert server_key({**env, "TORCHDYNAMO_VERBOSE": "1"}) != key  # read when torch._dynamo is imported
    (package / "module.py").write_text("x = 22\n")
    assert server_key(env) != key


def test_an_idle_server_exits_and_a_dead_one_is_replaced(
    tmp_path: Path, servers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "task.py"
    script.write_text(TASK)
    monkeypatch.setenv("DISTRIB_FORK_SERVER_IDLE_SECONDS", "1")
    assert launch("--workers", "1", str(script), "0", timeout=120)[0] == 0
    (first,) = _pids(servers)
    deadline = time.monotonic() + 30
    while (alive({first}) or list(servers.glob("*.sock"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive({first}) and not list(servers.glob("*.sock")) and not _pids(servers)  # gone, files removed
    monkeypatch.setenv("DISTRIB_FORK_SERVER_IDLE_SECONDS", "60")
    assert launch("--workers", "1", str(script), "0", timeout=120)[0] == 0
    (second,) = _pids(servers)
    os.killpg(second, signal.SIGKILL)  # dead, its socket file left behind
    deadline = time.monotonic() + 10
    while alive({second}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(servers.glob("*.sock"))
    code, log, _ = launch("--workers", "1", str(script), "0", timeout=120)
    assert code == 0, log
    (third,) = _pids(servers)
    assert third != second and alive({third})


def test_a_directory_whose_socket_path_is_too_long_is_an_error_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(OSError, match="too long for a Unix socket path"):
        shared_forkserver.connect(str(tmp_path / ("d" * 120)), {})
    monkeypatch.setenv(DIRECTORY_VARIABLE, str(tmp_path / ("d" * 120)))
    said: list[str] = []
    server = shared_forkserver.launch_server(dict(os.environ), said.append)  # the launch goes on, with its own
    assert server is not None and server.process is not None and not server.shared
    server.close()
    assert len(said) == 1 and "no shared fork server" in said[0] and "too long" in said[0], said


def test_a_server_that_cannot_start_is_an_error_at_once_naming_its_output(tmp_path: Path) -> None:
    """(the launch then starts a server of its own: shared_forkserver.launch_server)"""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('a planted broken torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="distrib-fs-"))  # a short path (see `servers`)
    try:
        with pytest.raises(OSError, match=r"did not listen .*exit code 1; its output: .*\.log"):
            shared_forkserver.connect(str(directory), env)
        assert time.monotonic() - started < 30  # not the whole START_TIMEOUT
        (log,) = directory.glob("*.log")
        text = log.read_text()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert "a planted broken torch" in text
