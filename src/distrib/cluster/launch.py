"""``distrib launch``: a whole local cluster, one process per task, each with its ``TF_CONFIG``.

Every child process gets these environment variables (plus the launcher's own):

``TF_CONFIG``
    ``{"cluster": {...}, "task": {"type": ..., "index": ...}}`` with free loopback ports
    chosen for this run (new ones on every restart).
``DISTRIB_CLUSTER_TOKEN``
    A random secret made once per launch (or the launcher's own ``DISTRIB_CLUSTER_TOKEN``,
    at least 16 characters); parameter-server RPCs must carry it.
``DISTRIB_TLS_CERT``, ``DISTRIB_TLS_KEY``, ``DISTRIB_TLS_CA``
    With ``--tls`` only: the task's own certificate and key, signed by a CA made for this
    launch (see :mod:`distrib.parameter_server.transport.certificates`), so the ps and worker
    servers speak mutual TLS. The files are removed when the launcher exits.
``DISTRIB_RESTART``
    How many times the group was restarted before this process was started (0 first).
``PYTHONUNBUFFERED``
    ``1``, so log lines arrive as they are printed.
``DISTRIB_FAULT_TOLERANT_STORE``
    With ``--fault-tolerant`` only: ``host:port`` of the store the launcher hosts, through which fault-tolerant
    workers agree on who is left when one dies (:mod:`distrib.cluster.fault_watch`); a failed task then stops
    nobody.
``OMP_NUM_THREADS``
    Unless the launcher's environment (or ``LaunchConfig.env``) sets it: this host's usable
    CPUs divided among the tasks that train (every task without ``--ps``; the workers with
    it), at least 1. torch gives each process as many threads as the host has CPUs, so N
    processes on one host would run N times as many threads as there are cores, each
    waiting on the others (torchrun sets 1 for the same reason).
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
    torchrun's variables, in a cluster without parameter servers: the task's rank among the
    chief and workers (the chief first), their number (every task runs on this host, so the
    local rank is the rank), and the first task's address, where ``TF_CONFIG``'s rendezvous
    is too. A DDP-style script (``dist.init_process_group("gloo")``, ``DistributedDataParallel``)
    runs unchanged; ``MultiWorkerMirroredStrategy`` takes one GPU per process
    (``cuda:LOCAL_RANK``) on a host with several.

Without ``--ps``, every ``chief``/``worker`` task runs the script (multi-worker
training). With ``--ps M``, ``ps`` and ``worker`` tasks run parameter servers
(``python -m distrib.parameter_server``) and the chief runs the script.

Output lines are prefixed by their task (``[worker 1] ...``). The first failure's
exit code is returned; with ``--max-restarts K``, a failure stops the whole group and
starts it again (the script resumes from its checkpoint), at most K times. A worker
server of a parameter-server cluster that dies is restarted alone, since the
coordinator re-schedules its functions.

Elastic size, ``--workers MIN:MAX`` (``LaunchConfig(min_workers=MIN, workers=MAX)``; a
worker-only cluster): MAX workers start. A worker
that fails is taken as lost for good: the group is stopped and started again with the
survivors only (a new ``TF_CONFIG`` with one worker fewer, ranks renumbered from 0, the
script resumes from its checkpoint), as long as at least MIN remain; such a shrink does not
count against ``--max-restarts``. When fewer than MIN would remain, the failure is handled
as in a fixed-size job (restart at the same size while ``--max-restarts`` allows, else exit
with its code). The launcher never grows a job: all its workers run on this host, so a
worker cannot join later; a job grows under torchrun's elastic agents
(``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d``: a new agent joining makes every
worker restart at the larger size, and distrib resumes from the checkpoint; with torch
2.13 the agents need ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or the joining agent times
out in torch's own rendezvous). Training
code that keeps global batches and the data position global (``tests/scripts/resize_train.py``)
ends with the same parameters whatever the sizes it ran at, up to float rounding.

Signals: SIGTERM and SIGHUP (how Slurm, Kubernetes, systemd and ``timeout`` stop a job)
and SIGINT (Ctrl-C) sent to the launcher are forwarded to every task (each task runs
in its own process group, which receives the signal, then SIGCONT so that a stopped task acts on it
at once), the launcher waits up to
``grace_seconds`` (5 s, ``--grace-seconds``; the tasks see it as ``DISTRIB_GRACE_SECONDS``)
for them to exit, kills (SIGKILL) the process group of every task still there, and exits
with ``128 + signal``: 143 for SIGTERM, 129 for SIGHUP, 130 for SIGINT; or with 42 when
every script task exited with 42 (each saved a preemption checkpoint), so that the
scheduler above (a Kubernetes Job's ``podFailurePolicy``, a Slurm batch script that
requeues on 42) can tell a preemption from a failure; or with 0 when every script task
exited with 0 (the notice came so near the end that the work finished first, and
nothing is left to redo). No task outlives the launcher.

Start: each task is a fresh interpreter started as ``python SCRIPT ARGS`` (``python -m MODULE ARGS`` with
``-m``), as torchrun starts its workers: ``ps``, ``/proc/PID/cmdline`` and ``sys.orig_argv`` name the script,
stdin is the launcher's, and a variable torch reads at import (``TORCHDYNAMO_VERBOSE``, ``TORCHINDUCTOR_*``,
``OMP_NUM_THREADS``) that the script sets in ``os.environ`` before ``import torch`` takes effect.
``--start-method forkserver`` (``DISTRIB_START_METHOD=forkserver``) forks each task instead from one process that
imported torch once (:mod:`distrib.cluster.forkserver`; about 2 CPU-seconds less per task and per restart: for
sweeps and test suites). What differs there: torch, ``torch._dynamo`` and distrib are imported before the script
runs, so an import-time variable the script sets itself has no effect (set it in the launch's environment: a
task whose import-time variables differ from the server's starts fresh); ``ps``, ``/proc/PID/cmdline`` and
``sys.orig_argv`` show ``python -m distrib.cluster.forkserver``; stdin is ``/dev/null``; the tasks share one hash
seed; the server's objects are frozen (:func:`gc.freeze`). A command it cannot fork (interpreter options, another
program) starts fresh there too.

Preemption: a script task that exits with 42 (:data:`PREEMPTION_EXIT_CODE`, what
``ds.experimental.PreemptionCheckpointHandler`` exits with after its checkpoint, TF's code)
was told to stop (a signal to that task) and saved where every worker agreed: the launcher
gives the other tasks ``grace_seconds`` to finish their own save and exit, then restarts
the whole group at the same size. Such a restart is not counted against ``--max-restarts``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from distrib.cluster import shared_forkserver
from distrib.cluster.fault_watch import FaultWatch
from distrib.cluster.forkserver import ForkedProcess, ForkServer, forkable, reap_orphans
from distrib.cluster.local_cluster import free_ports, make_cluster, threads_per_task, torchrun_variables

__all__ = [
    "PREEMPTION_EXIT_CODE",
    "LaunchConfig",
    "launch",
    "free_ports",
    "make_cluster",
    "parse_workers",
    "torchrun_variables",
]

log = logging.getLogger("distrib.cluster.launch")

#: the exit code of a task that saved a preemption checkpoint (``ds.experimental.TerminationConfig``'s default)
PREEMPTION_EXIT_CODE = 42
#: the grace period, in seconds, that every task is told (``distrib.preemption.config.GRACE_ENV``)
GRACE_ENV = "DISTRIB_GRACE_SECONDS"
_print_lock = threading.Lock()
#: how tasks start (``LaunchConfig.start_method``)
START_METHODS = ("spawn", "forkserver")


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
    #: make a throwaway CA and a certificate per task, and set ``DISTRIB_TLS_*`` for every task
    tls: bool = False
    #: the fewest workers the job may continue on (``--workers MIN:MAX``); None: a fixed size, ``workers``
    min_workers: int | None = None
    #: ``"spawn"``: a fresh ``python SCRIPT ARGS`` per task, as torchrun starts them; ``"forkserver"``: fork each
    #: task from one process that imported torch once (:mod:`distrib.cluster.forkserver`: about 2 CPU-seconds less
    #: per task, with the differences the module docstring lists). Default: ``DISTRIB_START_METHOD``, else
    #: ``"spawn"``
    start_method: str = field(default_factory=lambda: os.environ.get("DISTRIB_START_METHOD", "spawn"))
    #: ``--fault-tolerant``: host the store fault-tolerant workers agree through, and let the others go on when a
    #: script task dies (:mod:`distrib.cluster.fault_watch`)
    fault_tolerant: bool = False

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("distrib launch needs a script to run, e.g. distrib launch --workers 2 train.py")
        if self.workers < 1 or self.ps < 0 or self.max_restarts < 0:
            raise ValueError(
                f"need --workers >= 1, --ps >= 0, --max-restarts >= 0; got "
                f"{self.workers}, {self.ps}, {self.max_restarts}"
            )
        if self.min_workers is not None:
            if not 1 <= self.min_workers <= self.workers:
                raise ValueError(f"--workers {self.min_workers}:{self.workers}: need 1 <= MIN <= MAX")
            if self.ps:
                raise ValueError(
                    f"--workers {self.min_workers}:{self.workers} with --ps {self.ps}: an elastic size "
                    "is for worker-only clusters (a parameter-server cluster restarts a lost worker "
                    "server instead); give --workers N"
                )
        if self.fault_tolerant and (self.ps or self.min_workers is not None or self.max_restarts):
            raise ValueError(
                "--fault-tolerant keeps the survivors training in their processes: it goes with worker-only "
                "clusters of a fixed size and no --max-restarts (drop --ps, MIN: and --max-restarts)"
            )
        if not self.grace_seconds >= 0:
            raise ValueError(f"grace_seconds={self.grace_seconds!r}: must be >= 0 seconds")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start method {self.start_method!r} (--start-method or DISTRIB_START_METHOD): use one of "
                f"{', '.join(START_METHODS)}"
            )


def parse_workers(text: str) -> tuple[int, int]:
    """``--workers``'s value: ``"N"`` -> ``(N, N)``, ``"MIN:MAX"`` -> ``(MIN, MAX)``; a ValueError says what is wrong.

    Example::

        >>> parse_workers("3"), parse_workers("2:4")
        ((3, 3), (2, 4))
    """
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"--workers {text!r}: give a number of workers N or a range MIN:MAX (e.g. 2:4)") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--workers {text!r}: need 1 <= MIN <= MAX (e.g. 2:4)")
    return lo, hi


class _Task:
    def __init__(self, task_type: str, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.name = f"{task_type} {index}"
        self.task_type, self.index = task_type, index
        self.argv, self.env = argv, env
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.reader: threading.Thread | None = None
        #: forks the task when it can (:mod:`distrib.cluster.forkserver`); None: a fresh process
        self.server: ForkServer | None = None

    def start(self) -> None:
        self.proc = None
        if self.server is not None and self.server.accepts(self.argv, self.env):
            try:
                self.proc = self.server.start(self.argv, self.env)
            except RuntimeError as e:  # this task starts fresh; once the server is gone, so does every later one
                _say(f"the fork server failed ({e}): starting {self.name} as a fresh process")
        if self.proc is None:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.reader = threading.Thread(target=_relay, args=(self.proc.stdout, f"[{self.name}] "), daemon=True)
        self.reader.start()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the task's process group (the task and what it started), even if the task itself exited.

        A polite stop (SIGTERM, SIGHUP, SIGINT) is followed by SIGCONT, as systemd does: a stopped process
        (SIGSTOP, Ctrl-Z, a debugger) only acts on its pending signal once continued, so it then exits or saves
        now instead of holding the launcher for the whole grace period before SIGKILL."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
                if sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                    os.killpg(self.proc.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

    def join_output(self) -> None:
        if self.reader is not None:
            self.reader.join(timeout=2)


def _relay(stream: IO[bytes] | None, prefix: str) -> None:
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

    def __init__(
        self, config: LaunchConfig, token: str, restart: int, tls: Any = None, workers: int | None = None
    ) -> None:
        self.config = config
        cluster = make_cluster(config.workers if workers is None else workers, config.ps, config.chief, config.host)
        script = [sys.executable, *config.command]
        server = [sys.executable, "-m", "distrib.parameter_server"]
        threads = threads_per_task(cluster, config.ps > 0, {**os.environ, **config.env})
        self.tasks: list[_Task] = []
        self.server: ForkServer | None = None
        #: what every task's environment holds (the fork server's: it names no task, in /proc/PID/environ either)
        self.shared_env = {
            "GRPC_VERBOSITY": "ERROR",
            **os.environ,
            **config.env,
            "PYTHONUNBUFFERED": "1",
            "DISTRIB_CLUSTER_TOKEN": token,
            GRACE_ENV: f"{config.grace_seconds:g}",
        }
        if threads is not None:
            self.shared_env["OMP_NUM_THREADS"] = threads
        for task_type, addresses in cluster.items():
            for index in range(len(addresses)):
                env = {
                    **self.shared_env,
                    "DISTRIB_RESTART": str(restart),
                    "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}),
                }
                if not config.ps:
                    env.update(torchrun_variables(cluster, task_type, index))
                if tls is not None:
                    env.update(tls.env(f"{task_type}-{index}"))
                runs_server = config.ps > 0 and task_type in ("ps", "worker")
                self.tasks.append(_Task(task_type, index, server if runs_server else script, env))
        self.cluster = cluster

    @property
    def script_tasks(self) -> list[_Task]:
        return [t for t in self.tasks if self.config.ps == 0 or t.task_type == "chief"]

    def start(self, server: ForkServer | None) -> None:
        # servers first, so the chief finds them listening
        self.server = server
        for t in sorted(self.tasks, key=lambda t: t.task_type == "chief"):
            t.server = server
            t.start()

    def settle(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every task to exit by itself (the others finishing a preemption checkpoint)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(t.poll() is None for t in self.script_tasks):
            time.sleep(0.05)

    def all_finished(self) -> bool:
        """Whether every script task exited with 0: the work was done before the signal could stop it."""
        return all(t.poll() == 0 for t in self.script_tasks)

    def all_preempted(self) -> bool:
        """Whether every script task exited with the preemption code (each saved its checkpoint)."""
        return all(
            t.poll() is not None and _exit_code(t.poll() or 0) == PREEMPTION_EXIT_CODE for t in self.script_tasks
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to every task, wait the grace period, then SIGKILL every task's process group."""
        for t in self.tasks:
            if t.poll() is None:
                t.signal(sig)
        deadline = time.monotonic() + self.config.grace_seconds
        while time.monotonic() < deadline and any(t.poll() is None for t in self.tasks):
            time.sleep(0.05)
        for t in self.tasks:
            t.signal(signal.SIGKILL)
        for t in self.tasks:
            if t.proc is not None:
                t.proc.wait()
            t.join_output()

    def watch(self, server_restarts: list[int], faults: FaultWatch | None = None) -> tuple[bool, int, str]:
        """Block until the group succeeds or fails: ``(ok, exit_code, who)``.

        When several tasks are seen failed at once, ``who`` is one killed by a signal if any
        (the others usually failed because it was gone), else the first in cluster order. With
        ``faults`` (``--fault-tolerant``) a failed task is recorded and the others go on: the group
        succeeds when every task has exited and one of them finished (exit 0).
        """
        while True:
            if self.server is not None:  # with a server of its own the launcher is a subreaper: orphans come to it
                reap_orphans({t.proc.pid for t in self.tasks if t.proc is not None} | self.server.owned_pids)
            if faults is not None:
                verdict = faults.verdict(self.script_tasks, _say)
                if verdict is not None:
                    return verdict
                time.sleep(0.05)
                continue
            failed: list[tuple[_Task, int]] = []
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
                failed.append((t, code))
            if failed:
                task, code = min(failed, key=lambda f: f[1] >= 0)  # a signal's negative code first
                return False, _exit_code(code) or 1, task.name
            if all(t.poll() == 0 for t in self.script_tasks):
                return True, 0, ""
            time.sleep(0.05)


