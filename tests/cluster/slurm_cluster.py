"""A one-node Slurm cluster for tests: munge, slurmctld and slurmd on this host, from Debian's `slurm-wlm`.

    with SlurmCluster() as slurm:                        # skips nothing itself: see `SlurmCluster.unavailable()`
        code, out = slurm.run(["srun", "-n2", "hostname"], timeout=60)
        code, out = slurm.sbatch("#!/bin/bash\\nsrun -n2 hostname\\n", ntasks=2, timeout=60)

Everything lives in its own directory (config, munge key and socket, state, spool, logs) and on
ports picked free, so it touches no system Slurm and no other test's cluster. The daemons run in
the foreground as children of this process, every one in its own process group, and carry a
marker variable in their environment; `stop()` cancels every job, stops the daemons, then kills
every process left that carries the marker (job steps, tasks), and removes the directory, also
when a test failed half-way. Needs root (slurmd starts the tasks as their user) and the
binaries of Debian's `slurm-wlm` and `munge` (`scripts/setup.sh` installs them when root).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.netns import Hosts

MARKER = "DISTRIB_TEST_SLURM"
_NOT_PASSED = {
    "TF_CONFIG",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "DISTRIB_BIND_ADDRESS",
}
_BINARIES = ("munged", "munge", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "sinfo")


def _free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def node_name() -> str | None:
    """This host's short name if it resolves (the cluster spec uses node names as hosts), else None."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
    except OSError:
        return None
    return name


