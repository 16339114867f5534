"""Input-bound benchmark: auto-sharded DataLoaders against reading everything, hand-sharding and raw DDP (issue 21).

    python benchmarks/input_sharding.py [--batch 32] [--cost-ms 1.0] [--steps 12] [--rounds 5]
                                        [--loader-workers 0] [--json out.json]

The pipeline: a map-style dataset whose ``__getitem__`` burns a fixed CPU time (``--cost-ms`` of this thread's
CPU, so that a busy machine slows every variant alike), in a ``DataLoader`` with a global batch of ``--batch``
examples, shuffled from a seeded generator; the model is a Linear(16, 8) whose step costs next to nothing, so
the input is the bottleneck. Each variant, on a cluster of 1 and then of 2 worker processes (gloo over loopback,
one torch thread each):

* ``auto``: ``strategy.experimental_distribute_dataset(loader)``, auto-sharded (``AutoShardPolicy.AUTO``): each
  worker loads only its replicas' part of every global batch;
* ``off``: the same with ``AutoShardPolicy.OFF`` (before issue 21: every worker loads every global batch and keeps
  its part);
* ``hand``: ``strategy.distribute_datasets_from_function`` building a ``DataLoader`` with a ``DistributedSampler``
  per worker (batch ``--batch / workers``), what a user had to write by hand;
* ``ddp``: raw ``DistributedDataParallel`` with the same ``DistributedSampler`` loader.

Round after round every variant runs ``--steps`` timed steps (after 2 warm-up steps) between two barriers; the
order of the variants rotates each round. Figures are medians over rounds; ratios are taken within a round (the
same machine load). Also counted: examples each worker's ``__getitem__`` loaded per step (``--loader-workers 0``),
and each worker's CPU seconds in the timed window: ``cpu_estimate`` is what an idle machine with one core per
worker would give (the slower worker's CPU time per step), the figure to trust on a loaded machine.

Targets (issue 21), on 2 workers: auto >= 0.95x hand, auto >= 1.6x off. Prints a JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
VARIANTS = ("auto", "off", "hand", "ddp")
WARM_UP = 2


class Burn(Dataset):
    """``size`` examples of 16 features and a label; reading one burns ``cost_s`` of the reading thread's CPU."""

    def __init__(self, size: int, cost_s: float) -> None:
        self.size, self.cost_s, self.loaded = size, cost_s, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.loaded += 1
        end = time.thread_time() + self.cost_s
        while time.thread_time() < end:
            pass
        g = torch.Generator().manual_seed(i)
        return torch.rand(16, generator=g), i % 8


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import distrib as ds

    strategy = ds.MultiWorkerMirroredStrategy()
    if not dist.is_initialized():  # a 1-worker cluster has no process group of its own; DDP and barriers need one
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    workers, rank, batch = strategy.num_workers, strategy.worker_index, args.batch
    data = Burn(batch * (args.steps + WARM_UP), args.cost_ms / 1e3)
    extra: dict[str, Any] = {"num_workers": args.loader_workers}
    if args.loader_workers:
        extra["persistent_workers"] = True

    def distrib_variant(make: Callable[[int], Any]) -> Callable[[int], float]:
        with strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(16, 8)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(b: Any) -> None:
            x, y = b
            ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=batch).backward()
            opt.step()
            opt.zero_grad()

        return lambda r: timed(make(r), lambda b: strategy.run(step, args=(b,)))

    def sharded(policy: Any) -> Callable[[int], Any]:
        loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0), **extra)
        dist_data = strategy.experimental_distribute_dataset(
            loader, ds.InputOptions(experimental_auto_shard_policy=policy)
        )
        return lambda r: dist_data

    def by_hand() -> Callable[[int], Any]:
        samplers: list[DistributedSampler] = []

        def dataset_fn(ctx: Any) -> DataLoader:
            sampler = DistributedSampler(data, ctx.num_input_pipelines, ctx.input_pipeline_id, shuffle=True, seed=0)
            samplers.append(sampler)
            return DataLoader(data, batch_size=ctx.get_per_replica_batch_size(batch), sampler=sampler, **extra)

        dist_data = strategy.distribute_datasets_from_function(dataset_fn)

        def epoch(r: int) -> Any:
            samplers[0].set_epoch(r)
            return dist_data

        return epoch

    def ddp() -> Callable[[int], float]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(16, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = DistributedSampler(data, workers, rank, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=batch // workers, sampler=sampler, **extra)

        def step(b: Any) -> None:
            x, y = b
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        def run(r: int) -> float:
            sampler.set_epoch(r)
            return timed(loader, step)

        return run

    def timed(batches: Any, step: Callable[[Any], None]) -> float:
        """Seconds for the timed steps (both workers start and end together); the loaded count per step."""
        it = iter(batches)
        for _ in range(WARM_UP):
            step(next(it))
        dist.barrier()
        before, start, cpu = data.loaded, time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step(next(it))
        loaded[0], cpu_s[0] = data.loaded - before, time.process_time() - cpu
        dist.barrier()
        elapsed = time.perf_counter() - start
        for _ in it:  # finish the epoch (its batches are not timed), so the next round starts a fresh one
            pass
        return elapsed

    loaded, cpu_s = [0], [0.0]
    runs = {
        "auto": distrib_variant(sharded(ds.AutoShardPolicy.AUTO)),
        "off": distrib_variant(sharded(ds.AutoShardPolicy.OFF)),
        "hand": distrib_variant(by_hand()),
        "ddp": ddp(),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            seconds = runs[name](r)
            results[name].append(
                {"seconds": seconds, "loaded_per_step": loaded[0] / args.steps, "cpu_seconds": cpu_s[0]}
            )
    everyone = strategy.communicator.all_gather_object(results)
    if strategy.is_chief:
        with open(args.out, "w") as f:
            json.dump({"workers": everyone}, f)


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    chief = raw["workers"][0]
    rounds = range(args.rounds)

    def rate(name: str, r: int) -> float:
        return args.batch * args.steps / chief[name][r]["seconds"]

    variants = {
        name: {
            "examples_per_s": statistics.median(rate(name, r) for r in rounds),
            "loaded_per_step_per_worker": [
                statistics.median(w[name][r]["loaded_per_step"] for r in rounds) for w in raw["workers"]
            ],
        }
        for name in VARIANTS
    }

    def cpu_rate(name: str, r: int) -> float:  # what an idle machine with a core per worker would give
        return args.batch * args.steps / max(w[name][r]["cpu_seconds"] for w in raw["workers"])

    for name in VARIANTS:
        variants[name]["cpu_estimate_examples_per_s"] = statistics.median(cpu_rate(name, r) for r in rounds)
    ratios = {
        f"auto_vs_{other}": statistics.median(rate("auto", r) / rate(other, r) for r in rounds)
        for other in ("off", "hand", "ddp")
    }
    cpu_ratios = {
        f"auto_vs_{other}": statistics.median(cpu_rate("auto", r) / cpu_rate(other, r) for r in rounds)
        for other in ("off", "hand", "ddp")
    }
    return {"variants": variants, "ratios": ratios, "cpu_time_estimate_ratios": cpu_ratios}


def print_table(result: dict) -> None:
    print(f"\n{'workers':<8}{'variant':<8}{'examples/s':>11}{'CPU-time est.':>14}{'loaded/step/worker':>20}")
    for workers, run in result["runs"].items():
        for name, v in run["variants"].items():
            print(
                f"{workers:<8}{name:<8}{v['examples_per_s']:>11.0f}{v['cpu_estimate_examples_per_s']:>14.0f}"
                f"{str(v['loaded_per_step_per_worker']):>20}"
            )
        print(f"{'':<8}ratios  " + ", ".join(f"{k} {v:.2f}" for k, v in run["ratios"].items()))
        print(f"{'':<8}CPU est " + ", ".join(f"{k} {v:.2f}" for k, v in run["cpu_time_estimate_ratios"].items()))
    print(
        f"\n2-worker targets: auto/hand {result['runs']['2']['ratios']['auto_vs_hand']:.2f} (>= 0.95), "
        f"auto/off {result['runs']['2']['ratios']['auto_vs_off']:.2f} (>= 1.6)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="global batch (a multiple of 2)")
    p.add_argument("--cost-ms", type=float, default=1.0, help="CPU milliseconds one __getitem__ burns")
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--loader-workers", type=int, default=0, help="the DataLoaders' num_workers")
    p.add_argument("--workers", default="1,2", help="cluster sizes to run, one job each")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from multi_worker import run_tf_config_workers

    argv = [
        "--batch",
        str(args.batch),
        "--cost-ms",
        str(args.cost_ms),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--loader-workers",
        str(args.loader_workers),
    ]
    result: dict[str, Any] = {
        "machine": "",
        "runs": {},
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "json")},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (int(w) for w in args.workers.split(",")):
            raw = run_tf_config_workers(HERE, argv, os.path.join(tmp, f"{workers}.json"), workers=workers)
            result["runs"][str(workers)] = summarize(raw, args)
    result["machine"] = f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}"
    if "1" in result["runs"] and "2" in result["runs"]:
        result["auto_2_vs_1_worker"] = (
            result["runs"]["2"]["variants"]["auto"]["examples_per_s"]
            / result["runs"]["1"]["variants"]["auto"]["examples_per_s"]
        )
    print(json.dumps(result, indent=2))
    if "2" in result["runs"]:
        print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
