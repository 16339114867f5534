"""Multi-worker benchmark: throughput with and without gradient compression, and where each step's time goes.

    python benchmarks/multi_worker.py [--steps 60] [--rounds 5] [--json out.json]

The workload is issue 12's (seed 001's tutorial): the CNN Conv32-Flatten-Dense128-Dense10
(2.77 M parameters: 11 MB of fp32 gradients a step), Keras' RMSprop, 64 examples per
worker, one torch thread per worker, 2 workers talking gloo over loopback. One run measures,
round after round (the order of the 2-worker settings rotates every round; figures are
medians over rounds, ratios are taken within a round):

* ``solo``: the plain 1-worker PyTorch loop (no distrib), worker 0 alone while worker 1
  waits at a barrier: the scale for "twice one worker";
* ``pair``: the plain loop on both workers at once, exchanging nothing: what two processes
  on this machine reach with no communication at all (the ceiling of any scaling);
* ``ddp``: raw ``DistributedDataParallel`` (fp32, its built-in C++ all-reduce);
* ``ddp_timed``: the same with a timing comm hook, for the breakdown only;
* ``fp32``, ``bf16``, ``fp16``, ``powersgd``: distrib's MultiWorkerMirroredStrategy with
  ``CommunicationOptions(compression=None / "bf16" / "fp16" / ds.PowerSGD(rank=2, start_iter=10))``.

Targets (issue 12): bf16 >= 1.25x raw DDP's throughput; PowerSGD rank 2 >= 0.9 of twice
the solo loop's.

Where the time goes, per step and per worker (mean of the 2 workers), measured: distrib's
comm hook is wrapped so every collective records when it was launched and how long the
training thread was blocked waiting for it; the hook's own time minus that is
*compression* (casting, PowerSGD's products and orthogonalisation, error feedback).
Blocked time splits into *waiting* (until the peer launched the same collective; both
processes read the same monotonic clock) and *wire* (the rest, plus launching).
*Compute* is everything else: forward, backward, optimizer, framework. For DDP the
blocked time is from its last bucket's launch to the end of ``backward()``.

CPU time: each worker's user + system CPU seconds per step (every thread: gloo's included, and
over loopback the kernel's copying of the bytes is system time of the two processes). On a
loaded machine wall time mostly measures the scheduler; the CPU time is what an idle machine
with one core per worker would need per step (less the waits), so the ratios of CPU times
(``cpu_vs_raw_ddp``, ``cpu_vs_twice_solo``: slower worker's CPU ms per step) are reported too,
labelled as estimates.

Also (as before): 25 MB all-reduce throughput through distrib's reducer against a bare
``all_reduce``. Prints a JSON object and short tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.abspath(__file__)
BATCH = 64
COMPRESSIONS = ("fp32", "bf16", "fp16", "powersgd")
PAIRED = ("pair", "ddp", "ddp_timed", *COMPRESSIONS)  # the settings timed with both workers
now = time.perf_counter  # CLOCK_MONOTONIC: one clock for every process of this machine


def seed001_cnn() -> nn.Module:
    """The model of seed 001 (TF's multi-worker custom-training-loop tutorial), as examples/multi_worker_ctl.py."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 28)),
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 26 * 26, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def rmsprop(params: Any) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-3, alpha=0.9, eps=1e-7)  # Keras' RMSprop


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(BATCH, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(n)]


class Tally:
    """What one timed window recorded: collectives [launch start, launch end, wait start, wait end], hook seconds."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.collectives: list[list[float]] = []
        self.hook_s = 0.0
        self.steps: list[tuple[float, float]] = []  # DDP: (end of backward, last launch end) per step


class Probe:
    """The communicator handed to a comm hook: the strategy's own, timing every all-reduce it runs."""

    def __init__(self, communicator: Any, tally: Tally) -> None:
        self.inner, self.tally = communicator, tally
        self.rank, self.world_size = communicator.rank, communicator.world_size
        self._pending: dict[int, list[float]] = {}

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        start = now()
        future = self.inner.all_reduce_async(tensor)
        record = [start, now(), 0.0, 0.0]
        self.tally.collectives.append(record)
        self._pending[id(future)] = record
        return future

    def owns(self, future: Any) -> bool:
        return id(future) in self._pending

    def wait(self, future: Any) -> Any:
        record = self._pending.pop(id(future))
        record[2] = now()
        value = self.inner.wait(future)
        record[3] = now()
        return value


