"""Parameter-server benchmark: throughput, bytes on the wire, and coordinator overhead.

    python benchmarks/parameter_server.py [--steps 200] [--rounds 3] [--rows 100000] [--json out.json]

One run starts a real cluster on loopback (1 ps and 2 worker processes; this process is
the coordinator) and measures, on a click-through model (8 categorical fields looked up
in one nn.Embedding of ``--rows`` x 16, 4 dense features, a 64-unit MLP; Adagrad; batch
256 drawn on each worker by a per-worker dataset):

(a) steps/s with 1 worker and with 2 workers against the 1 ps (sparse embedding gradients);
(b) bytes a worker sends to (and receives from) the ps per step, with sparse
    (``nn.Embedding(sparse=True)``: only the touched rows travel) and dense gradients;
(c) coordinator overhead per scheduled no-op function: wall time of scheduling and
    joining 2000 no-ops on 2 workers, divided by 2000 (target <= 1 ms), and the time
    of one ``schedule()`` call.

Figures are medians over ``--rounds``. The machine is small and shared, so absolute
numbers move with its load. Prints a JSON object and a short table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.cluster import ClusterSpec, SimpleClusterResolver

FIELDS, DIM, DENSE, BATCH = 8, 16, 4, 256


class ClickThroughModel(nn.Module):
    def __init__(self, rows: int, sparse: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(rows, DIM, sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(FIELDS * DIM + DENSE, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.embedding(ids).flatten(1), dense], 1)).squeeze(1)


def make_dataset_fn(rows: int):  # type: ignore[no-untyped-def]
    def dataset_fn(input_context):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(input_context.input_pipeline_id)
        while True:
            ids = (torch.rand(BATCH, FIELDS, generator=g) ** 3 * rows).long()  # skewed: few hot rows
            dense = torch.randn(BATCH, DENSE, generator=g)
            yield ids, dense, ((ids[:, 0] % 7 == 0) | (dense[:, 0] > 1)).float()

    return dataset_fn


def _strategy(cluster: ds.testing.LocalCluster, workers: int) -> ds.ParameterServerStrategy:
    spec = dict(cluster.cluster, worker=cluster.cluster["worker"][:workers])
    return ds.ParameterServerStrategy(SimpleClusterResolver(ClusterSpec(spec), "chief", 0), token=cluster.token)


def train(cluster: ds.testing.LocalCluster, workers: int, rows: int, sparse: bool, steps: int) -> dict:
    """Steps/s and per-step bytes between the workers and the ps for one configuration."""
    strategy = _strategy(cluster, workers)
    torch.manual_seed(0)
    with strategy.scope():
        model = ClickThroughModel(rows, sparse)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(make_dataset_fn(rows)))

    def step(it):  # type: ignore[no-untyped-def]
        ids, dense, clicks = next(it)
        loss = F.binary_cross_entropy_with_logits(model(ids, dense), clicks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for _ in range(max(5, steps // 10)):  # warm up: functions and datasets reach the workers
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    before = coordinator.worker_stats()
    start = time.perf_counter()
    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - start
    after = coordinator.worker_stats()
    sent = sum(a["ps_bytes_sent"] - b["ps_bytes_sent"] for a, b in zip(after, before))
    received = sum(a["ps_bytes_received"] - b["ps_bytes_received"] for a, b in zip(after, before))
    values = coordinator.fetch(losses)
    coordinator.close()
    return {
        "steps_per_s": steps / seconds,
        "bytes_sent_per_step": sent / steps,
        "bytes_received_per_step": received / steps,
        "last_loss": float(values[-1]),
    }


def noop() -> None:
    return None


def coordinator_overhead(cluster: ds.testing.LocalCluster, n: int) -> dict:
    strategy = _strategy(cluster, 2)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    for _ in range(100):
        coordinator.schedule(noop)
    coordinator.join()
    schedule_times = []
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        coordinator.schedule(noop)
        schedule_times.append(time.perf_counter() - t)
    coordinator.join()
    total = time.perf_counter() - start
    coordinator.close()
    return {"ms_per_noop_function": 1e3 * total / n, "schedule_call_ms": 1e3 * statistics.median(schedule_times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dense-steps", type=int, default=20, help="steps for the dense-gradient byte count")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--noops", type=int, default=2000)
    p.add_argument("--json", default=None, help="also write the JSON here")
    args = p.parse_args()

    rounds: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        rounds.setdefault(name, []).append(value)

    with ds.testing.LocalCluster(num_workers=2, num_ps=1) as cluster:
        cluster.wait_ready(timeout=180)
        for _ in range(args.rounds):
            one = train(cluster, 1, args.rows, sparse=True, steps=args.steps)
            two = train(cluster, 2, args.rows, sparse=True, steps=args.steps)
            dense = train(cluster, 1, args.rows, sparse=False, steps=args.dense_steps)
            over = coordinator_overhead(cluster, args.noops)
            record("steps_per_s_1_worker", one["steps_per_s"])
            record("steps_per_s_2_workers", two["steps_per_s"])
            record("scaling_2_over_1", two["steps_per_s"] / one["steps_per_s"])
            record("sparse_bytes_sent_per_step", one["bytes_sent_per_step"])
            record("sparse_bytes_received_per_step", one["bytes_received_per_step"])
            record("dense_bytes_sent_per_step", dense["bytes_sent_per_step"])
            record("dense_bytes_received_per_step", dense["bytes_received_per_step"])
            record("dense_steps_per_s_1_worker", dense["steps_per_s"])
            record("coordinator_ms_per_noop_function", over["ms_per_noop_function"])
            record("schedule_call_ms", over["schedule_call_ms"])
    result = {
        "config": {
            "rows": args.rows,
            "dim": DIM,
            "fields": FIELDS,
            "batch": BATCH,
            "steps": args.steps,
            "rounds": args.rounds,
            "ps": 1,
            "torch_threads_per_task": 1,
        },
        "median": {k: statistics.median(v) for k, v in rounds.items()},
        "rounds": rounds,
    }
    result["median"]["sparse_vs_dense_bytes_sent"] = (
        result["median"]["sparse_bytes_sent_per_step"] / result["median"]["dense_bytes_sent_per_step"]
    )
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    m = result["median"]
    rows = [
        ("steps/s, 1 worker, 1 ps (sparse embedding)", m["steps_per_s_1_worker"], ""),
        ("steps/s, 2 workers, 1 ps (sparse embedding)", m["steps_per_s_2_workers"], ""),
        ("scaling 2 workers / 1 worker", m["scaling_2_over_1"], ""),
        ("KB sent to ps per step, sparse gradients", m["sparse_bytes_sent_per_step"] / 1e3, ""),
        ("KB sent to ps per step, dense gradients", m["dense_bytes_sent_per_step"] / 1e3, ""),
        ("KB received from ps per step, sparse", m["sparse_bytes_received_per_step"] / 1e3, ""),
        ("KB received from ps per step, dense", m["dense_bytes_received_per_step"] / 1e3, ""),
        ("coordinator ms per no-op function (2 workers)", m["coordinator_ms_per_noop_function"], "<= 1"),
        ("ms per schedule() call", m["schedule_call_ms"], ""),
    ]
    print(f"\n{'measure':<50}{'median':>12}  target")
    for name, value, target in rows:
        print(f"{name:<50}{value:>12.3f}  {target}")


if __name__ == "__main__":
    main()
