"""Start ``distrib launch``'s tasks by forking a process that has imported torch once (a fork server).

A fresh Python process that trains spends about 2 CPU-seconds before its first line of work: ``import torch``
(about 1.1 s) and, at the first optimizer built, ``import torch._dynamo`` (about 1 s: torch's
``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``, which imports it). A launch of 4 workers
on a 2-core laptop pays that 4 times over, and every restart pays it again. The fork server pays it once: the
launcher starts one ``python -m distrib.cluster.forkserver`` that imports torch, ``torch._dynamo`` and
distrib, then forks each task from it, as :mod:`multiprocessing`'s ``forkserver`` with
``set_forkserver_preload`` does, and runs the task's script as ``python script.py`` would (in a new
``__main__`` module kept until the interpreter's exit, the task's ``sys.argv``, ``sys.path[0]``, environment and working directory).

What a forked task shares with the others, where a fresh process would differ: Python's hash seed (string and
set ordering, unless ``PYTHONHASHSEED`` is set: the same on every task, which only helps collectives agree), and
the modules already imported. NumPy's and torch's default generators are reseeded in each task from the OS, as a
fresh import does (torch 2.13 seeds its default generator at random in each process); Python's ``random`` is
reseeded by CPython's own fork handler. The server's objects are frozen before each fork (:func:`gc.freeze`,
the recipe its documentation gives for forking without exec): a task's collections skip them, so they neither
copy the pages the tasks share nor cost the task's exit about 0.6 CPU-seconds of collections over torch's
millions of objects (``gc.get_freeze_count()`` is not 0 in a forked task).

A task's exit code is its script's: 0, ``sys.exit(n)``'s ``n``, 1 with the traceback for an uncaught
exception (from the script's first frame, as Python prints it), and killed by a signal, ``-signal``. Its
``atexit`` handlers run. The server is single-threaded (a fork from a threaded process can inherit a lock
another thread held) and exits when the launcher closes its socket, or dies.

Only plain ``python SCRIPT ...`` and ``python -m MODULE ...`` commands are forked, and only tasks whose
variables read at import (:data:`IMPORT_TIME_VARIABLES`, and torch's own, :data:`IMPORT_TIME_PREFIXES`) equal the
server's; any other command starts a fresh process.

The server is opt-in: ``distrib launch --start-method forkserver`` (``DISTRIB_START_METHOD=forkserver``). By
default every task is a fresh ``python SCRIPT ...``, since a forked task differs from one in ways a script can
notice: torch is imported before the script runs, so an import-time variable that the script sets in
``os.environ`` before ``import torch`` (``TORCHDYNAMO_VERBOSE=1``, ``OMP_NUM_THREADS``) has no effect;
``/proc/PID/cmdline``, ``ps`` and ``sys.orig_argv`` show ``python -m distrib.cluster.forkserver``, not the script
(``pkill -f train.py``, py-spy, a restart through ``os.execv(sys.executable, sys.orig_argv)``); stdin is
``/dev/null``.
"""

from __future__ import annotations

import builtins
import ctypes
import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = [
    "IMPORT_TIME_PREFIXES",
    "IMPORT_TIME_VARIABLES",
    "ForkServer",
    "ForkedProcess",
    "become_subreaper",
    "forkable",
    "import_environment",
    "is_import_time",
    "reap_orphans",
    "reap_children",
]

#: variables that a process reads when it starts or imports torch (thread pools, allocators, Python itself): a
#: task whose values differ from the server's is started fresh, since the server already read its own
IMPORT_TIME_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "KMP_AFFINITY",
    "GOMP_CPU_AFFINITY",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONHOME",
    "PYTHONWARNINGS",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONMALLOC",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_LOGS",
    # glibc's allocator reads these when the process starts: a task forked from a server started without them keeps
    # the server's allocator (tests/strategies/test_sharded_memory.py sets MALLOC_MMAP_THRESHOLD_ for its limit)
    "MALLOC_ARENA_MAX",
    "MALLOC_ARENA_TEST",
    "MALLOC_CHECK_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_PERTURB_",
    "MALLOC_TOP_PAD_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)
#: and every variable whose name starts with one of these: torch's configuration modules (``torch._dynamo.config``,
#: ``torch._inductor.config``, ``torch._functorch.config``), which the server imports (``torch._dynamo``), read their
#: ``TORCHINDUCTOR_*``, ``TORCHDYNAMO_*``, ``TORCH_COMPILE_*`` and ``AOT_INDUCTOR_*`` variables once, at import: a
#: task forked from a server started without ``TORCHINDUCTOR_COMPILE_THREADS=1`` would silently keep the server's
#: value. ``TORCH`` covers torch's own prefixes (a task with a ``TORCHELASTIC_*`` or ``TORCH_NCCL_*`` of its own
#: starts fresh or gets a server of its own: slower, never wrong)
IMPORT_TIME_PREFIXES = ("TORCH", "INDUCTOR_", "AOT_INDUCTOR_", "AOT_PARTITIONER_", "PARTITIONER_")
#: what the server imports before its first fork: what nearly every training task imports first
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "distrib")
_MESSAGE = 1 << 20
_PR_SET_CHILD_SUBREAPER = 36
#: how much of a script :func:`forkable` reads for the words torch and distrib
_SCRIPT_SCAN = 1 << 20


