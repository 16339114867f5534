"""``distrib launch``'s fork server (:mod:`distrib.cluster.forkserver`): a forked task sees what a fresh ``python``
would (argv, ``__name__``, ``__file__``, ``sys.path[0]``, its environment, its own generators' seeds, exit codes,
tracebacks, ``atexit``), costs less CPU to start, and nothing it or the server started outlives the launcher."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import alive, launch, process_tree, run_bounded, start_launch

from distrib.cluster.forkserver import ForkServer, forkable

# these look at the launcher's own process tree: its own fork server (tests/conftest.py), not the session's shared one
pytestmark = pytest.mark.usefixtures("own_fork_server")

PROBE = textwrap.dedent(
    """
    import atexit, gc, json, os, random, sys
    frozen = gc.get_freeze_count() > 0  # the server's objects, which no collection of a forked task walks
    preloaded = "torch._dynamo" in sys.modules  # imported by the fork server, not by this script
    import numpy, torch
    out = sys.argv[1]
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    m = torch.nn.Linear(2, 2)
    torch.optim.Adam(m.parameters())  # torch imports torch._dynamo here: the server already did
    seen = {
        "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
        "task": task, "restart": os.environ["DISTRIB_RESTART"], "torch_seed": torch.initial_seed(),
        "numpy": float(numpy.random.rand()), "random": random.random(), "sid": os.getsid(0) == os.getpid(),
        "preloaded": preloaded, "frozen": frozen, "gc": gc.isenabled(),
    }
    atexit.register(os.mknod, f"{out}/atexit{task}")  # no lambda: it would hold the script's globals
    ran = []
    atexit.register(ran.append, True)
    from witness import Witness  # python frees the script's globals at its exit, after atexit (a DDP model
    witness = Witness(f"{out}/freed{task}", ran)  # freed sooner can deadlock): this one says when
    with open(f"{out}/seen{task}.json", "w") as f:
        json.dump(seen, f)
    if task == 1 and len(sys.argv) > 2:
        def fails():
            raise ValueError("the task's own error")
        fails()
    """
)

# in a module of its own: a class defined in the script would tie its instance to the script's globals in a cycle,
# which only the garbage collector frees, whenever the script's globals die
WITNESS = textwrap.dedent(
    """
    class Witness:
        def __init__(self, path, ran):
            self.path, self.ran, self.open = path, ran, open  # builtins are gone by the interpreter's exit
        def __del__(self):
            with self.open(self.path, "w") as f:
                f.write("after atexit" if self.ran else "before atexit")
    """
)


def _probe(tmp_path: Path, method: str, *extra: str) -> tuple[int, str, list[dict]]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "witness.py").write_text(WITNESS)
    out = tmp_path / method
    out.mkdir()
    code, log, _ = launch("--workers", "2", "--start-method", method, str(script), str(out), *extra, timeout=120)
    return code, log, [json.loads((out / f"seen{i}.json").read_text()) for i in range(2)]


def test_a_forked_task_sees_what_a_fresh_python_sees_and_finds_torch_imported(tmp_path: Path) -> None:
    code, log, forked = _probe(tmp_path, "forkserver")
    assert code == 0, log
    code, log, fresh = _probe(tmp_path, "spawn")
    assert code == 0, log
    for f, s in zip(forked, fresh):
        for key in ("name", "file", "path0", "cwd", "task", "restart", "sid"):
            assert f[key] == s[key], key
        assert f["argv"][0] == s["argv"][0] and f["argv"][1:] != s["argv"][1:]  # each its own output folder
        assert f["name"] == "__main__" and f["path0"] == str(tmp_path) and f["sid"]
    for seen in (forked, fresh):  # each task's generators are its own, as in fresh processes
        for key in ("torch_seed", "numpy", "random"):
            assert seen[0][key] != seen[1][key], key
    for method in ("forkserver", "spawn"):
        assert all((tmp_path / method / f"atexit{i}").exists() for i in range(2)), method
        freed = [(tmp_path / method / f"freed{i}").read_text() for i in range(2)]
        assert freed == ["after atexit"] * 2, (method, freed)
    # a forked task found torch._dynamo imported (by the server: what it saves); a fresh one imports it itself
    assert [s["preloaded"] for s in forked] == [True, True] and [s["preloaded"] for s in fresh] == [False, False]
    # the server's objects are frozen (gc.freeze): a task's collections, and its exit's, skip them
    assert [s["frozen"] for s in forked] == [True, True] and [s["frozen"] for s in fresh] == [False, False]
    assert all(s["gc"] for s in forked + fresh)  # collections run in a task, as in any python


def test_a_forked_task_s_exception_prints_the_script_s_traceback_and_exits_1(tmp_path: Path) -> None:
    code, log, _ = _probe(tmp_path, "forkserver", "fail")
    assert code == 1 and "worker 1 failed with exit code 1" in log, log
    lines = [line for line in log.splitlines() if line.startswith("[worker 1]")]
    start = lines.index("[worker 1] Traceback (most recent call last):")
    assert f'File "{tmp_path / "probe.py"}"' in lines[start + 1], lines  # the script's frame first: no runpy
    assert "[worker 1] ValueError: the task's own error" in lines[start:], lines
    assert (tmp_path / "forkserver" / "atexit1").exists()  # atexit handlers ran, as Python runs them on an error


MODULE_PROBE = textwrap.dedent(
    """
    import json, os, sys, torch
    spec = __spec__
    seen = {"argv": sys.argv[:1], "name": __name__, "file": __file__, "package": __package__, "spec": spec.name,
            "path0": sys.path[0], "annotations": "annotations" in globals()}
    with open(os.path.join(sys.argv[1], f"{spec.name}.json"), "w") as f:
        json.dump(seen, f)
    """
)


def test_a_forked_module_sees_what_python_m_sees(tmp_path: Path) -> None:
    """``-m pkg.mod`` and ``-m pkg`` (its ``__main__``): the same ``__name__``, ``__file__``, ``__spec__``,
    ``__package__``, ``sys.argv[0]`` and ``sys.path[0]`` forked as fresh, and no ``__future__`` of the server's."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(MODULE_PROBE)
    (package / "__main__.py").write_text(MODULE_PROBE)
    seen: dict[str, dict] = {}
    for method in ("forkserver", "spawn"):
        out = tmp_path / method
        out.mkdir()
        for module in ("pkg.mod", "pkg"):
            code, log, _ = run_bounded(
                [sys.executable, "-m", "distrib.app.cli", "launch", "--start-method", method, "-m", module, str(out)],
                timeout=60,
                cwd=tmp_path,
            )
            assert code == 0, log
        seen[method] = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert seen["forkserver"] == seen["spawn"] and len(seen["spawn"]) == 2, seen
    mod = seen["spawn"]["pkg.mod.json"]
    assert mod["name"] == "__main__" and mod["file"] == str(package / "mod.py") == mod["argv"][0], mod
    assert mod["package"] == "pkg" and not mod["annotations"], mod


