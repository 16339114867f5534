"""Clusters for notebooks, tests and benchmarks (``ds.testing``).

* :func:`create_in_process_cluster`: ps and worker servers on threads of this process,
  as TF's parameter-server tutorial builds one in a notebook; returns the chief's
  cluster resolver.
* :class:`LocalCluster`: every ps and worker task as its own process
  (``python -m distrib.parameter_server``, exactly what ``distrib launch`` starts),
  on loopback ports; tasks can be killed and restarted to exercise fault tolerance.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from distrib.cluster import ClusterSpec, SimpleClusterResolver
from distrib.cluster.local_cluster import free_ports

__all__ = ["create_in_process_cluster", "stop_in_process_cluster", "LocalCluster", "pick_unused_port"]

_in_process: dict[int, list[Any]] = {}


def pick_unused_port() -> int:
    """A TCP port on loopback that nothing listens on right now.

    Returns:
        A port number that was free when asked (another process may take it afterwards).
    """
    return free_ports(1)[0]


def _cluster_dict(num_workers: int, num_ps: int, has_chief: bool) -> dict[str, list[str]]:
    if num_workers < 1 or num_ps < 1:
        raise ValueError(
            f"a parameter-server cluster needs num_workers >= 1 and num_ps >= 1, got {num_workers}, {num_ps}"
        )
    ports = iter(free_ports(num_workers + num_ps + int(has_chief)))  # distinct: all held open while picked
    cluster = {
        "worker": [f"localhost:{next(ports)}" for _ in range(num_workers)],
        "ps": [f"localhost:{next(ports)}" for _ in range(num_ps)],
    }
    if has_chief:
        cluster["chief"] = [f"localhost:{next(ports)}"]
    return cluster


def create_in_process_cluster(
    num_workers: int,
    num_ps: int,
    has_chief: bool = True,
    token: str | None = None,
    worker_device: str | None = None,
) -> SimpleClusterResolver:
    """Start ``num_ps`` ps and ``num_workers`` worker servers in this process; return the chief's resolver.

    ``DISTRIB_CLUSTER_TOKEN`` is set to ``token`` (or a fresh secret when neither is
    given) so that the strategy created next finds it. Stop the servers with
    :func:`stop_in_process_cluster`. The workers compute on ``worker_device`` (default: their GPU when
    there is one, see :mod:`distrib.parameter_server.worker_device`).

    Example::

        >>> import distrib as ds
        >>> resolver = ds.testing.create_in_process_cluster(num_workers=3, num_ps=2)
        >>> sorted(resolver.cluster_spec().jobs), resolver.task_type
        (['chief', 'ps', 'worker'], 'chief')
        >>> ds.testing.stop_in_process_cluster(resolver)

    Args:
        num_workers: how many worker servers, at least 1.
        num_ps: how many ps servers, at least 1.
        has_chief: list a ``chief`` task (this process) in the cluster; False: this process is worker 0's
            address in the resolver.
        token: the cluster token; None: ``DISTRIB_CLUSTER_TOKEN``, else a fresh secret.
        worker_device: the device the workers compute on (``"cpu"``, ``"cuda:0"``); None: their GPU if any.

    Returns:
        The chief's resolver, to give to ``ds.ParameterServerStrategy``.

    Raises:
        ValueError: ``num_workers`` or ``num_ps`` is below 1.
    """
    from distrib.parameter_server.server.server import Server
    from distrib.parameter_server.transport.rpc import TOKEN_ENV

    token = token or os.environ.get(TOKEN_ENV) or secrets.token_hex(32)
    os.environ[TOKEN_ENV] = token
    cluster = _cluster_dict(num_workers, num_ps, has_chief)
    servers = [Server(cluster, "ps", i, token=token) for i in range(num_ps)]
    servers += [Server(cluster, "worker", i, token=token, device=worker_device) for i in range(num_workers)]
    task = ("chief", 0) if has_chief else ("worker", 0)
    resolver = SimpleClusterResolver(ClusterSpec(cluster), *task)
    _in_process[id(resolver)] = servers
    return resolver


def stop_in_process_cluster(resolver: SimpleClusterResolver) -> None:
    """Stop the servers started by :func:`create_in_process_cluster` for ``resolver``.

    Args:
        resolver: what :func:`create_in_process_cluster` returned (another resolver stops nothing).
    """
    for server in _in_process.pop(id(resolver), []):
        server.stop(grace=0)


class LocalCluster:
    """ps and worker tasks as child processes on loopback; this process is the chief.

    Every child gets ``TF_CONFIG`` and ``DISTRIB_CLUSTER_TOKEN`` (and
    ``OMP_NUM_THREADS=torch_threads`` unless ``env`` says otherwise); its output
    goes to ``<log_dir>/<job>-<index>.log``. Use it as a context manager, or call
    :meth:`stop`: every child is killed.

    Example::

        >>> with LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
        ...     strategy = ds.ParameterServerStrategy(cluster.resolver(), token=cluster.token)
        ...     cluster.kill("worker", 1); cluster.start_task("worker", 1)
        ...     cluster.send_signal("worker", 0, signal.SIGSTOP)  # a hung worker

    Args:
        num_workers: how many worker processes, at least 1.
        num_ps: how many ps processes, at least 1.
        token: the cluster token; None: a fresh secret (``cluster.token``).
        env: variables set in every child's environment, over this process's.
        torch_threads: ``OMP_NUM_THREADS`` of each child; None: left as inherited.
        log_dir: the folder of the children's logs; None: a temporary one, removed by :meth:`stop`.

    Raises:
        ValueError: ``num_workers`` or ``num_ps`` is below 1.
    """

    def __init__(
        self,
        num_workers: int,
        num_ps: int,
        *,
        token: str | None = None,
        env: Mapping[str, str] | None = None,
        torch_threads: int | None = 1,
        log_dir: str | None = None,
    ) -> None:
        self.cluster = _cluster_dict(num_workers, num_ps, has_chief=True)
        self.token = token or secrets.token_hex(32)
        self._owns_log_dir = log_dir is None  # a directory we made is removed by stop()
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="distrib-cluster-")
        self._env = dict(env or {})
        self._threads = torch_threads
        self._procs: dict[tuple[str, int], subprocess.Popen] = {}
        try:
            for i in range(num_ps):
                self.start_task("ps", i)
            for i in range(num_workers):
                self.start_task("worker", i)
        except BaseException:
            self.stop()
            raise

    def resolver(self) -> SimpleClusterResolver:
        """The chief's resolver (this process).

        Returns:
            A ``SimpleClusterResolver`` of the cluster, task ``chief`` 0.
        """
        return SimpleClusterResolver(ClusterSpec(self.cluster), "chief", 0)

    def start_task(self, job: str, index: int) -> subprocess.Popen:
        """Start (or restart) one task's process.

        Args:
            job: ``"ps"`` or ``"worker"``.
            index: the task's index in its job.

        Returns:
            The child process.

        Raises:
            RuntimeError: that task is still running.
        """
        from distrib.parameter_server.transport.rpc import TOKEN_ENV

        old = self._procs.get((job, index))
        if old is not None and old.poll() is None:
            raise RuntimeError(f"/job:{job}/task:{index} is still running (pid {old.pid}); kill it first")
        env = dict(os.environ)
        if self._threads is not None:
            env["OMP_NUM_THREADS"] = str(self._threads)
        env.update(self._env)
        env["TF_CONFIG"] = json.dumps({"cluster": self.cluster, "task": {"type": job, "index": index}})
        env[TOKEN_ENV] = self.token
        log = open(os.path.join(self.log_dir, f"{job}-{index}.log"), "ab")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "distrib.parameter_server"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        self._procs[(job, index)] = proc
        return proc

    def kill(self, job: str, index: int) -> None:
        """Kill one task's process (SIGKILL: no clean shutdown, as a crash would).

        Args:
            job: ``"ps"`` or ``"worker"``.
            index: the task's index in its job.
        """
        proc = self._procs.get((job, index))
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def send_signal(self, job: str, index: int, sig: int) -> None:
        """Send ``sig`` to one task's process: e.g. ``signal.SIGSTOP`` to hang it, ``signal.SIGCONT`` to resume it.

        Args:
            job: ``"ps"`` or ``"worker"``.
            index: the task's index in its job.
            sig: the signal (``signal.SIGSTOP``, ``signal.SIGTERM``, ...).

        Raises:
            RuntimeError: the task is not running.
        """
        proc = self._procs.get((job, index))
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"/job:{job}/task:{index} is not running")
        proc.send_signal(sig)

    def pid(self, job: str, index: int) -> int:
        """The process id of one task (to measure its memory, for example).

        Args:
            job: ``"ps"`` or ``"worker"``.
            index: the task's index in its job.

        Returns:
            The task's process id.

        Raises:
            KeyError: the task was never started.
        """
        proc = self._procs.get((job, index))
        if proc is None:
            raise KeyError(f"/job:{job}/task:{index} was never started")
        return proc.pid

    def alive(self, job: str, index: int) -> bool:
        """Whether one task's process is running.

        Args:
            job: ``"ps"`` or ``"worker"``.
            index: the task's index in its job.

        Returns:
            True while the process has not exited.
        """
        proc = self._procs.get((job, index))
        return proc is not None and proc.poll() is None

    def log(self, job: str, index: int) -> str:
        """What the task has printed so far.

        Args:
            job: ``"ps"`` or ``"worker"``.
            index: the task's index in its job.

        Returns:
            The task's log (``""`` before it wrote any).
        """
        try:
            with open(os.path.join(self.log_dir, f"{job}-{index}.log"), encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once every task answers a health check; RuntimeError (with its log) if one died.

        Args:
            timeout: seconds to wait for all of them.

        Raises:
            RuntimeError: a task exited.
            TimeoutError: a task did not answer within ``timeout``.
        """
        from distrib.parameter_server.errors import PeerUnavailableError
        from distrib.parameter_server.transport import wire
        from distrib.parameter_server.transport.rpc import PS_SERVICE, WORKER_SERVICE, Connection

        deadline = time.monotonic() + timeout
        for (job, index), proc in self._procs.items():
            service = PS_SERVICE if job == "ps" else WORKER_SERVICE
            conn = Connection(self.cluster[job][index], service, self.token)
            try:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"/job:{job}/task:{index} exited with {proc.returncode}:\n{self.log(job, index)[-3000:]}"
                        )
                    try:
                        conn.call("Health", wire.encode({}), timeout=1.0, wait_for_ready=True)
                        break
                    except PeerUnavailableError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"/job:{job}/task:{index} did not answer within {timeout}s:\n"
                                f"{self.log(job, index)[-3000:]}"
                            ) from None
            finally:
                conn.close()

    def stop(self) -> None:
        """Kill every task's process (a stopped one too: SIGKILL ends a SIGSTOPped process)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._owns_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
