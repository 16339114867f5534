"""Beyond loopback: 2-4 workers, each in its own network namespace, over shaped links.

    sudo python benchmarks/multi_host.py [--workers 2 4] [--rates 1gbit 10gbit] [--delay-ms 0.2]
                                         [--compressions none bf16 powersgd] [--steps 20] [--rounds 5] [--json out.json]

Each worker is a "host": a Linux network namespace with its own ``eth0`` (a veth pair) and its
own hostname. The other ends of the veths sit on a bridge inside one more namespace (the
"switch"), so no address exists in the root namespace and every byte stays inside the
namespaces this script makes. Every link is shaped in both directions with ``tc``: a token
bucket (``tbf``) at the given rate on the host's ``eth0`` (what it sends) and on its switch
port (what it receives), plus ``netem`` delay when the kernel has it (when it does not, the
JSON says so and the links have only the veths' own latency). Before training, the link is
measured with one TCP stream host1 -> host2 (``link_gbit_per_s``) and a one-byte TCP echo
(``rtt_ms``, the median round trip).

Per cluster size W and rate, W worker processes (1 torch thread each) run seed 001's CNN
workload (Conv32-Flatten-Dense128-Dense10, Keras' RMSprop, 64 examples per worker, 11 MB of
fp32 gradients a step) round after round, the settings rotated every round:

* ``solo``: the plain PyTorch loop on worker 0 while the others wait (no communication): the
  unit of scaling; ``ceiling``: the plain loop on all W workers at once, exchanging nothing
  (with W processes on this machine's cores it shows what CPU sharing alone costs);
* ``none`` / ``bf16`` / ``fp16`` / ``powersgd``: MultiWorkerMirroredStrategy with
  ``CommunicationOptions(compression=None | "bf16" | "fp16" | ds.PowerSGD(rank=2, start_iter=10))``.

Reported (medians over rounds): global examples/s, ``efficiency`` = examples/s / (W x solo's),
``vs_ceiling`` = examples/s / ceiling's (scaling lost to the network alone), and a bare
all-reduce of the step's gradient bytes (11 MB fp32, 5.5 MB bf16). Prints JSON and a table.

Cleanup: every namespace, its processes and its links are removed at the end, on an error
and on Ctrl-C/SIGTERM; namespaces left by a run that was SIGKILLed are removed by the next
run (they carry the dead process's id). Needs root, ``ip`` and ``tc`` (iproute2), ``unshare``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.abspath(__file__)
PREFIX = "dsmh"  # namespaces dsmh-<pid>-<tag>-{sw,h<i>}
BATCH = 64
PORT = 29411
now = time.perf_counter


# ============================================================================ namespaces and links
def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _in(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", ns, *argv, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", ns, check=False)  # its veths go with it (and their peers)


def remove_stale() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone (a SIGKILLed run cannot clean up)."""
    removed = []
    for ns in _run("ip", "netns", "list", check=False).stdout.split():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-[\w-]+", ns)
        if m and not _alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def unavailable() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root: run it as root (sudo python benchmarks/multi_host.py)"
    missing = [b for b in ("ip", "tc", "unshare") if shutil.which(b) is None]
    return f"missing {', '.join(missing)} (iproute2, util-linux)" if missing else None


def _qdisc(ns: str, dev: str, rate: str, delay_ms: float, use_netem: bool) -> None:
    """Shape ``dev``'s egress: a token bucket at ``rate`` (a burst of 1 ms of traffic), then netem's delay."""
    bits = _rate_bits(rate)
    burst = max(32 * 1024, int(bits / 8 / 1000))  # 1 ms at the rate; at least a few 9000-byte packets
    _in(
        ns,
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "handle",
        "1:",
        "tbf",
        "rate",
        rate,
        "burst",
        str(burst),
        "latency",
        "20ms",
    )
    if use_netem and delay_ms > 0:
        _in(
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "parent",
            "1:1",
            "handle",
            "10:",
            "netem",
            "delay",
            f"{delay_ms}ms",
            "limit",
            "100000",
        )


def _rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"--rates {rate!r}: write a tc rate such as 1gbit, 10gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def netem_available() -> bool:
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
        _in(probe, "ip", "link", "add", "va", "type", "veth", "peer", "name", "vb")
        return (
            _in(probe, "tc", "qdisc", "add", "dev", "va", "root", "netem", "delay", "1ms", check=False).returncode == 0
        )
    finally:
        _delete_namespace(probe)


