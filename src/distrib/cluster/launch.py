"""``distrib launch``: a whole local cluster, one process per task, each with its ``TF_CONFIG``.

Every child process gets these environment variables (plus the launcher's own):

``TF_CONFIG``
    ``{"cluster": {...}, "task": {"type": ..., "index": ...}}`` with free loopback ports
    chosen for this run (new ones on every restart).
``DISTRIB_CLUSTER_TOKEN``
    A random secret made once per launch; parameter-server RPCs must carry it.
``DISTRIB_RESTART``
    How many times the group was restarted before this process was started (0 first).
``PYTHONUNBUFFERED``
    ``1``, so log lines arrive as they are printed.

Without ``--ps``, every ``chief``/``worker`` task runs the script (multi-worker
training). With ``--ps M``, ``ps`` and ``worker`` tasks run parameter servers
(``python -m distrib.parameter_server``) and the chief runs the script.

Output lines are prefixed by their task (``[worker 1] ...``). The first failure's
exit code is returned; with ``--max-restarts K``, a failure stops the whole group and
starts it again (the script resumes from its checkpoint), at most K times. A worker
server of a parameter-server cluster that dies is restarted alone, since the
coordinator re-schedules its functions.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Optional, Sequence

__all__ = ["LaunchConfig", "launch", "free_ports", "make_cluster"]

log = logging.getLogger("distrib.cluster.launch")
_print_lock = threading.Lock()


@dataclass(frozen=True)
class LaunchConfig:
    """What to start: ``command`` is the script and its arguments (``["train.py", "--epochs", "3"]``
    or ``["-m", "package.module", ...]``)."""

    command: Sequence[str]
    workers: int = 1
    ps: int = 0
    chief: bool = False
    max_restarts: int = 0
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    grace_seconds: float = 5.0

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("distrib launch needs a script to run, e.g. distrib launch --workers 2 train.py")
        if self.workers < 1 or self.ps < 0 or self.max_restarts < 0:
            raise ValueError(f"need --workers >= 1, --ps >= 0, --max-restarts >= 0; got "
                             f"{self.workers}, {self.ps}, {self.max_restarts}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_cluster(workers: int, ps: int, chief: bool, host: str = "127.0.0.1") -> dict[str, list[str]]:
    """A loopback cluster spec with fresh ports; a ps cluster always has a chief (the coordinator)."""
    chief = chief or ps > 0
    ports = iter(free_ports(workers + ps + int(chief), host))
    cluster: dict[str, list[str]] = {}
    if chief:
        cluster["chief"] = [f"{host}:{next(ports)}"]
    cluster["worker"] = [f"{host}:{next(ports)}" for _ in range(workers)]
    if ps:
        cluster["ps"] = [f"{host}:{next(ports)}" for _ in range(ps)]
    return cluster


class _Task:
    def __init__(self, task_type: str, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.name = f"{task_type} {index}"
        self.task_type, self.index = task_type, index
        self.argv, self.env = argv, env
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.reader: Optional[threading.Thread] = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.reader = threading.Thread(target=_relay, args=(self.proc.stdout, f"[{self.name}] "), daemon=True)
        self.reader.start()

    def poll(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def join_output(self) -> None:
        if self.reader is not None:
            self.reader.join(timeout=2)


def _relay(stream: Optional[IO[bytes]], prefix: str) -> None:
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with _print_lock:
            print(prefix + line, flush=True)
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Group:
    """One start of the whole cluster."""

    def __init__(self, config: LaunchConfig, token: str, restart: int) -> None:
        self.config = config
        cluster = make_cluster(config.workers, config.ps, config.chief, config.host)
        script = [sys.executable, *config.command]
        server = [sys.executable, "-m", "distrib.parameter_server"]
        self.tasks: list[_Task] = []
        for task_type, addresses in cluster.items():
            for index in range(len(addresses)):
                env = {"GRPC_VERBOSITY": "ERROR", **os.environ, **config.env, "PYTHONUNBUFFERED": "1",
                       "DISTRIB_CLUSTER_TOKEN": token,
                       "DISTRIB_RESTART": str(restart),
                       "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}
                runs_server = config.ps > 0 and task_type in ("ps", "worker")
                self.tasks.append(_Task(task_type, index, server if runs_server else script, env))
        self.cluster = cluster

    @property
    def script_tasks(self) -> list[_Task]:
        return [t for t in self.tasks if self.config.ps == 0 or t.task_type == "chief"]

    def start(self) -> None:
        # servers first, so the chief finds them listening
        for t in sorted(self.tasks, key=lambda t: t.task_type == "chief"):
            t.start()

    def stop(self) -> None:
        for t in self.tasks:
            t.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_seconds
        while time.monotonic() < deadline and any(t.poll() is None for t in self.tasks):
            time.sleep(0.05)
        for t in self.tasks:
            t.signal(signal.SIGKILL)
        for t in self.tasks:
            if t.proc is not None:
                t.proc.wait()
            t.join_output()

    def watch(self, server_restarts: list[int]) -> tuple[bool, int, str]:
        """Block until the group succeeds or fails: ``(ok, exit_code, who)``."""
        while True:
            for t in self.tasks:
                code = t.poll()
                if code is None or (code == 0 and t in self.script_tasks):
                    continue
                if code != 0 and self.config.ps and t.task_type == "worker" and server_restarts[0] > 0:
                    server_restarts[0] -= 1
                    _say(f"{t.name} exited with code {_exit_code(code)}; restarting it")
                    t.join_output()
                    t.start()
                    continue
                return False, _exit_code(code) or 1, t.name
            if all(t.poll() == 0 for t in self.script_tasks):
                return True, 0, ""
            time.sleep(0.05)


def _say(message: str) -> None:
    with _print_lock:
        print(f"[launch] {message}", flush=True)


def launch(config: LaunchConfig) -> int:
    """Run the cluster until its script tasks finish; return 0 or the first failure's exit code."""
    token = config.env.get("DISTRIB_CLUSTER_TOKEN") or secrets.token_hex(16)
    server_restarts = [config.max_restarts]
    for restart in range(config.max_restarts + 1):
        group = _Group(config, token, restart)
        _say(f"starting {len(group.tasks)} task(s): {json.dumps(group.cluster)}")
        try:
            group.start()
            ok, code, who = group.watch(server_restarts)
        except KeyboardInterrupt:
            group.stop()
            return 130
        group.stop()
        if ok:
            return 0
        _say(f"{who} failed with exit code {code}")
        if restart < config.max_restarts:
            _say(f"restarting the whole group ({restart + 1} of {config.max_restarts})")
    return code