def timed_hook(hook: Callable[..., Any], probe: Probe) -> Callable[..., Any]:
    """``hook`` run against ``probe``; the time inside it (and inside waiting for its result) is tallied."""
    from distrib.comm import DeferredFuture

    def wrapped(communicator: Any, bucket: Any) -> Any:
        start = now()
        future = hook(probe, bucket)
        probe.tally.hook_s += now() - start

        def finish() -> torch.Tensor:
            start = now()
            value = probe.wait(future) if probe.owns(future) else future.wait()
            probe.tally.hook_s += now() - start
            return value

        return DeferredFuture(finish)

    return wrapped


def plain_loop() -> Callable[[Any], None]:
    torch.manual_seed(0)
    model = seed001_cnn()
    opt = rmsprop(model.parameters())

    def step(b: Any) -> None:
        x, y = b
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def ddp_loop(tally: Tally | None) -> Callable[[Any], None]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(seed001_cnn())
    opt = rmsprop(model.parameters())
    last_launch = [0.0]
    if tally is not None:

        def hook(state: Any, bucket: Any) -> Any:  # torch's default_hooks.allreduce_hook, timed
            start = now()
            tensor = bucket.buffer().div_(dist.get_world_size())
            future = dist.all_reduce(tensor, async_op=True).get_future()
            last_launch[0] = now()
            tally.collectives.append([start, last_launch[0], 0.0, 0.0])
            return future.then(lambda f: f.value()[0])

        # DDP checks the annotations themselves (not strings, as ``from __future__ import annotations`` makes them)
        hook.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        model.register_comm_hook(None, hook)

    def step(b: Any) -> None:
        x, y = b
        F.cross_entropy(model(x), y).backward()
        if tally is not None:
            tally.steps.append((now(), last_launch[0]))
        opt.step()
        opt.zero_grad()

    return step


def distrib_loop(compression: str, tally: Tally) -> Callable[[Any], None]:
    import distrib as ds

    setting = {"fp32": None, "bf16": "bf16", "fp16": "fp16", "powersgd": ds.PowerSGD(rank=2, start_iter=10)}
    options = ds.CommunicationOptions(compression=setting[compression])
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=options)
    strategy.register_comm_hook(timed_hook(options.comm_hook(), Probe(strategy.communicator, tally)))
    with strategy.scope():
        torch.manual_seed(0)
        model = seed001_cnn()
        opt = rmsprop(model.parameters())
    global_batch = BATCH * strategy.num_replicas_in_sync

    def step(inputs: Any) -> None:
        x, y = inputs
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=global_batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return lambda b: strategy.run(step, args=(b,))


def _time(step: Callable[[Any], None], data: list, barrier: Callable[[], None], tally: Tally | None) -> dict:
    """One timed window after 10 warm-up steps: seconds per step (both workers start and end together)
    and this worker's own seconds until its last step ended, with what the tally recorded meanwhile."""
    for b in data[:10]:
        step(b)
    barrier()
    if tally is not None:
        tally.reset()
    start, cpu = now(), time.process_time()
    for b in data[10:]:
        step(b)
    own, cpu = now() - start, time.process_time() - cpu
    barrier()
    total = now() - start
    steps = len(data) - 10
    record: dict = {"step_s": total / steps, "own_step_s": own / steps, "cpu_step_s": cpu / steps, "steps": steps}
    if tally is not None:
        record.update(collectives=tally.collectives, hook_s=tally.hook_s, ddp_steps=tally.steps)
        tally.reset()
    return record


def worker(args: argparse.Namespace) -> None:
    """Round after round: the solo loop on worker 0 (worker 1 waits), then every paired setting, rotated."""
    torch.set_num_threads(1)
    import distrib as ds

    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.CommunicationOptions(bytes_per_pack=args.bytes_per_pack)
    )
    import torch.distributed as dist

    tallies = {name: Tally() for name in ("ddp_timed", *COMPRESSIONS)}
    loops: dict[str, Callable[[Any], None]] = {
        "pair": plain_loop(),
        "ddp": ddp_loop(None),
        "ddp_timed": ddp_loop(tallies["ddp_timed"]),
    }
    for name in COMPRESSIONS:
        loops[name] = distrib_loop(name, tallies[name])
    solo = plain_loop() if strategy.is_chief else None
    data = _batches(args.steps + 10, strategy.worker_index)
    results: dict[str, list[dict]] = {name: [] for name in ("solo", *PAIRED)}
    for r in range(args.rounds):
        if solo is not None:
            results["solo"].append(_time(solo, data, lambda: None, None))
        strategy.barrier()
        order = PAIRED[r % len(PAIRED) :] + PAIRED[: r % len(PAIRED)]  # rotate: no setting always goes first
        for name in order:
            results[name].append(_time(loops[name], data, dist.barrier, tallies.get(name)))
    throughput = _allreduce_throughput(strategy, args.rounds)
    everyone = strategy.communicator.all_gather_object(results)
    if strategy.is_chief:
        with open(args.out, "w") as f:
            json.dump({"workers": everyone, "allreduce": throughput}, f)


