"""How ``distrib launch`` starts its tasks: by default each a fresh ``python SCRIPT ARGS`` (as torchrun does), so
a variable torch reads at import that the script sets before ``import torch`` takes effect, and ``ps``,
``/proc/PID/cmdline`` and ``sys.orig_argv`` name the script; ``--start-method forkserver`` forks them from a
process that imported torch already, with the differences its help lists."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distrib.cluster.launch import LaunchConfig

# the tests here are about the start method a user gets, not the fork server this session's launches use
pytestmark = pytest.mark.usefixtures("default_start_method")

PROBE = textwrap.dedent(
    """
    import os
    os.environ["TORCHDYNAMO_VERBOSE"] = "1"  # read once, when torch._dynamo is imported
    os.environ["OMP_NUM_THREADS"] = "1"  # read once, when torch is imported (the launch says 2)
    import json, sys, time
    import torch, torch._dynamo
    out = sys.argv[1]
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    seen = {"verbose": torch._dynamo.config.verbose, "threads": torch.get_num_threads(),
            "orig_argv": sys.orig_argv, "pid": os.getpid()}
    with open(os.path.join(out, f"seen{task}.json"), "w") as f:
        json.dump(seen, f)
    print("ready", os.getpid(), flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def _launch_and_look(tmp_path: Path, name: str, *options: str) -> tuple[list[dict], list[list[str]], list[str], str]:
    """Launch 2 workers of the probe (stdin a pipe); while they run, read each task's ``/proc/PID/cmdline`` and
    where its stdin leads. Returns what each task saw, the command lines, the stdins, and the launcher's stdin."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / name
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrib.app.cli", "launch", "--workers", "2", *options, str(script), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        pids = []
        deadline = time.monotonic() + 90
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            if "] ready " in line:
                pids.append(int(line.split()[-1]))
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1] for pid in pids]
        stdins = [os.readlink(f"/proc/{pid}/fd/0") for pid in pids]
        launcher_stdin = os.readlink(f"/proc/{proc.pid}/fd/0")
        (out / "go").touch()
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest)
        assert proc.returncode == 0, "".join(lines)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    seen = [json.loads((out / f"seen{i}.json").read_text()) for i in range(2)]
    order = {s["pid"]: s for s in seen}
    return [order[pid] for pid in pids], cmdlines, stdins, launcher_stdin


def test_the_default_start_is_spawn_and_forkserver_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    assert LaunchConfig(command=["train.py"]).start_method == "spawn"
    monkeypatch.setenv("DISTRIB_START_METHOD", "forkserver")
    assert LaunchConfig(command=["train.py"]).start_method == "forkserver"


def test_by_default_each_task_is_python_script_and_honours_what_the_script_sets_before_importing_torch(
    tmp_path: Path,
) -> None:
    seen, cmdlines, stdins, launcher_stdin = _launch_and_look(tmp_path, "default")
    script = str(tmp_path / "probe.py")
    print(f"default start: verbose {[s['verbose'] for s in seen]}, threads {[s['threads'] for s in seen]}")
    print(f"default start: /proc/PID/cmdline {cmdlines}; stdin {stdins} (the launcher's: {launcher_stdin})")
    assert [s["verbose"] for s in seen] == [True, True], seen  # TORCHDYNAMO_VERBOSE=1, set by the script
    assert [s["threads"] for s in seen] == [1, 1], seen  # OMP_NUM_THREADS=1 over the launch's 2
    out = str(tmp_path / "default")
    for cmdline, s in zip(cmdlines, seen):
        assert cmdline == [sys.executable, script, out], cmdline  # what ps, pkill -f and py-spy read
        assert s["orig_argv"] == cmdline, s  # os.execv(sys.executable, sys.orig_argv) restarts the script
    assert stdins == [launcher_stdin] * 2 and launcher_stdin.startswith("pipe:"), (stdins, launcher_stdin)


def test_the_fork_server_differs_as_its_help_says(tmp_path: Path) -> None:
    """What ``--start-method forkserver``'s help and docs/multi-node.md list: torch was imported before the script
    ran (what it sets for torch's import has no effect), the server's command line, stdin ``/dev/null``."""
    seen, cmdlines, stdins, _ = _launch_and_look(tmp_path, "forkserver", "--start-method", "forkserver")
    print(f"fork server: verbose {[s['verbose'] for s in seen]}, threads {[s['threads'] for s in seen]}")
    print(f"fork server: /proc/PID/cmdline {cmdlines}; stdin {stdins}")
    assert [s["verbose"] for s in seen] == [False, False] and [s["threads"] for s in seen] == [2, 2], seen
    for cmdline, s in zip(cmdlines, seen):
        assert cmdline[:3] == [sys.executable, "-m", "distrib.cluster.forkserver"], cmdline
        assert s["orig_argv"] == cmdline, s
    assert stdins == [os.devnull] * 2, stdins


def test_a_shared_fork_server_directory_under_spawn_is_named_not_ignored_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import launch

    monkeypatch.setenv("DISTRIB_FORK_SERVER_DIR", str(tmp_path / "servers"))
    script = tmp_path / "t.py"
    script.write_text("import torch\n")
    code, out, _ = launch("--workers", "1", str(script), timeout=60)
    assert code == 0, out
    assert "DISTRIB_FORK_SERVER_DIR is set, but the tasks start as fresh processes" in out, out
    assert "--start-method forkserver" in out, out
    assert not (tmp_path / "servers").exists()  # no server was started there