class Network:
    """A switch namespace with a bridge and ``n`` host namespaces, each linked to it by a shaped veth.

    A context manager: leaving it (normally, on an error, on Ctrl-C) deletes everything it made.
    """

    def __init__(self, n: int, rate: str, delay_ms: float, use_netem: bool, tag: str) -> None:
        self.n, self.rate, self.delay_ms, self.use_netem = n, rate, delay_ms, use_netem
        base = f"{PREFIX}-{os.getpid()}-{tag}"
        self.switch = f"{base}-sw"
        self.hosts = [f"{base}-h{i}" for i in range(n)]
        self.addresses = [f"10.77.0.{11 + i}" for i in range(n)]
        self.made: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Network:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.switch, "ip", "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.hosts, self.addresses)):
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            port = f"p{i}"
            _in(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _in(self.switch, "ip", "link", "set", port, "master", "br0")
            _in(self.switch, "ip", "link", "set", port, "up")
            _in(ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _in(ns, "ip", "link", "set", "eth0", "up")
            _in(ns, "ip", "link", "set", "lo", "up")
            _qdisc(ns, "eth0", self.rate, self.delay_ms, self.use_netem)  # host -> switch
            _qdisc(self.switch, port, self.rate, self.delay_ms, self.use_netem)  # switch -> host

    def popen(self, i: int, argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
        """Run ``argv`` on host ``i`` (its namespace, its own hostname ``host<i+1>``), in its own process group."""
        cmd = [
            "ip",
            "netns",
            "exec",
            self.hosts[i],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            f"host{i + 1}",
            *argv,
        ]
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def ping_ms(self, count: int = 50) -> float | None:
        """Median TCP round trip host1 -> host2 -> host1 of one byte, in ms (a small Python echo)."""
        if self.n < 2:
            return None
        echo = (
            "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{self.addresses[1]}',{PORT + 2}));s.listen(1);c,_=s.accept()\n"
            "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
            "while True:\n b=c.recv(1)\n if not b: break\n c.sendall(b)"
        )
        client = (
            "import socket,time,statistics\nfor _ in range(100):\n try:\n"
            f"  c=socket.create_connection(('{self.addresses[1]}',{PORT + 2}));break\n"
            " except OSError: time.sleep(0.05)\n"
            "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);t=[]\n"
            f"for _ in range({count}):\n a=time.perf_counter();c.sendall(b'x');c.recv(1);t.append(time.perf_counter()-a)\n"
            "print(statistics.median(t)*1e3)"
        )
        return self.exchange(echo, client, report="client")

    def exchange(self, server: str, client: str, report: str) -> float | None:
        """Run Python ``server`` on host 2 and ``client`` on host 1 (each ``python -c``), wait for both (60 s
        each), and return the number the ``report``-ing side ("server" or "client") printed last (None: none)."""
        with tempfile.TemporaryFile("w+") as log_s, tempfile.TemporaryFile("w+") as log_c:
            s = self.popen(1, [sys.executable, "-c", server], dict(os.environ), log_s)
            c = self.popen(0, [sys.executable, "-c", client], dict(os.environ), log_c)
            try:
                c.wait(timeout=60)
                s.wait(timeout=60)
            except subprocess.TimeoutExpired:
                return None
            log = log_s if report == "server" else log_c
            log.seek(0)
            lines = log.read().strip().splitlines()
        try:
            return float(lines[-1])
        except (IndexError, ValueError):
            return None

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        for ns in reversed(self.made):
            _delete_namespace(ns)
        self.made.clear()

    def leftovers(self) -> list[str]:
        listed = set(_run("ip", "netns", "list", check=False).stdout.split())
        return [ns for ns in [self.switch, *self.hosts] if ns in listed]


# ============================================================================ the workers
def worker(args: argparse.Namespace) -> None:
    """Round after round: solo (worker 0), ceiling (all, no communication), every compression; rotated."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from multi_worker import rmsprop, seed001_cnn  # benchmarks/ is on sys.path

    import distrib as ds

    torch.set_num_threads(1)
    settings: dict[str, Any] = {
        "none": None,
        "bf16": "bf16",
        "fp16": "fp16",
        "powersgd": ds.PowerSGD(rank=2, start_iter=10),
    }
    base = ds.MultiWorkerMirroredStrategy()  # the group; every other strategy joins it
    rank, world = base.worker_index, base.num_workers

    def plain() -> Callable[[Any], None]:
        torch.manual_seed(0)
        model = seed001_cnn()
        opt = rmsprop(model.parameters())

        def step(b: Any) -> None:
            F.cross_entropy(model(b[0]), b[1]).backward()
            opt.step()
            opt.zero_grad()

        return step

    def distributed(name: str) -> Callable[[Any], None]:
        strategy = ds.MultiWorkerMirroredStrategy(
            communication_options=ds.CommunicationOptions(compression=settings[name])
        )
        with strategy.scope():
            torch.manual_seed(0)
            model = seed001_cnn()
            opt = rmsprop(model.parameters())

        def step(inputs: Any) -> None:
            x, y = inputs
            ds.compute_average_loss(
                F.cross_entropy(model(x), y, reduction="none"), global_batch_size=BATCH * world
            ).backward()
            opt.step()
            opt.zero_grad()

        return lambda b: strategy.run(step, args=(b,))

    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.rand(BATCH, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(args.steps + 5)
    ]
    loops = {"ceiling": plain(), **{name: distributed(name) for name in args.compressions}}
    solo = plain() if rank == 0 else None
    paired = ["ceiling", *args.compressions]

    def window(step: Callable[[Any], None] | None) -> float:
        if step is not None:
            for b in data[:5]:
                step(b)
        dist.barrier()
        start = now()
        if step is not None:
            for b in data[5:]:
                step(b)
        dist.barrier()
        return (now() - start) / args.steps

    results: dict[str, list[float]] = {name: [] for name in ("solo", *paired)}
    for r in range(args.rounds):
        results["solo"].append(window(solo))
        for name in paired[r % len(paired) :] + paired[: r % len(paired)]:
            results[name].append(window(loops[name]))
    allreduce: dict[str, float] = {}
    for label, dtype in (("fp32_11MB", torch.float32), ("bf16_5.5MB", torch.bfloat16)):
        t = torch.ones(2_770_000, dtype=dtype)
        times = []
        for _ in range(5):
            dist.barrier()
            start = now()
            dist.all_reduce(t)
            times.append(now() - start)
        allreduce[label] = statistics.median(times[1:]) * 1e3
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_s": results, "allreduce_ms": allreduce}, f)


# ============================================================================ the driver
def measure_link(net: Network, seconds: float = 1.0) -> float | None:
    """Gbit/s of one TCP stream from host1 to host2 (a small Python sender and receiver)."""
    if net.n < 2:
        return None
    receiver = (
        "import socket,sys,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        f"s.bind(('{net.addresses[1]}',{PORT + 1}));s.listen(1);c,_=s.accept();n=0;t=None\n"
        "while True:\n b=c.recv(1<<20)\n if not b: break\n"
        " t=t or time.perf_counter();n+=len(b)\n"
        "print(n*8/(time.perf_counter()-t)/1e9)"
    )
    sender = (
        "import socket,time\nfor _ in range(100):\n try:\n"
        f"  c=socket.create_connection(('{net.addresses[1]}',{PORT + 1}));break\n except OSError: time.sleep(0.05)\n"
        f"b=bytes(1<<20);end=time.perf_counter()+{seconds}\n"
        "while time.perf_counter()<end: c.sendall(b)\nc.close()"
    )
    return net.exchange(receiver, sender, report="server")


def run_cluster(args: argparse.Namespace, workers: int, rate: str, use_netem: bool) -> dict:
    tag = f"w{workers}{rate}"
    with Network(workers, rate, args.delay_ms, use_netem, tag) as net, tempfile.TemporaryDirectory() as tmp:
        link = measure_link(net)
        rtt = net.ping_ms()
        cluster = {"worker": [f"{a}:{PORT}" for a in net.addresses]}
        out = os.path.join(tmp, "result.json")
        logs = [open(os.path.join(tmp, f"h{i}.log"), "w+") for i in range(workers)]
        procs = []
        for i in range(workers):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            }
            cmd = [
                sys.executable,
                HERE,
                "--worker",
                "--out",
                out,
                "--steps",
                str(args.steps),
                "--rounds",
                str(args.rounds),
                "--compressions",
                *args.compressions,
            ]
            procs.append(net.popen(i, cmd, env, logs[i]))
        deadline = time.monotonic() + args.timeout
        codes: list[int | None] = [None] * workers
        while any(c is None for c in codes) and time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
        if any(c != 0 for c in codes):
            for log in logs:
                log.seek(0)
            tails = "\n".join(f"--- host{i + 1}:\n" + log.read()[-3000:] for i, log in enumerate(logs))
            raise SystemExit(
                f"{workers} workers at {rate}: exit codes {codes} (None: still running after {args.timeout} s)\n{tails}"
            )
        with open(out) as f:
            raw = json.load(f)
        for log in logs:
            log.close()
    return {"workers": workers, "rate": rate, "link_gbit_per_s": link, "rtt_ms": rtt, **raw}


def summarize(raw: dict, compressions: list[str]) -> dict:
    steps, w = raw["step_s"], raw["workers"]
    rounds = len(steps["solo"])

    def med(fn: Callable[[int], float]) -> float:
        return statistics.median(fn(r) for r in range(rounds))

    out: dict[str, Any] = {}
    for name in ("solo", "ceiling", *compressions):
        examples = BATCH * (1 if name == "solo" else w)
        out[name] = {
            "examples_per_s": med(lambda r: examples / steps[name][r]),
            "step_ms": med(lambda r: steps[name][r] * 1e3),
            "efficiency": med(lambda r: examples / steps[name][r] / (w * BATCH / steps["solo"][r])),
            "vs_ceiling": med(lambda r: examples / steps[name][r] / (w * BATCH / steps["ceiling"][r])),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--delay-ms", type=float, default=0.2)
    p.add_argument(
        "--compressions", nargs="+", default=["none", "bf16", "powersgd"], choices=["none", "bf16", "fp16", "powersgd"]
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per window (after 5 warm-up steps)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900, help="seconds one cluster may run")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    reason = unavailable()
    if reason:
        raise SystemExit(f"multi_host.py: {reason}")
    if any(not 2 <= w <= 8 for w in args.workers):
        raise SystemExit(f"--workers {args.workers}: each cluster needs 2 to 8 workers")

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)  # SIGTERM cleans up as Ctrl-C does (the Network's __exit__)
    stale = remove_stale()
    use_netem = netem_available()
    clusters = []
    started = time.time()
    for rate in args.rates:
        for w in args.workers:
            raw = run_cluster(args, w, rate, use_netem)
            raw["settings"] = summarize(raw, args.compressions)
            clusters.append(raw)
            print(f"{w} workers at {rate}: done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    left = [
        ns
        for ns in _run("ip", "netns", "list", check=False).stdout.split()
        if ns.startswith(f"{PREFIX}-{os.getpid()}-")
    ]
    result = {
        "machine": f"{os.cpu_count()} CPUs; load average at the end {os.getloadavg()[0]:.2f}",
        "delay": (
            f"netem {args.delay_ms} ms each way"
            if use_netem
            else "none added: this kernel has no netem qdisc; links have only the veths' own latency (rtt_ms)"
        ),
        "stale_namespaces_removed": stale,
        "namespaces_left": left,
        "clusters": clusters,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(
        f"\n{'W':>2} {'rate':>7} {'link Gb/s':>9} {'setting':<9}{'examples/s':>11}{'step ms':>9}"
        f"{'efficiency':>11}{'vs ceiling':>11}"
    )
    for c in clusters:
        for name, s in c["settings"].items():
            link = f"{c['link_gbit_per_s']:.2f}" if c["link_gbit_per_s"] else "-"
            ratios = f"{s['efficiency']:>11.2f}{s['vs_ceiling']:>11.2f}" if name != "solo" else f"{'-':>11}{'-':>11}"
            print(
                f"{c['workers']:>2} {c['rate']:>7} {link:>9} {name:<9}{s['examples_per_s']:>11.0f}"
                f"{s['step_ms']:>9.1f}{ratios}"
            )
        ar = ", ".join(f"{k} {v:.1f}" for k, v in c["allreduce_ms"].items())
        rtt = f"{c['rtt_ms']:.3f} ms" if c["rtt_ms"] is not None else "-"
        print(f"   bare all-reduce ms: {ar}; TCP round trip {rtt}")


if __name__ == "__main__":
    main()