def _say(message: str) -> None:
    with _print_lock:
        print(f"[launch] {message}", flush=True)


class _Signalled(BaseException):
    """Raised in the launcher's main thread when SIGTERM, SIGHUP or SIGINT arrives."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _SignalForwarding:
    """Turns SIGTERM/SIGHUP/SIGINT into :class:`_Signalled` while armed; remembers them while the group stops."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self) -> None:
        self.armed = True
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        if self.armed:
            self.armed = False
            raise _Signalled(signum)

    def __enter__(self) -> _SignalForwarding:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _token(config: LaunchConfig) -> str:
    given = config.env.get("DISTRIB_CLUSTER_TOKEN") or os.environ.get("DISTRIB_CLUSTER_TOKEN")
    if given is None:
        return secrets.token_hex(16)
    if len(given) < 16:
        raise ValueError(
            f"DISTRIB_CLUSTER_TOKEN has {len(given)} characters; it needs at least 16 (a short token "
            "can be guessed). Unset it to let distrib launch make one, or make one with "
            "python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return given


def _certificates(config: LaunchConfig, directory: str) -> Any:
    from distrib.parameter_server.transport.certificates import make_cluster_certificates

    tasks = (
        (["chief-0"] if config.chief or config.ps else [])
        + [f"worker-{i}" for i in range(config.workers)]
        + [f"ps-{i}" for i in range(config.ps)]
    )
    made = make_cluster_certificates(directory, tasks, [config.host])
    _say(f"TLS: a throwaway CA and {len(tasks)} task certificates (made with {made.backend}) in {directory}")
    if not config.ps:
        _say(
            "TLS covers parameter-server RPCs only; the collectives of a worker-only cluster (gloo) are not "
            "encrypted: run it on a trusted network"
        )
    return made


def launch(config: LaunchConfig) -> int:
    """Run the cluster until its script tasks finish; return 0, the first failure's exit code, or 128 + a signal.

    A configuration error (a short ``DISTRIB_CLUSTER_TOKEN``, no way to make TLS
    certificates) is printed and returns 2 before any task starts.
    """
    try:
        token = _token(config)
    except ValueError as e:
        print(f"distrib launch: {e}", file=sys.stderr, flush=True)
        return 2
    server_restarts = [config.max_restarts]
    tls_dir = tempfile.mkdtemp(prefix="distrib-tls-") if config.tls else None
    group: _Group | None = None
    server: ForkServer | None = None
    forking = config.start_method == "forkserver"
    if not forking and {**os.environ, **config.env}.get(shared_forkserver.DIRECTORY_VARIABLE):
        _say(
            f"{shared_forkserver.DIRECTORY_VARIABLE} is set, but the tasks start as fresh processes (start method "
            f"{config.start_method!r}); give --start-method forkserver (or DISTRIB_START_METHOD=forkserver) to "
            "fork them from the shared server"
        )
    code = 1
    faults = FaultWatch(config.host) if config.fault_tolerant else None
    if faults is not None:
        from distrib.comm.membership import STORE_VARIABLE

        config = dataclasses.replace(config, env={**config.env, STORE_VARIABLE: faults.address})
        _say(f"fault tolerant: the workers agree through the store at {faults.address}; a lost task is not restarted")
    with _SignalForwarding() as signals:
        try:
            try:
                tls = _certificates(config, tls_dir) if tls_dir else None
            except (RuntimeError, ValueError, OSError) as e:
                print(f"distrib launch: cannot make the TLS certificates: {e}", file=sys.stderr, flush=True)
                return 2
            workers, restarts, starts = config.workers, 0, 0
            while True:
                group = _Group(config, token, starts, tls, workers)
                _say(f"starting {len(group.tasks)} task(s): {json.dumps(group.cluster)}")
                if forking and server is None and any(forkable(t.argv) for t in group.tasks):
                    server = shared_forkserver.launch_server(group.shared_env, _say)
                    forking = server is not None
                group.start(server)
                ok, code, who = group.watch(server_restarts, faults)
                signals.armed = False
                preempted = not ok and code == PREEMPTION_EXIT_CODE
                if preempted:
                    group.settle(config.grace_seconds)
                group.stop()
                signals.armed = True
                if signals.received is not None:
                    raise _Signalled(signals.received)
                if ok:
                    return 0
                if preempted:
                    _say(
                        f"{who} exited with {code} after a preemption checkpoint: restarting the whole group from "
                        "it (not counted against --max-restarts)"
                    )
                    starts += 1
                    continue
                _say(f"{who} failed with exit code {code}")
                if config.min_workers is not None and workers - 1 >= config.min_workers:
                    workers -= 1
                    _say(
                        f"{who} is lost: continuing on the {workers} surviving worker(s) (--workers "
                        f"{config.min_workers}:{config.workers}), from the script's last checkpoint"
                    )
                elif restarts < config.max_restarts:
                    restarts += 1
                    _say(f"restarting the whole group ({restarts} of {config.max_restarts})")
                else:
                    if config.min_workers is not None:
                        _say(f"fewer than {config.min_workers} worker(s) would remain: the job fails")
                    return code
                starts += 1
        except _Signalled as e:
            signals.armed = False
            name = signal.Signals(e.signum).name
            if group is not None:
                _say(
                    f"received {name}: forwarding it to every task, killing what remains after "
                    f"{config.grace_seconds:g}s"
                )
                group.stop(e.signum)
                if group.all_preempted():
                    _say(f"every task saved a preemption checkpoint: exiting with {PREEMPTION_EXIT_CODE}")
                    return PREEMPTION_EXIT_CODE
                if group.all_finished():
                    # a notice near the end: the step agreed for the checkpoint came after the last one, so the
                    # tasks finished. Nothing is left to do, and a failure code would make the scheduler rerun it
                    _say(f"every task finished its work (exit 0) before {name} stopped it: exiting with 0")
                    return 0
            return 128 + e.signum
        finally:
            signals.armed = False
            if server is not None:
                server.close()
            if faults is not None:
                faults.close()
            if tls_dir is not None:
                shutil.rmtree(tls_dir, ignore_errors=True)
