"""Several "hosts" on one machine, for tests: Linux network namespaces joined by a bridge.

    with Hosts(2) as hosts:                                   # host1 192.168.77.11, host2 192.168.77.12
        proc = hosts.popen(0, [sys.executable, "-c", "import socket; print(socket.gethostname())"])
        code, out = hosts.wait(proc, timeout=30)              # "host1"

Each host is a network namespace with its own loopback and one interface (``eth0``, a veth pair
whose other end is on a bridge in the root namespace), its own address, its own hostname (the
command runs under ``unshare --uts`` after ``hostname <name>``) and its own ``/etc/hosts``
(``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over it), which names every host.
``loopback_hostname=[i]`` makes host *i* resolve its own name to 127.0.1.1, as Debian's default
``/etc/hosts`` does; ``extra_hosts={i: {"name": "address"}}`` adds names to host *i*'s file
only (e.g. a Service name that resolves differently on each side of a NAT).
``second_interface=[i]`` gives host *i* a second non-loopback interface (``side0``, a veth pair
inside its namespace, ``10.99.<i>.1/24``) that reaches nothing: a host with two networks, where
the interface to the others cannot be guessed as "the only one".

The bridge has no address: nothing reaches the root namespace or the outside. ``close()``
kills every process started on the hosts (their process groups, then any process still in a
namespace), deletes the interfaces, the namespaces and the ``/etc/netns`` entries; namespaces
left by a process that died without closing are removed the next time a ``Hosts`` is made.
Needs root and ``ip``/``unshare`` (iproute2, util-linux); see :func:`unavailable`.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_counter = itertools.count()
_PREFIX = "dsn"  # namespaces dsn-<pid>-<n>-h<i>, bridges dsb<pid hex>g<n hex>, veths dsv<pid hex>g<n hex>x<i>
_NETNS_ETC = Path("/etc/netns")
_LAUNCHER_VARS = {
    "TF_CONFIG",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "DISTRIB_BIND_ADDRESS",
}


@dataclass
class Host:
    """One namespace: its hostname, address, and the ``ip netns`` name."""

    index: int
    name: str
    address: str
    namespace: str
    veth: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: in its namespace, with its hostname and its /etc/hosts."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.name,
            *argv,
        ]

    def command_keeping_mounts(self, argv: Sequence[str]) -> list[str]:
        """As :meth:`command`, but with this machine's other mounts: ``ip netns exec`` remounts ``/sys``,
        which hides ``/sys/fs/cgroup`` (slurmd will not start without it)."""
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespace}",
            "unshare",
            "--mount",
            "--uts",
            "--",
            "sh",
            "-c",
            'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
            self.name,
            str(_NETNS_ETC / self.namespace / "hosts"),
            *argv,
        ]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, veth, bridge): run the tests as root"
    missing = [b for b in ("ip", "unshare", "sh") if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2 / util-linux)"
    probe = f"{_PREFIX}-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode:
            return f"cannot create a network namespace here: {made.stderr.strip()}"
        run = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "--", "true"], capture_output=True, text=True, timeout=30
        )
        if run.returncode:
            return f"cannot run in a namespace with its own hostname here: {run.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Remove namespaces, bridges and /etc/netns entries left by test processes that no longer exist."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        m = re.fullmatch(rf"{_PREFIX}-(\d+)-\d+-h\d+", name)
        if m and not _alive(int(m.group(1))):
            _kill_namespace(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)
    links = _ip("-o", "link", "show", check=False).stdout
    for name in re.findall(r"^\d+: (ds[bv][0-9a-f]+g[0-9a-f]+(?:x\d+)?)[@:]", links, re.M):
        pid = int(re.match(r"ds[bv]([0-9a-f]+)g", name).group(1), 16)  # type: ignore[union-attr]
        if not _alive(pid):
            _ip("link", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(namespace: str) -> None:
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


#: the networks namespace hosts are given: eth0 of ``Hosts`` (``<HOSTS_PREFIX>.11``, ``.12``, ...) and the
#: ``second_interface`` veth (``<SIDE_PREFIX>.<i>.1/24``, which reaches nothing); tests/test_network_rule.py
#: allows these (and only these) addresses in the files that make hosts
HOSTS_PREFIX = "192.168.77"
SIDE_PREFIX = "10.99"
NETWORKS = (ipaddress.ip_network(f"{HOSTS_PREFIX}.0/24"), ipaddress.ip_network(f"{SIDE_PREFIX}.0.0/16"))


@dataclass
class Hosts:
    """``n`` hosts named ``host1..hostN`` at ``192.168.77.11..``; a context manager that cleans everything up."""

    n: int
    loopback_hostname: Sequence[int] = ()
    extra_hosts: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    second_interface: Sequence[int] = ()
    subnet: str = HOSTS_PREFIX
    hosts: list[Host] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        n = next(_counter)
        pid = os.getpid()
        self._tag = f"{pid}-{n}"
        self.bridge = f"dsb{pid:x}g{n:x}"
        self._procs: list[subprocess.Popen] = []
        self._logs = Path(tempfile.mkdtemp(prefix="distrib-hosts-"))
        for i in range(self.n):
            self.hosts.append(
                Host(
                    i, f"host{i + 1}", f"{self.subnet}.{11 + i}", f"{_PREFIX}-{self._tag}-h{i}", f"dsv{pid:x}g{n:x}x{i}"
                )
            )

    def __enter__(self) -> Hosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def start(self) -> None:
        remove_stale()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            inside = ("netns", "exec", host.namespace, "ip")
            _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")
            if host.index in self.second_interface:
                _ip(*inside, "link", "add", "side0", "type", "veth", "peer", "name", "side1")
                _ip(*inside, "addr", "add", f"{SIDE_PREFIX}.{host.index}.1/24", "dev", "side0")
                _ip(*inside, "link", "set", "side0", "up")
                _ip(*inside, "link", "set", "side1", "up")
            etc = _NETNS_ETC / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts_file(host.index))

    def hosts_file(self, index: int) -> str:
        """The /etc/hosts that host ``index`` sees."""
        lines = ["127.0.0.1 localhost"]
        for other in self.hosts:
            own_loopback = other.index == index and index in self.loopback_hostname
            lines.append(f"{'127.0.1.1' if own_loopback else other.address} {other.name}")
        lines += [f"{address} {name}" for name, address in self.extra_hosts.get(index, {}).items()]
        return "\n".join(lines) + "\n"

    def popen(self, index: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` on host ``index`` (own process group, output to a file); stopped by ``close()``."""
        log = open(self._logs / f"h{index}-{len(self._procs)}.log", "w+")
        # the launcher variables of the test's own process describe no cluster of these hosts
        full_env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM")}
        full_env.update(env or {})
        proc = subprocess.Popen(
            self.hosts[index].command(argv),
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        proc.log = log  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    @staticmethod
    def output(proc: subprocess.Popen) -> str:
        log = proc.log  # type: ignore[attr-defined]
        log.flush()
        log.seek(0)
        return log.read()

    def wait(self, proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
        """``(exit status, output)`` within ``timeout`` s; on overrun its group is killed and the status is -9."""
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            return -9, self.output(proc) + f"\n[killed after {timeout}s]"
        return code, self.output(proc)

    def stop(self, proc: subprocess.Popen, timeout: float = 10) -> tuple[int, str]:
        """SIGTERM ``proc``'s group, wait at most ``timeout`` s (then SIGKILL): ``(exit status, output)``."""
        _kill_group(proc, signal.SIGTERM)
        return self.wait(proc, timeout)

    def close(self) -> None:
        for proc in self._procs:
            _kill_group(proc)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            proc.log.close()  # type: ignore[attr-defined]
        for host in self.hosts:
            _kill_namespace(host.namespace)
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.namespace, check=False)
            shutil.rmtree(_NETNS_ETC / host.namespace, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self._logs, ignore_errors=True)
        self._procs.clear()


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def leftovers() -> list[str]:
    """This process's namespaces, bridges, veths and /etc/netns entries that still exist (for tests)."""
    pid = os.getpid()
    names = [n for n in _ip("netns", "list", check=False).stdout.split() if n.startswith(f"{_PREFIX}-{pid}-")]
    links = re.findall(
        rf"^\d+: (ds[bv]{pid:x}g[0-9a-f]+(?:x\d+)?)[@:]", _ip("-o", "link", "show", check=False).stdout, re.M
    )
    etc = [p.name for p in _NETNS_ETC.glob(f"{_PREFIX}-{pid}-*")] if _NETNS_ETC.exists() else []
    return names + links + etc