def _allreduce_throughput(strategy: Any, rounds: int) -> dict[str, float]:
    """GB/s for 25 MB of fp32 gradients: distrib's reducer in steady state (gradients already in its
    buckets), cold (gradients copied in), and a bare all_reduce of one flat tensor."""
    import torch.distributed as dist

    from distrib.comm.gradient_reducer import BucketedGradientReducer

    numel = 25_000_000 // 4
    sizes = (numel // 2, numel // 4, numel // 8, numel - numel // 2 - numel // 4 - numel // 8)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    reducer = BucketedGradientReducer(params, strategy.communicator, strategy.communication_options.bucket_bytes)
    flat = torch.ones(numel)
    steady, cold, bare = [], [], []
    for _ in range(rounds + 1):
        for p in params:
            p.grad = torch.ones_like(p)
        dist.barrier()
        t = now()
        reducer.finish()
        cold.append(now() - t)
        reducer.discard()
        for p in params:
            assert p.grad is not None
            p.grad.fill_(1.0)
        dist.barrier()
        t = now()
        reducer.finish()
        steady.append(now() - t)
        reducer.discard()
        dist.barrier()
        t = now()
        dist.all_reduce(flat)
        bare.append(now() - t)
    gb = numel * 4 / 1e9
    return {
        "reducer_gb_per_s": gb / statistics.median(steady[1:]),
        "reducer_cold_gb_per_s": gb / statistics.median(cold[1:]),
        "allreduce_gb_per_s": gb / statistics.median(bare[1:]),
    }


def breakdown(windows: list[dict], name: str) -> dict[str, float]:
    """ms per step of compute / compression / wire / waiting, mean over the workers, median over rounds.

    ``windows[w]`` is worker w's list of rounds for this setting.
    """
    per_round = []
    for r in range(len(windows[0])):
        rounds = [w[r] for w in windows]
        parts = {"compute": 0.0, "compression": 0.0, "wire": 0.0, "waiting": 0.0}
        for mine in rounds:
            own = mine["own_step_s"] * mine["steps"]
            if name == "ddp_timed":  # blocked: from the step's last launch to the end of backward
                ends = [rd["ddp_steps"] for rd in rounds]
                for i, (bwd_end, launched) in enumerate(mine["ddp_steps"]):
                    peer_launch = max(e[i][1] for e in ends)
                    blocked = max(0.0, bwd_end - launched)
                    waiting = min(blocked, max(0.0, peer_launch - launched))
                    parts["waiting"] += waiting
                    parts["wire"] += blocked - waiting
                parts["compute"] += own - sum(max(0.0, b - la) for b, la in mine["ddp_steps"])
                continue
            if "collectives" not in mine:  # solo, pair: nothing but compute
                parts["compute"] += own
                continue
            communication = 0.0
            for i, (l0, l1, w0, w1) in enumerate(mine["collectives"]):
                peer_launched = max(rd["collectives"][i][1] for rd in rounds)
                blocked = w1 - w0
                waiting = min(blocked, max(0.0, peer_launched - w0))
                parts["waiting"] += waiting
                parts["wire"] += (blocked - waiting) + (l1 - l0)
                communication += blocked + (l1 - l0)
            parts["compression"] += mine["hook_s"] - communication
            parts["compute"] += own - mine["hook_s"]
        per_round.append({k: v / len(rounds) / rounds[0]["steps"] * 1e3 for k, v in parts.items()})
    return {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}


def run_tf_config_workers(script: str, argv: list[str], out: str, workers: int = 2) -> dict:
    """Run ``script --worker --out OUT ARGV`` as ``workers`` processes of one TF_CONFIG cluster (one torch
    thread each, loopback); every process must exit 0; returns the JSON the chief wrote to ``out``."""
    from distrib.cluster.launch import make_cluster

    cluster = make_cluster(workers, 0, False)
    procs = []
    for i in range(workers):
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, script, "--worker", "--out", out, *argv], env=env))
    try:
        codes = [p.wait(timeout=3600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(codes):
        raise SystemExit(f"{os.path.basename(script)} workers failed: exit codes {codes}")
    with open(out) as f:
        return json.load(f)


def cpu(workers: list, chief: dict, name: str, r: int) -> float:
    """CPU seconds (user + system, every thread of the process) of the slower worker's step in round ``r``."""
    return max(w[name][r]["cpu_step_s"] for w in (workers if name != "solo" else [chief]))


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    workers = raw["workers"]
    chief = workers[0]
    step = {name: [r["step_s"] for r in chief[name]] for name in chief}
    solo = step["solo"]

    def per_round(fn: Callable[[int], float]) -> float:
        return statistics.median(fn(r) for r in range(args.rounds))

    settings = {}
    for name in ("solo", *PAIRED):
        examples = BATCH * (1 if name == "solo" else 2)
        settings[name] = {
            "examples_per_s": per_round(lambda r: examples / step[name][r]),
            "step_ms": per_round(lambda r: step[name][r] * 1e3),
            "vs_raw_ddp": per_round(lambda r: (examples / step[name][r]) / (2 * BATCH / step["ddp"][r])),
            "vs_twice_solo": per_round(lambda r: (examples / step[name][r]) / (2 * BATCH / solo[r])),
            "ms_per_step": breakdown([w[name] for w in workers] if name != "solo" else [chief[name]], name),
            "cpu_ms_per_step": per_round(
                lambda r: max(w[name][r]["cpu_step_s"] for w in (workers if name != "solo" else [chief])) * 1e3
            ),
        }
    for name in settings:  # what the CPU time alone predicts (an idle machine, one core per worker)
        settings[name]["cpu_vs_raw_ddp"] = per_round(
            lambda r: cpu(workers, chief, "ddp", r) / cpu(workers, chief, name, r) * (1 if name != "solo" else 0.5)
        )
        settings[name]["cpu_vs_twice_solo"] = per_round(
            lambda r: cpu(workers, chief, "solo", r) / cpu(workers, chief, name, r) * (1 if name != "solo" else 0.5)
        )
    return {
        "machine": f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}",
        "settings": settings,
        "targets": {
            "bf16_vs_raw_ddp": {
                "median": settings["bf16"]["vs_raw_ddp"],
                "target": 1.25,
                "cpu_time_estimate": settings["bf16"]["cpu_vs_raw_ddp"],
            },
            "powersgd_vs_twice_solo": {
                "median": settings["powersgd"]["vs_twice_solo"],
                "target": 0.9,
                "cpu_time_estimate": settings["powersgd"]["cpu_vs_twice_solo"],
            },
        },
        "allreduce": {
            **raw["allreduce"],
            "throughput_ratio": raw["allreduce"]["reducer_gb_per_s"] / raw["allreduce"]["allreduce_gb_per_s"],
        },
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "raw_step_s": {name: step[name] for name in step},
    }


def print_tables(result: dict) -> None:
    print(
        f"\n{'setting':<11}{'examples/s':>11}{'step ms':>9}{'/raw DDP':>9}{'/2x solo':>9}   "
        f"{'compute':>8}{'compress':>9}{'wire':>7}{'waiting':>8}  (ms per step, mean of workers)"
        f"{'CPU ms':>8}{'/DDP':>6}{'/2xsolo':>8} (CPU time)"
    )
    for name, s in result["settings"].items():
        b = s["ms_per_step"]
        print(
            f"{name:<11}{s['examples_per_s']:>11.0f}{s['step_ms']:>9.1f}{s['vs_raw_ddp']:>9.2f}{s['vs_twice_solo']:>9.2f}   "
            f"{b['compute']:>8.1f}{b['compression']:>9.1f}{b['wire']:>7.1f}{b['waiting']:>8.1f}"
            f"{'':>32}{s['cpu_ms_per_step']:>8.1f}{s['cpu_vs_raw_ddp']:>6.2f}{s['cpu_vs_twice_solo']:>8.2f}"
        )
    print(f"\n{'target':<40}{'median':>8}  target   CPU-time estimate")
    for name, t in result["targets"].items():
        print(f"{name:<40}{t['median']:>8.3f}  >= {t['target']:<5}  {t['cpu_time_estimate']:.3f}")
    print(f"{'25 MB all-reduce, distrib reducer / bare':<40}{result['allreduce']['throughput_ratio']:>8.3f}  >= 0.95")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="timed steps per setting and round (after 10 warm-up steps)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes-per-pack", type=int, default=0, help="gradient bucket size (0: distrib's default)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        raw = run_tf_config_workers(
            HERE,
            ["--steps", str(args.steps), "--rounds", str(args.rounds), "--bytes-per-pack", str(args.bytes_per_pack)],
            os.path.join(tmp, "two.json"),
        )
    result = summarize(raw, args)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print_tables(result)


if __name__ == "__main__":
    main()