def forkable(argv: Sequence[str], cwd: str | None = None) -> bool:
    """Whether ``argv``, run in ``cwd`` (None: this process's), is ``[sys.executable, script, ...]`` or
    ``[sys.executable, "-m", module, ...]``: a command the server can run by forking (interpreter options, another
    interpreter or a program start fresh), and whether forking it pays: a script whose text names neither torch nor distrib (a shell-like helper) starts fresh, as
    it would not use what the server imported (that costs the server's start, about 2 CPU-seconds, for nothing)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    if argv[1].startswith("-"):
        return False
    try:
        with open(os.path.join(cwd or "", argv[1]), "rb") as f:  # (an absolute script ignores cwd)
            text = f.read(_SCRIPT_SCAN)
    except OSError:
        return False  # python reports the missing script as it always does
    return b"torch" in text or b"distrib" in text


def is_import_time(name: str) -> bool:
    """Whether a process reads the variable ``name`` when it starts or imports what the server imported."""
    return name in IMPORT_TIME_VARIABLES or name.startswith(IMPORT_TIME_PREFIXES)


def import_environment(env: Mapping[str, str]) -> dict[str, str | None]:
    """The values of :data:`IMPORT_TIME_VARIABLES` in ``env`` (None where unset), and those of every variable of
    ``env`` named with one of :data:`IMPORT_TIME_PREFIXES`.

    >>> import_environment({"TORCHINDUCTOR_COMPILE_THREADS": "1", "TF_CONFIG": "{}"})["TORCHINDUCTOR_COMPILE_THREADS"]
    '1'
    """
    named: dict[str, str | None] = {name: None for name in IMPORT_TIME_VARIABLES}
    named.update({name: value for name, value in env.items() if is_import_time(name)})
    return named


class ForkedProcess:
    """A task forked by the server, with the part of :class:`subprocess.Popen`'s interface the launcher uses.

    From the launcher's own server it is the launcher's child (:func:`become_subreaper`), so its exit status is the
    launcher's to wait for. From a shared server (:mod:`distrib.cluster.shared_forkserver`) it is not: the process
    that forked it waits for it and writes its exit code into ``status``, a pipe whose other end it holds."""

    def __init__(self, pid: int, stdout: IO[bytes], status: int | None = None) -> None:
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self._status = status
        if status is not None:
            os.set_blocking(status, False)

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._status is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            else:
                self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        assert self._status is not None
        try:
            data = os.read(self._status, 64)
        except BlockingIOError:
            return  # still running
        os.close(self._status)
        self._status = None
        # no code: the process that waited for the task was killed (the task's status is lost with it)
        self.returncode = int(data) if data else -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def become_subreaper() -> None:
    """Make this process the parent of the orphans below it (Linux' ``PR_SET_CHILD_SUBREAPER``): the server forks
    each task through a child that exits at once, so the task is the launcher's child, as a fresh one would be
    (its exit status, ``process_tree``, a signal to the launcher's children). Raises OSError where it cannot."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"a fork server needs Linux' PR_SET_CHILD_SUBREAPER ({sys.platform})")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap_orphans(known: set[int]) -> None:
    """Reap the exited children that are not ``known`` tasks: a subreaper inherits its tasks' orphans (a loader
    process whose task was killed), which would stay zombies until the launcher exits. Stops at the first exited
    known task, which its own :meth:`ForkedProcess.poll` (or ``Popen.poll``) reaps."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in known:
            return
        os.waitpid(info.si_pid, 0)


class ForkServer:
    """The launcher's end: starts the server process once (or, given ``session``, uses a session of a shared server
    that :func:`distrib.cluster.shared_forkserver.connect` opened: the connection and its description), then asks it
    for each task.

    Making one with a server of its own makes the calling process a subreaper (:func:`become_subreaper`) for the
    rest of its life: the orphans of what it started become its children (reap them with :func:`reap_orphans`). A
    shared server's session does not: its tasks, and their orphans, stay the shared server's."""

    def __init__(self, env: Mapping[str, str], session: tuple[socket.socket, str] | None = None) -> None:
        if session is None:
            become_subreaper()
        self.env = dict(env)
        self._lock = threading.Lock()
        #: set when the server was found gone: every later task then starts fresh (:meth:`accepts` says no)
        self.gone = False
        #: the server process this launcher started and owns (None: a shared server's session)
        self.process: subprocess.Popen[bytes] | None = None
        #: a shared server's session: its tasks' exit codes come through a pipe each (see :class:`ForkedProcess`)
        self.shared = session is not None
        if session is not None:
            self._socket, self.description = session
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "distrib.cluster.forkserver", str(theirs.fileno())],
                env=self.env,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # the launcher's signals are for its tasks, not for the server
            )
        finally:
            theirs.close()
        self.description = f"the fork server (pid {self.process.pid})"

    @property
    def owned_pids(self) -> set[int]:
        """The launcher's children that are this server (not tasks: :func:`reap_orphans` leaves them)."""
        return {self.process.pid} if self.process is not None else set()

    def accepts(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a task of this command and environment can be forked from this server."""
        return not self.gone and forkable(argv) and import_environment(env) == import_environment(self.env)

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None) -> ForkedProcess:
        """Fork a task running ``argv`` (``python SCRIPT ...`` or ``python -m MODULE ...``) in ``env`` and ``cwd``
        (None: this process's), its stdout and stderr together in the returned process's ``stdout``. Raises
        RuntimeError if the server is gone (then :attr:`gone`) or could not fork."""
        read, write = os.pipe()
        status_read, status_write = os.pipe() if self.shared else (None, None)
        sent = [write] if status_write is None else [write, status_write]
        request = {"argv": list(argv[1:]), "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd())}
        try:
            with self._lock:
                try:
                    socket.send_fds(self._socket, [json.dumps(request).encode()], sent)
                    reply = self._socket.recv(_MESSAGE)
                except OSError:
                    reply = b""
            if not reply:
                self.gone = True
                ended = f": {self.process.poll()}" if self.process is not None else ""
                raise RuntimeError(f"{self.description} exited{ended}")
            message = json.loads(reply)
            if "error" in message:
                raise RuntimeError(f"{self.description} could not start {list(argv)}: {message['error']}")
        except BaseException:
            os.close(read)
            if status_read is not None:
                os.close(status_read)
            raise
        finally:
            for fd in sent:
                os.close(fd)  # the task (and its relay) hold them now: the task's exit is the output's end of file
        return ForkedProcess(int(message["started"]), os.fdopen(read, "rb"), status_read)

    def close(self) -> None:
        """Stop the server, or end the session of a shared one (tasks it started go on: the launcher stops them)."""
        self._socket.close()
        if self.process is None:
            return
        try:
            # a server still importing torch sees the closed socket only when its imports end: on a loaded 2-core
            # machine that took over 10 s (it was killed, and its exit code read as a failure)
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# --------------------------------------------------------------------------------------------------- the server side
def serve(connection: socket.socket) -> None:
    """Import :data:`PRELOAD`, then fork a task for each request until the launcher closes the connection.

    A forked task leaves this function by its script's ``SystemExit``, which unwinds to the interpreter's own exit
    (``atexit``, thread joins, finalisation, as after ``python script.py``): nothing on its way may catch it."""
    preload()
    serve_requests(connection)


def preload() -> None:
    """Import :data:`PRELOAD` as a server does: the collector off, so that none leaves holes in the pages the tasks
    will share (gc.freeze's documented recipe), then one collection of the imports' own garbage."""
    import importlib

    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # a forked child could not use CUDA: the launcher then starts tasks fresh
        raise SystemExit("distrib fork server: CUDA was initialised while importing; not forking tasks from it")


def serve_requests(connection: socket.socket) -> None:
    """Fork a task for each request on ``connection`` until the launcher closes it. A request carries the task's
    output pipe, and, from a shared server's session, a second pipe for its exit code (see :class:`ForkedProcess`)."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(connection, _MESSAGE, 2)
        except OSError:
            return
        if not data:
            return
        reply: dict[str, int | str]
        # what the server built is never garbage to a task: frozen, no collection of a task walks it. Its exit then
        # costs about 0.1 CPU-s instead of 0.6 (its interpreter's last collections over torch's millions of objects),
        # and its collections touch none of the pages it shares with the server
        gc.freeze()
        try:
            status = fds[1] if len(fds) > 1 else None
            reply = {"started": _fork_task(connection, json.loads(data), fds[0], status)}
        except (OSError, IndexError) as e:
            reply = {"error": str(e) or type(e).__name__}
        for fd in fds:
            os.close(fd)
        connection.send(json.dumps(reply).encode())
        reap_children()


def reap_children() -> set[int]:
    """Reap this process's exited children (a shared session's relays once their tasks ended, a shared server's
    sessions); their pids."""
    done: set[int] = set()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if not pid:
            return done
        done.add(pid)


def _fork_task(connection: socket.socket, request: dict[str, Any], output: int, status: int | None = None) -> int:
    """Fork twice. Without ``status`` the middle process exits at once, so the task is reparented to the launcher
    (the subreaper). With it (a shared server's task) the middle process stays the task's parent: it waits for the
    task and writes its exit code into ``status``."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        task = -1
        try:
            os.close(read)
            connection.close()
            task = os.fork()
        except BaseException:
            os._exit(1)
        if task == 0:
            gc.enable()
            os.close(write)
            if status is not None:
                os.close(status)
            _become_task(request, output)  # raises the task's SystemExit, up to the interpreter's exit
        os.write(write, str(task).encode())
        if status is None:
            os._exit(0)
        os.close(write)
        os.close(output)  # the task holds it: its exit is the end of the launcher's output
        _relay_exit_code(task, status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        pid = pipe.read()
    if status is None:
        os.waitpid(middle, 0)  # once reaped, the task's parent is the launcher
    if not pid:
        raise OSError("the task's fork failed")
    return int(pid)


def _relay_exit_code(task: int, status: int) -> None:
    """In the middle process of a shared server's task: wait for it, write its exit code, end."""
    code = -signal.SIGKILL
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher's terminal is not ours
        _, raw = os.waitpid(task, 0)
        code = os.waitstatus_to_exitcode(raw)
        os.write(status, str(code).encode())
    finally:
        os._exit(0)


def _become_task(request: dict[str, Any], output: int) -> None:
    """In the forked child: take the task's output, environment and place, then run it as ``python`` would."""
    try:
        _take_place(request, output)
    except BaseException:  # never back into the server's loop
        traceback.print_exc()
        os._exit(1)
    try:
        _run_as_main(request["argv"])
    except SystemExit:
        raise
    except KeyboardInterrupt:  # as Python does: the traceback, then death by SIGINT
        _print_from_task(sys.exc_info())
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(130) from None
    except BaseException:
        _print_from_task(sys.exc_info())
        raise SystemExit(1) from None
    raise SystemExit(0)


def _run_as_main(argv: Sequence[str]) -> None:
    """Run ``SCRIPT ...`` or ``-m MODULE ...`` in a new ``sys.modules["__main__"]``, as ``python`` does.

    Not :func:`runpy.run_path`: its module lives only while the script runs, so the script's globals die as it
    returns, while other threads still run and can take the GIL. ``python script.py`` keeps them until the
    interpreter's exit, whose threads can no longer take the GIL. A DDP model freed that early deadlocks: the
    Reducer's destructor, holding the GIL, joins gloo's worker thread, which waits for the GIL to free its last
    work (8 of 105 launches of tests/scripts/torchrun_ddp.py; 0 of 75 since)."""
    main = types.ModuleType("__main__")
    if argv[0] == "-m":
        spec = importlib.util.find_spec(argv[1])
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(f"{argv[1]}.__main__")
        if spec is None or spec.loader is None or spec.origin is None:
            print(f"{sys.executable}: No module named {argv[1]}", file=sys.stderr)
            raise SystemExit(1)
        code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]
        path = sys.argv[0] = spec.origin
        main.__dict__.update(__spec__=spec, __loader__=spec.loader, __package__=spec.parent, __cached__=spec.cached)
    else:
        path = os.path.abspath(argv[0])  # as __main__.__file__ is since Python 3.9
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)  # not this module's __future__ imports
        main.__dict__.update(__spec__=None, __package__=None, __cached__=None)
    main.__dict__.update(__file__=path, __builtins__=builtins)
    sys.modules["__main__"] = main  # till the interpreter's exit, as python keeps it
    exec(code, main.__dict__)


def _take_place(request: dict[str, Any], output: int) -> None:
    """The task's session, output, environment, working directory, generators, ``sys.argv`` and ``sys.path[0]``."""
    os.setsid()  # its own process group, as the launcher starts fresh tasks: a signal to the group reaches it all
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # a fresh import seeds these from the OS: so must each task, not share the server's generators
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    argv = request["argv"]
    module = argv[1] if argv[0] == "-m" else None
    sys.argv = [argv[1], *argv[2:]] if module else list(argv)
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(argv[0]))


def _print_from_task(info: Any) -> None:
    """The traceback as ``python script.py`` prints it: from the script's frame, not the server's."""
    kind, value, tb = info
    while tb is not None and tb.tb_frame.f_code.co_filename == os.path.abspath(__file__):
        tb = tb.tb_next
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))  # a task leaves by its SystemExit, from inside
    os._exit(0)  # the server: no user code to finish, and a torch interpreter's teardown costs about 0.6 CPU-s
