"""One fork server shared by the launches of a directory: ``DISTRIB_FORK_SERVER_DIR`` (opt-in).

Each ``distrib launch`` starts a fork server of its own (:mod:`distrib.cluster.forkserver`): about 2 CPU-seconds
of ``import torch`` before its first task. Many short launches in a row (a sweep, a CI job, a test suite) pay that
every time. With ``DISTRIB_FORK_SERVER_DIR=DIR`` set, a launch looks in ``DIR`` for a running server made for its
import environment (:func:`server_key`: the Python, the import-time variables, the torch and distrib it would
import, distrib's sources as they are now) and asks it for a session instead; the first launch starts one. A
session is a fork of the server (nothing to import) that serves that launch as its own server would.

What differs from a launch's own server:

* a task is not the launcher's child: the process that forked it waits for it and writes its exit code into a
  pipe the launcher reads (:class:`~distrib.cluster.forkserver.ForkedProcess`); signals still go to the task's
  process group;
* the server outlives the launch: it exits after :data:`IDLE_SECONDS` (``DISTRIB_FORK_SERVER_IDLE_SECONDS``)
  without a session, or when stopped (:func:`stop_servers`, ``python -m distrib.cluster.shared_forkserver --stop
  DIR``). Its environment is the launcher's, without the launch's own variables (a cluster token, ``TF_CONFIG``);
* edited distrib sources make another key, so a launch never forks from a server that imported older code.

``DIR`` is created private to the user (0700): whoever can connect to a server can run code as its user.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from distrib.cluster.forkserver import (
    _MESSAGE,
    ForkServer,
    become_subreaper,
    import_environment,
    is_import_time,
    preload,
    reap_children,
    serve_requests,
)

__all__ = ["DIRECTORY_VARIABLE", "IDLE_SECONDS", "connect", "launch_server", "server_key", "session", "stop_servers"]

#: the variable that names the directory of shared servers (unset: each launch has its own server)
DIRECTORY_VARIABLE = "DISTRIB_FORK_SERVER_DIR"
#: how long a server waits without a session before it exits (``DISTRIB_FORK_SERVER_IDLE_SECONDS``)
IDLE_SECONDS = 60.0
#: how long a launch waits for a server it started to listen
START_TIMEOUT = 60.0
#: the variables of one launch that a shared server's environment leaves out (it serves many launches)
LAUNCH_VARIABLES = ("DISTRIB_CLUSTER_TOKEN", "TF_CONFIG", "DISTRIB_TLS_CERT", "DISTRIB_TLS_KEY", "DISTRIB_TLS_CA")


def server_key(env: Mapping[str, str]) -> str:
    """What a server must share with a launch to fork its tasks: 16 hex digits of a digest of the Python, the
    import-time variables, torch's version and distrib's sources (their paths, sizes and modification times)."""
    import importlib.metadata

    import distrib  # (the launcher's: it imports no torch, nor does this)

    package = os.path.dirname(os.path.abspath(distrib.__file__))
    sources = []
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(files):
            if name.endswith(".py"):
                info = os.stat(os.path.join(folder, name))
                sources.append((os.path.relpath(os.path.join(folder, name), package), info.st_size, info.st_mtime_ns))
    described = json.dumps(
        [
            sys.executable,
            sorted(import_environment(env).items(), key=str),
            importlib.metadata.version("torch"),
            package,
            sources,
        ]
    )
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def connect(directory: str, env: Mapping[str, str]) -> tuple[socket.socket, dict[str, object]]:
    """A session of the server of ``directory`` made for ``env``'s import environment (started if there is none):
    the connection and the session's greeting (``server``: the server's pid, ``session``: the session's, and
    ``import_environment``). Raises OSError when none can be had."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    key = server_key(env)
    path = os.path.join(directory, f"{key}.sock")
    if len(path.encode()) > 100:
        raise OSError(f"{DIRECTORY_VARIABLE}={directory!r} is too long for a Unix socket path: use a shorter one")
    with open(os.path.join(directory, f"{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one launch starts the server; the others wait, then connect
        connection = _try_connect(path)
        if connection is None:
            server = _start(path, env)
            deadline = time.monotonic() + START_TIMEOUT
            while connection is None and time.monotonic() < deadline and server.poll() is None:
                time.sleep(0.05)
                connection = _try_connect(path)
            if connection is None:
                server.kill()
                log = path[: -len(".sock")] + ".log"
                raise OSError(
                    f"the shared fork server for {path} did not listen within {START_TIMEOUT:.0f} s "
                    f"(exit code {server.wait()}; its output: {log})"
                )
    try:
        greeting = json.loads(connection.recv(_MESSAGE) or b"null")
    except (OSError, ValueError) as e:
        connection.close()
        raise OSError(f"the shared fork server at {path} did not greet: {e}") from e
    if not isinstance(greeting, dict):
        connection.close()
        raise OSError(f"the shared fork server at {path} closed the connection")
    return connection, greeting


def session(directory: str, env: Mapping[str, str]) -> ForkServer:
    """A :class:`ForkServer` that asks a session of the shared server of ``directory`` (:func:`connect`) for tasks.
    Raises OSError when none can be had."""
    connection, greeting = connect(directory, env)
    return ForkServer(env, (connection, f"the shared fork server (pid {greeting['server']}) of {directory}"))


def launch_server(env: Mapping[str, str], say: Callable[[str], None]) -> ForkServer | None:
    """A launch's fork server: a session of the shared one of :data:`DIRECTORY_VARIABLE` where that is set, else one
    of its own; None where neither can be had (``say`` tells why, in the launcher's words)."""
    shared_dir = os.environ.get(DIRECTORY_VARIABLE)
    if shared_dir:
        try:
            return session(shared_dir, env)
        except OSError as e:
            say(f"no shared fork server in {shared_dir} ({e}): starting one for this launch")
    try:
        return ForkServer(env)
    except OSError as e:
        say(f"no fork server ({e}): every task starts as a fresh process")
        return None


def _try_connect(path: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):  # none yet, or a server gone without removing its socket
        connection.close()
        return None
    return connection


def _start(path: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start a server listening on ``path``, in a session of its own, with the launcher's environment and ``env``'s
    import-time variables (not a launch's own ones)."""
    server_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not is_import_time(k)}
    server_env.update({k: v for k, v in import_environment(env).items() if v is not None})
    idle = os.environ.get("DISTRIB_FORK_SERVER_IDLE_SECONDS", str(IDLE_SECONDS))
    with open(path[: -len(".sock")] + ".log", "ab") as log:  # not the launcher's output: a pipe would wait for it
        return subprocess.Popen(
            [sys.executable, "-m", "distrib.cluster.shared_forkserver", path, "--idle-seconds", idle],
            env=server_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # no launch's signals reach it
        )


def stop_servers(directory: str, timeout: float = 10.0) -> int:
    """Stop every server of ``directory`` (their sessions too: a launch still using one sees its tasks' exit codes
    lost); returns how many were running."""
    stopped = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if not name.endswith(".pid"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                pid = int(f.read())
            os.killpg(pid, signal.SIGTERM)
            stopped.append(pid)
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + timeout
    for pid in stopped:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    return len(stopped)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # our own child (the launch that started it): a zombie is gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


# --------------------------------------------------------------------------------------------------- the server side
def serve_shared(path: str, idle_seconds: float) -> None:
    """Import what a fork server imports, listen on ``path`` and fork a session for each connection, until
    ``idle_seconds`` pass without one. A task forked in a session leaves by its ``SystemExit`` (see
    :func:`~distrib.cluster.forkserver.serve`): nothing here may catch it, nor clean up on its way."""
    pid_file = path[: -len(".sock")] + ".pid"
    with open(pid_file, "w") as f:  # first: stop_servers finds a server still importing too
        f.write(str(os.getpid()))
    preload()
    become_subreaper()  # what a finished session leaves (its tasks' relays) comes here to be reaped
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.exists(path):
        os.unlink(path)  # a server gone without removing it (connect found nobody, under the lock)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    greeting = {"server": os.getpid(), "import_environment": import_environment(os.environ)}
    sessions: set[int] = set()
    last = time.monotonic()
    while True:
        sessions -= reap_children()
        if not sessions and time.monotonic() - last > idle_seconds:
            break
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        last = time.monotonic()
        session = os.fork()
        if session == 0:
            listener.close()
            connection.send(json.dumps({**greeting, "session": os.getpid()}).encode())
            serve_requests(connection)  # a task raises its SystemExit from here, up to the interpreter's exit
            os._exit(0)
        connection.close()
        sessions.add(session)
    for name in (path, pid_file):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrib.cluster.shared_forkserver", description=__doc__)
    parser.add_argument("path", help="the socket to listen on (a server), or the directory (--stop)")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    parser.add_argument("--stop", action="store_true", help="stop every server of the directory PATH")
    args = parser.parse_args(argv)
    if args.stop:
        print(f"stopped {stop_servers(args.path)} fork server(s)")
        return 0
    serve_shared(args.path, args.idle_seconds)
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)  # a server: no user code to finish, and a torch interpreter's teardown costs about 0.6 CPU-s
