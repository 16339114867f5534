"""Multi-worker benchmark: scaling, step time against raw DDP, and all-reduce throughput.

    python benchmarks/multi_worker.py [--steps 60] [--rounds 5] [--json out.json]

One run measures, on the seed CNN (Fashion-MNIST shapes, batch 64 per worker, Adam):

(a) scaling: examples/s of 2 workers x 1 thread against 1 worker x 1 thread
    (efficiency = throughput_2 / (2 x throughput_1); target >= 0.90). Each round
    first times worker 0 alone (worker 1 waits at a barrier), then both, so the
    ratio compares like with like on a noisy machine; raw DDP's is printed too;
(b) step time of distrib's MultiWorkerMirroredStrategy loop against a raw
    DistributedDataParallel loop on the same 2 workers, same model and batch,
    interleaved round by round (target ratio <= 1.05);
(c) all-reduce throughput of a 25 MB gradient set through distrib's bucketed
    reducer against a bare torch.distributed.all_reduce of one 25 MB tensor
    (target ratio >= 0.95).

Workers are real processes talking gloo over loopback. Figures are medians over
rounds; the machine is small and noisy, so only ratios within this run mean much.
Prints a JSON object and a short table.
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

from typing import Any, Callable

import torch
import torch.nn.functional as F

HERE = os.path.abspath(__file__)


def _cnn() -> torch.nn.Module:
    from distrib.app.models import fashion_mnist_cnn

    return fashion_mnist_cnn()


def _batches(n: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def _distrib_loop(strategy, batch: int, global_batch: int) -> Callable[[Any], None]:  # type: ignore[no-untyped-def]
    import distrib as ds

    with strategy.scope():
        torch.manual_seed(0)
        model = _cnn()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(inputs):  # type: ignore[no-untyped-def]
        x, y = inputs
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=global_batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return lambda b: strategy.run(step, args=(b,))


def _ddp_loop() -> Callable[[Any], None]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_cnn())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b):  # type: ignore[no-untyped-def]
        x, y = b
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _time(step: Callable[[Any], None], data: list, barrier: Callable[[], None]) -> float:
    """Seconds per step over ``data``, after a warm-up of 10 steps; all workers start and stop together."""
    for b in data[:10]:
        step(b)
    barrier()
    start = time.perf_counter()
    for b in data[10:]:
        step(b)
    barrier()
    return (time.perf_counter() - start) / (len(data) - 10)


def _allreduce_throughput(strategy, rounds: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """GB/s for 25 MB of float32 gradients: distrib's reducer in steady state (gradients already
    live in its buckets, as after the first step), the reducer cold (gradients copied in), and a
    bare all_reduce of one flat tensor."""
    import torch.distributed as dist

    from distrib.comm.gradient_reducer import BucketedGradientReducer

    numel = 25_000_000 // 4
    sizes = (numel // 2, numel // 4, numel // 8, numel - numel // 2 - numel // 4 - numel // 8)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    reducer = BucketedGradientReducer(params, strategy.communicator, strategy.communication_options.bucket_bytes)
    flat = torch.ones(numel)
    steady, cold, bare = [], [], []
    for r in range(rounds + 1):
        for p in params:
            p.grad = torch.ones_like(p)  # freshly allocated, as after zero_grad(set_to_none=True)
        dist.barrier()
        t = time.perf_counter()
        reducer.finish()
        cold.append(time.perf_counter() - t)
        reducer.discard()
        for p in params:
            p.grad.fill_(1.0)  # accumulated in place into the bucket, as backward does after step 1
        dist.barrier()
        t = time.perf_counter()
        reducer.finish()
        steady.append(time.perf_counter() - t)
        reducer.discard()
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(flat)
        bare.append(time.perf_counter() - t)
    gb = numel * 4 / 1e9
    return (gb / statistics.median(steady[1:]), gb / statistics.median(cold[1:]), gb / statistics.median(bare[1:]))


def worker(args: argparse.Namespace) -> None:
    """Round after round: worker 0 alone (worker 1 waits), then both with distrib, then both with raw DDP."""
    torch.set_num_threads(1)
    import distrib as ds

    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.CommunicationOptions(bytes_per_pack=args.bytes_per_pack))
    import torch.distributed as dist

    loops = {"solo_step_s": _distrib_loop(ds.OneDeviceStrategy("cpu"), 64, 64) if strategy.is_chief else None,
             "distrib_step_s": _distrib_loop(strategy, 64, 64 * strategy.num_replicas_in_sync),
             "ddp_step_s": _ddp_loop()}
    data = _batches(args.steps + 10, 64, strategy.worker_index)
    results: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(args.rounds):
        if strategy.is_chief:
            results["solo_step_s"].append(_time(loops["solo_step_s"], data, lambda: None))
        strategy.barrier()
        order = ["distrib_step_s", "ddp_step_s"] if r % 2 == 0 else ["ddp_step_s", "distrib_step_s"]
        for name in order:  # alternate, so neither always goes first
            results[name].append(_time(loops[name], data, dist.barrier))
    steady, cold, bare = _allreduce_throughput(strategy, args.rounds)
    results["reducer_gbps"], results["reducer_cold_gbps"], results["allreduce_gbps"] = [steady], [cold], [bare]
    if strategy.is_chief:
        with open(args.out, "w") as f:
            json.dump(results, f)


def _run_cluster(workers: int, args: argparse.Namespace, out: str) -> dict[str, list[float]]:
    from distrib.cluster.launch import make_cluster

    cluster = make_cluster(workers, 0, False)
    procs = []
    for i in range(workers):
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
        cmd = [sys.executable, HERE, "--worker", "--out", out, "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--bytes-per-pack", str(args.bytes_per_pack)]
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait(timeout=1200) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(codes):
        raise SystemExit(f"benchmark workers failed: exit codes {codes}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes-per-pack", type=int, default=0, help="gradient bucket size (0: distrib's default)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        raw = _run_cluster(2, args, os.path.join(tmp, "two.json"))
    med = {k: statistics.median(v) for k, v in raw.items()}
    efficiency = [s / d for s, d in zip(raw["solo_step_s"], raw["distrib_step_s"])]  # (128/d) / (2 * 64/s)
    ddp_ratio = [d / r for d, r in zip(raw["distrib_step_s"], raw["ddp_step_s"])]
    ddp_efficiency = [s / r for s, r in zip(raw["solo_step_s"], raw["ddp_step_s"])]
    result = {
        "workers_1_examples_per_s": 64 / med["solo_step_s"],
        "workers_2_examples_per_s": 128 / med["distrib_step_s"],
        "scaling_efficiency": statistics.median(efficiency),
        "ddp_scaling_efficiency": statistics.median(ddp_efficiency),
        "distrib_step_ms": med["distrib_step_s"] * 1e3,
        "ddp_step_ms": med["ddp_step_s"] * 1e3,
        "step_time_vs_ddp": statistics.median(ddp_ratio),
        "reducer_gb_per_s": med["reducer_gbps"],
        "reducer_cold_gb_per_s": med["reducer_cold_gbps"],
        "allreduce_gb_per_s": med["allreduce_gbps"],
        "allreduce_throughput_ratio": med["reducer_gbps"] / med["allreduce_gbps"],
        "cold_throughput_ratio": med["reducer_cold_gbps"] / med["allreduce_gbps"],
        "rounds": args.rounds, "steps_per_round": args.steps,
        "raw": raw,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    rows = [("(a) scaling efficiency, 2 workers vs 1", result["scaling_efficiency"], ">= 0.90"),
            ("(b) step time, distrib / raw DDP", result["step_time_vs_ddp"], "<= 1.05"),
            ("(c) 25 MB all-reduce throughput, distrib / bare", result["allreduce_throughput_ratio"], ">= 0.95")]
    print(f"\n{'measure':<50}{'median':>10}  target")
    for name, value, target in rows:
        print(f"{name:<50}{value:>10.3f}  {target}")


if __name__ == "__main__":
    main()