def test_exit_codes_signals_and_nothing_left_behind(tmp_path: Path) -> None:
    script = tmp_path / "codes.py"
    script.write_text(
        "import json, os, signal, sys, time, torch\n"  # torch: the server forks it
        "t = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "if t == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    code, log, _ = launch("--workers", "2", "--start-method", "forkserver", str(script), timeout=60)
    assert code == 128 + 9 and "worker 0 failed with exit code 137" in log, log
    script.write_text("import sys, torch; sys.exit(5)\n")
    assert launch("--workers", "1", "--start-method", "forkserver", str(script), timeout=60)[0] == 5


def test_the_server_ends_with_the_launcher_and_every_task_with_it(tmp_path: Path) -> None:
    """The launcher killed (SIGKILL: nothing of it runs): the server sees its socket close and exits; the tasks,
    each in its own session as fresh tasks are, are the launcher's to stop, here the test's."""
    import time

    script = tmp_path / "sleep.py"
    script.write_text("import time, torch; print('up', flush=True); time.sleep(60)\n")
    proc = start_launch("--workers", "2", "--start-method", "forkserver", str(script))
    try:
        assert proc.stdout is not None
        ups = 0
        while ups < 2:
            line = proc.stdout.readline()
            assert line, "the launcher ended early"
            ups += "up" in line
        tree = process_tree(proc.pid)
        # the server and the tasks are all the launcher's children (a task is forked through a middle process that
        # exits, and the launcher is a subreaper); the server started first. Each shows the server's command line,
        # as the children of Python's own forkserver do
        assert all(_stat(p)[1] == proc.pid for p in tree) and len(tree) == 3, tree
        servers = {min(tree, key=lambda p: _stat(p)[19])}
        tasks = tree - servers
        os.kill(proc.pid, 9)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(servers)
    finally:
        for pid in alive(process_tree(proc.pid) | locals().get("tasks", set())):
            os.killpg(pid, 9) if os.getpgid(pid) == pid else os.kill(pid, 9)


def _stat(pid: int) -> list[int | str]:
    """/proc/PID/stat's fields after the command: [state, parent, ..., start time at 19]."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return [fields[0], *map(int, fields[1:])]


def test_what_is_forked_and_what_starts_fresh(tmp_path: Path) -> None:
    py = sys.executable
    train, helper = tmp_path / "train.py", tmp_path / "helper.py"
    train.write_text("import distrib as ds\n")
    helper.write_text("import json, sys\nsys.exit(3)\n")  # nothing the server imported: a fresh start is cheaper
    assert forkable([py, str(train), "--x"]) and forkable([py, "-m", "pkg.mod"])
    assert not forkable([py, str(helper)]) and not forkable([py, str(tmp_path / "missing.py")])
    assert not forkable([py, "-u", str(train)]) and not forkable(["/bin/echo", "x"]) and not forkable([py, "-m"])
    # a relative script is read where the command will run
    assert forkable([py, train.name], str(train.parent)) and not forkable([py, train.name], "/")
    train = train.with_name("t.py")
    train.write_text("import torch\n")
    server = ForkServer({**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert server.accepts([py, str(train)], {"OMP_NUM_THREADS": "1", "TF_CONFIG": "{}"} | _same_imports())
        assert not server.accepts([py, str(train)], {**os.environ, "OMP_NUM_THREADS": "2"})
        same = {"OMP_NUM_THREADS": "1"} | _same_imports()
        assert not server.accepts([py, str(train)], same | {"TORCHINDUCTOR_COMPILE_THREADS": "3"})  # torch's config
    finally:
        server.close()
    assert server.process.returncode == 0


def test_once_the_server_is_gone_every_later_task_starts_fresh(tmp_path: Path) -> None:
    """A server that died (killed, out of memory) fails the task it was asked for, which the launcher then starts
    fresh, and accepts no later one: each of those would fail the same way."""
    script = tmp_path / "t.py"
    script.write_text("import torch\n")
    argv, env = [sys.executable, str(script)], dict(os.environ)
    server = ForkServer(env)
    try:
        server.process.kill()
        server.process.wait(timeout=10)
        assert server.accepts(argv, env) and not server.gone
        with pytest.raises(RuntimeError, match="exited"):
            server.start(argv, env)
        assert server.gone and not server.accepts(argv, env)
    finally:
        server.close()


def _same_imports() -> dict[str, str]:
    from distrib.cluster.forkserver import import_environment

    return {k: v for k, v in import_environment(os.environ).items() if v is not None and k != "OMP_NUM_THREADS"}


def test_a_start_method_that_does_not_exist_is_an_error_naming_the_choices(tmp_path: Path) -> None:
    code, out, _ = run_bounded(
        [sys.executable, "-m", "distrib.app.cli", "launch", "--start-method", "thread", "x.py"], timeout=30
    )
    assert code == 2 and "forkserver" in out and "spawn" in out
    from distrib.cluster.launch import LaunchConfig

    with pytest.raises(ValueError, match="use one of spawn, forkserver"):
        LaunchConfig(command=["x.py"], start_method="thread")
