"""tests/helpers.py's ``run_bounded``: a torch script is forked from the session's shared fork server, and what
the test sees is what a fresh ``python`` run gives (exit code, output, working directory, environment, the bound)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from helpers import alive, run_bounded

from distrib.cluster.shared_forkserver import DIRECTORY_VARIABLE

SCRIPT = """
import gc, os, sys, time
import torch  # (the word makes the script forkable: it uses torch)
print("frozen", gc.get_freeze_count() > 0, "cwd", os.getcwd(), "argv", sys.argv, "var", os.environ.get("PROBE_VAR"))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["hang"]:
    print("pid", os.getpid(), flush=True)
    time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_a_torch_script_is_forked_and_gives_what_a_fresh_python_gives(script, tmp_path):
    if not os.environ.get(DIRECTORY_VARIABLE):
        pytest.skip("the session runs without shared fork servers (DISTRIB_TEST_OWN_FORK_SERVERS=1)")
    env = {**os.environ, "PROBE_VAR": "x1"}
    forked = run_bounded([sys.executable, "probe.py", "7"], cwd=tmp_path, env=env)
    fresh = run_bounded([sys.executable, "probe.py", "7"], cwd=tmp_path, env=env, fresh=True)
    for code, out, _ in (forked, fresh):
        assert code == 7, out
        assert f"cwd {tmp_path} argv ['probe.py', '7'] var x1" in out and "to stderr" in out, out
    assert "frozen True" in forked[1] and "frozen False" in fresh[1]  # forked from a server, and not
    code, out, _ = run_bounded([sys.executable, str(script)])
    assert code == 0 and "frozen True" in out, out


def test_a_forked_script_that_overruns_is_killed_and_the_test_fails(script):
    with pytest.raises(pytest.fail.Exception, match="did not finish in 3s") as failed:
        run_bounded([sys.executable, str(script), "hang"], timeout=3)
    pid = int(str(failed.value).split("pid ")[1].split()[0])  # the script printed its pid before it hung
    _gone_within(pid, 10)


def _gone_within(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while alive({pid}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive({pid})


def test_a_forked_script_leaves_nothing_running(script, tmp_path):
    child = tmp_path / "child.py"
    child.write_text(
        "import subprocess, sys, torch\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print('child', p.pid, flush=True)\n"
    )
    code, out, _ = run_bounded([sys.executable, str(child)], timeout=60)
    assert code == 0, out
    _gone_within(int(out.split("child ")[1].split()[0]), 10)  # its process group was killed when it ended


def test_a_server_that_cannot_fork_the_script_leaves_it_to_a_fresh_python(script, monkeypatch):
    import helpers

    class Gone:
        closed = False

        def start(self, *args: object) -> None:
            raise RuntimeError("the shared fork server exited")

        def close(self) -> None:
            Gone.closed = True

    monkeypatch.setattr(helpers, "_session_server", lambda *args: Gone())
    code, out, _ = run_bounded([sys.executable, str(script), "3"])
    assert code == 3 and "frozen False" in out and Gone.closed, out