class SlurmCluster:
    """munged + slurmctld + slurmd on this host, one node of ``cpus`` CPUs (more than the host has is fine).

    With ``hosts`` (started `cluster.netns.Hosts`), one node per host instead: slurmctld and the first
    slurmd run on the first host, one slurmd on every other host (each with that host's name and
    address), and the client commands (srun, sbatch, sinfo...) run on the first host. munged stays
    here: its socket is a file, which every namespace sees.
    """

    def __init__(
        self,
        cpus: int = 8,
        hosts: Hosts | None = None,
        *,
        requeue_exit: Sequence[int] = (),
        cred_expire: int | None = None,
        sched_interval: int | None = None,
    ) -> None:
        """``requeue_exit``: slurm.conf's ``RequeueExit`` (slurmctld requeues a batch job that exits with one of
        these codes). ``cred_expire``: ``AuthInfo=cred_expire=`` (at least 5), the credential lifetime, which is
        also how long a requeued job waits before it may start again (Slurm's default 120 s). ``sched_interval``:
        ``SchedulerParameters=sched_interval=`` (default 60 s), how often the main scheduling loop looks at pending
        jobs, among them a requeued job whose wait is over. Left out, Slurm's defaults."""
        if cred_expire is not None and cred_expire < 5:
            raise ValueError(f"cred_expire={cred_expire}: Slurm ignores values under 5 (and uses 120)")
        self.cpus = cpus
        self.hosts = hosts
        self.requeue_exit = tuple(requeue_exit)
        self.cred_expire = cred_expire
        self.sched_interval = sched_interval
        self.dir = Path(tempfile.mkdtemp(prefix="distrib-slurm-"))
        self.nodes = (
            [(h.name, h.address) for h in hosts.hosts] if hosts else [(node_name() or "localhost", "127.0.0.1")]
        )
        self.node = self.nodes[0][0]
        self.conf = self.dir / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []
        self._started: list[subprocess.Popen] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why a cluster cannot be started here (a skip reason), or None."""
        if os.geteuid() != 0:
            return "a Slurm cluster needs root (slurmd starts tasks as their user): run the tests as root"
        missing = [b for b in _BINARIES if shutil.which(b) is None]
        if missing:
            return (
                f"Slurm/munge binaries missing ({', '.join(missing)}): install Debian's slurm-wlm and munge "
                "(scripts/setup.sh does, as root)"
            )
        if node_name() is None:
            return f"this host's name {socket.gethostname()!r} does not resolve; Slurm's node names must"
        return None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, pointed at this cluster (and marked, for the final sweep)."""
        # srun passes the caller's environment on to the tasks: leave out Slurm's own variables and what an
        # earlier in-process test may have set for its own cluster (gloo's interface, a launcher's rank)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_")) and k not in _NOT_PASSED}
        env.update({"SLURM_CONF": str(self.conf), MARKER: str(self.dir)})
        env.update(extra or {})
        return env

    def start(self, timeout: float = 60) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (d / sub).mkdir()
        os.chmod(d, 0o755)
        os.chmod(d / "munge", 0o711)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = _free_ports(2)
        node_lines = "\n".join(
            f"NodeName={name} NodeAddr={address} CPUs={self.cpus} State=UNKNOWN" for name, address in self.nodes
        )
        auth_extra = f",cred_expire={self.cred_expire}" if self.cred_expire is not None else ""
        extra = "".join(
            [
                f"RequeueExit={','.join(map(str, self.requeue_exit))}\n" if self.requeue_exit else "",
                f"SchedulerParameters=sched_interval={self.sched_interval}\n"
                if self.sched_interval is not None
                else "",
            ]
        )
        self.conf.write_text(
            _CONF.format(
                dir=d,
                node=self.node,
                address=self.nodes[0][1],
                nodes=node_lines,
                names=",".join(name for name, _ in self.nodes),
                ctld_port=ctld_port,
                slurmd_port=slurmd_port,
                auth_extra=auth_extra,
                extra=extra,
            )
        )
        socket_path = d / "munge" / "munge.socket"
        self._daemon(
            [
                "munged",
                "--force",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={d / 'munge' / 'munged.pid'}",
                f"--log-file={d / 'log' / 'munged.log'}",
                f"--seed-file={d / 'munge' / 'seed'}",
            ],
            "munged",
        )
        self._wait(lambda: socket_path.exists(), timeout, "munged did not create its socket")
        self._daemon(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld", host=0 if self.hosts else None)
        for i, (name, _) in enumerate(self.nodes):
            (d / "spool" / name).mkdir()
            self._daemon(
                ["slurmd", "-D", "-f", str(self.conf), "-N", name], f"slurmd-{name}", host=i if self.hosts else None
            )

        def idle() -> bool:
            out = subprocess.run(
                self._client(["sinfo", "-h", "-N", "-o", "%T"]),
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.split()
            return out == ["idle"] * len(self.nodes)

        self._wait(idle, timeout, "the node did not become idle")

    def _client(self, argv: Sequence[str], host: int = 0) -> list[str]:
        """``argv`` as run on host ``host`` (on this host without ``hosts``)."""
        return self.hosts[host].command_keeping_mounts(argv) if self.hosts else list(argv)

    def _daemon(self, argv: Sequence[str], name: str, host: int | None = None) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        argv = self._client(argv, host) if host is not None else list(argv)
        proc = subprocess.Popen(
            list(argv),
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._daemons.append(proc)

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(
                    f"a Slurm daemon exited ({dead[0].args[0]}, status {dead[0].returncode}):\n" + self.logs()
                )
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} within {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name}\n{text[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever carries the marker, remove the directory."""
        if self._daemons and all(p.poll() is None for p in self._daemons):
            try:
                subprocess.run(
                    self._client(["scancel", "--full", "--quiet", "--user", "root"]),
                    env=self.env(),
                    timeout=15,
                    capture_output=True,
                )
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    out = subprocess.run(
                        self._client(["squeue", "-h", "-o", "%i"]),
                        env=self.env(),
                        capture_output=True,
                        text=True,
                        timeout=15,
                    ).stdout.strip()
                    if not out:
                        break
                    time.sleep(0.3)
            except (OSError, subprocess.SubprocessError):
                pass
        for proc in self._started:
            _kill_group(proc)
        for proc in reversed(self._daemons):
            _kill_group(proc, signal.SIGTERM)
        for proc in reversed(self._daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait(timeout=10)
            _kill_group(proc)  # anything left in its group (slurmstepd)
        kill_marked(str(self.dir))
        self._daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ jobs
    def popen(
        self, argv: Sequence[str], extra_env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> subprocess.Popen:
        """Start a client command (``srun``, ``sbatch``...) in its own process group; stopped by ``stop()``."""
        proc = subprocess.Popen(
            self._client(argv),
            env=self.env(extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            cwd=cwd,
        )
        self._started.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], timeout: float, extra_env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> tuple[int, str]:
        """Run a client command bounded in time: ``(exit status, output)``; on overrun its group is killed
        and the status is -9."""
        return wait(self.popen(argv, extra_env, cwd), timeout)

    def sbatch(
        self, script: str, timeout: float, args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
    ) -> tuple[int, str]:
        """Submit ``script`` with ``sbatch --wait ARGS`` and return its exit status and the job's output."""
        jobs = self.dir / "jobs"
        path = Path(tempfile.mkstemp(prefix="job-", suffix=".sh", dir=jobs)[1])
        path.write_text(script)
        out = path.with_suffix(".out")
        code, submitted = self.run(
            ["sbatch", "--wait", "-o", str(out), *args, str(path)], timeout, extra_env, cwd=str(jobs)
        )
        text = out.read_text(errors="replace") if out.exists() else ""
        return code, f"{submitted}\n{text}"


def wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """``(exit status, output)`` of ``proc`` within ``timeout`` seconds; else its group is killed (status -9)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return -9, f"{out}\n[killed after {timeout}s]"
    finally:
        _kill_group(proc)
    return proc.returncode, out


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_marked(value: str) -> int:
    """SIGKILL every process whose environment has ``DISTRIB_TEST_SLURM=value``; how many."""
    needle = f"{MARKER}={value}".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


_CONF = """\
ClusterName=distribtest
SlurmctldHost={node}({address})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket{auth_extra}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=2
MinJobAge=2
InactiveLimit=0
{extra}{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=10 State=UP
"""
