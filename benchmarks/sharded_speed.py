"""Steps per second of ``ShardedStrategy`` against the same loop written with ``fully_shard``, and against MWMS.

    python benchmarks/sharded_speed.py [--width 1024] [--blocks 8] [--batch 32] [--steps 30] [--rounds 5]
                                       [--variants distrib,direct,mwms] [--malloc default,...]
                                       [--profile] [--json out.json]

The same model and batch in every variant (benchmarks/sharded_model.py): ``--blocks`` residual
blocks ``x + relu(Linear(width, width)(x))`` (default 8 x 1024: 8.4M parameters), float32 Adam, ``--batch`` rows per worker, 2
worker processes started by ``distrib launch --workers 2`` (gloo over loopback, one torch thread
each, the same environment for every variant):

* ``distrib``: ``ds.ShardedStrategy(sharding_policy=ShardingPolicy(module_classes=[Block]))``;
  each step is ``strategy.run(step)`` with ``ds.compute_average_loss``, ``loss.backward()``,
  ``optimizer.step()``, ``optimizer.zero_grad()``, on batches from
  ``strategy.experimental_distribute_dataset``;
* ``direct``: the loop written directly on torch: ``init_process_group("gloo")``,
  ``init_device_mesh("cpu", (2,))``, ``fully_shard`` per block then the root,
  ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` (the
  settings distrib uses: gradients summed, the loss divided by the global batch), the local half
  of each global batch sliced by hand;
* ``mwms``: the distrib step under ``ds.MultiWorkerMirroredStrategy`` (whole copies, gradients
  all-reduced).

``--malloc``: glibc allocator settings (``sharded_model.allocator_env``: ``default``, ``mmap:128k``,
``mmap:4m+trim``, ...) put in the workers' environment; every variant runs under each, and each
setting's rates are also given against the first setting's (``vs_default_*``: what the setting costs).

Each round runs every (variant, setting) once, in fresh processes, in an order that rotates from round to
round; a run times ``--steps`` steps after 5 warm-up steps, between two barriers. Per run:
steps/s of wall time (worker 0), and a CPU-time estimate (steps per second of the slower
worker's CPU time: what an idle machine with a core per worker would give; the figure to trust on
a loaded machine). Ratios are taken within a round, then their median. Also, for ``distrib``:
the time ``strategy.run`` spends outside the user's step function (distrib's own per-step cost).

``--profile``: one more ``distrib`` run with ``torch.profiler`` on worker 0 over the timed steps:
self CPU time by kind (matrix products, Adam, FSDP's copy-in/copy-out, all-gather,
reduce-scatter, the rest) and FSDP's own regions. Target (issue 20): distrib >= 0.97x direct.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from sharded_model import allocator_env, params, worker_env  # this directory is sys.path[0]

VARIANTS = ("distrib", "direct", "mwms")
WARM_UP = 5

#: self-CPU-time buckets of the profile, by operator name (the first match wins). On the CPU, FSDP's copies
#: are aten::copy_ (copy-out, ``split_with_sizes_copy``) and aten::cat (copy-in, the reduce-scatter's input);
#: nothing else in this step copies. The own time of FSDP's regions (``FSDP::all_gather``, ...) is mostly the
#: main thread waiting for gloo's thread to finish the collective, plus FSDP's Python.
KINDS: list[tuple[str, tuple[str, ...]]] = [
    (
        "FSDP copy-in/copy-out",
        ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "aten::copy_", "aten::cat", "_foreach_copy"),
    ),
    ("all-gather (gloo, main thread)", ("allgather", "all_gather_into", "_allgather_base")),
    ("reduce-scatter (gloo, main thread)", ("reduce_scatter",)),
    ("FSDP regions' own time (waits, Python)", ("fsdp::",)),
    ("matrix products", ("aten::addmm", "aten::mm", "aten::bmm")),
    ("Adam", ("_foreach", "adam")),
]


def measure(variant: str, width: int, blocks: int, batch: int, steps: int, profile: bool) -> dict[str, Any]:
    """Time ``steps`` steps of ``variant`` (run in each worker)."""
    import torch
    import torch.distributed as dist
    from sharded_model import after_step, batches, build_model, make_strategy

    torch.set_num_threads(1)
    total = WARM_UP + steps
    in_fn = [0.0]
    if variant == "direct":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        model = build_model(width, blocks)
        for module in [*model, model]:
            fully_shard(module, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        global_batch = batch * world
        data = batches(total, global_batch, width)
        local = [(x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]) for x, y in data]

        def one_step(x: torch.Tensor, y: torch.Tensor) -> None:
            ((model(x) - y).pow(2).mean(1).sum() / global_batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            after_step()

        steps_iter = iter(local)

        def run_step() -> None:
            one_step(*next(steps_iter))

        barrier: Callable[[], None] = dist.barrier
    else:
        import distrib as ds

        strategy = make_strategy("sharded" if variant == "distrib" else "mwms")
        rank, world = strategy.worker_index, strategy.num_workers
        with strategy.scope():
            model = build_model(width, blocks)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        global_batch = batch * strategy.num_replicas_in_sync

        def ds_step(x: torch.Tensor, y: torch.Tensor) -> None:
            start = time.perf_counter()
            ds.compute_average_loss((model(x) - y).pow(2).mean(1), global_batch_size=global_batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            in_fn[0] += time.perf_counter() - start

        data_iter = iter(strategy.experimental_distribute_dataset(batches(total, global_batch, width)))

        def distrib_step() -> None:
            strategy.run(ds_step, args=next(data_iter))
            start = time.perf_counter()
            after_step()  # the allocator setting's cost, not distrib's: counted with the step function
            in_fn[0] += time.perf_counter() - start

        run_step = distrib_step
        barrier = strategy.barrier

    for _ in range(WARM_UP):
        run_step()
    barrier()
    prof = None
    if profile and rank == 0:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        prof = profiler(activities=[ProfilerActivity.CPU])
        prof.__enter__()
    in_fn[0] = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run_step()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    barrier()
    out: dict[str, Any] = {
        "worker": rank,
        "variant": variant,
        "steps_per_s": steps / wall,
        "cpu_per_step": cpu / steps,
        "outside_fn_ms": 1e3 * (wall - in_fn[0]) / steps if variant != "direct" else None,
    }
    if prof is not None:
        prof.__exit__(None, None, None)
        out["profile"] = summarize(prof, steps)
    return out


def summarize(prof: Any, steps: int) -> dict[str, Any]:
    """Self CPU ms per step by kind (KINDS), and FSDP's regions (inclusive CPU ms per step)."""
    kinds: dict[str, float] = {name: 0.0 for name, _ in KINDS}
    kinds["everything else"] = 0.0
    regions: dict[str, float] = {}
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    for e in prof.key_averages():
        name = e.key
        if name.startswith("FSDP::") or name.startswith("ProfilerStep"):
            base = name.split(" (")[0].split(" for ")[0]
            regions[base] = regions.get(base, 0.0) + e.cpu_time_total / 1e3 / steps
        kind = next((k for k, pats in KINDS if any(p in name.lower() for p in pats)), "everything else")
        kinds[kind] += e.self_cpu_time_total / 1e3 / steps
    return {
        "self_cpu_ms_per_step": {k: round(v, 2) for k, v in kinds.items()},
        "profiled_step_ms": round(sum(kinds.values()), 2),
        "fsdp_regions_ms_per_step": {k: round(v, 2) for k, v in sorted(regions.items(), key=lambda kv: -kv[1])},
        "top_self_cpu_ms_per_step": {e.key: round(e.self_cpu_time_total / 1e3 / steps, 2) for e in top},
    }


def run(variant: str, malloc: str, args: argparse.Namespace, profile: bool = False) -> list[dict[str, Any]]:
    """One run of ``variant`` on 2 fresh worker processes under the allocator setting ``malloc``; both workers'
    figures."""
    cmd = [
        sys.executable,
        "-m",
        "distrib.app.cli",
        "launch",
        "--workers",
        "2",
        str(pathlib.Path(__file__)),
        "--measure",
        variant,
        "--width",
        str(args.width),
        "--blocks",
        str(args.blocks),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
    ] + (["--profile"] if profile else [])
    out = subprocess.run(cmd, env=worker_env(malloc), capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line[line.index('{"worker"') :]) for line in out.stdout.splitlines() if '"steps_per_s"' in line]
    if out.returncode != 0 or len(rows) != 2:
        raise RuntimeError(
            f"{variant} ({malloc}) failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return sorted(rows, key=lambda r: r["worker"])


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios ``a[i] / b[i]``."""
    return round(statistics.median(x / y for x, y in zip(a, b)), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="rows per worker per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument(
        "--malloc",
        default="default",
        help="glibc allocator settings, comma-separated (benchmarks/sharded_model.py's allocator_env: "
        "default, mmap:128k, mmap:4m+trim, ...); ratios against the first",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--measure", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(
            json.dumps(measure(args.measure, args.width, args.blocks, args.batch, args.steps, args.profile)), flush=True
        )
        return

    variants = [v for v in args.variants.split(",")]
    mallocs = args.malloc.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: use some of {', '.join(VARIANTS)}")
    for malloc in mallocs:
        allocator_env(malloc)  # a mistyped setting fails now
    configs = [(v, m) for m in mallocs for v in variants]
    wall: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    cpu: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    outside: dict[str, list[float]] = {m: [] for m in mallocs}
    for r in range(args.rounds):
        for variant, malloc in configs[r % len(configs) :] + configs[: r % len(configs)]:  # the order rotates
            rows = run(variant, malloc, args)
            wall[variant, malloc].append(rows[0]["steps_per_s"])
            cpu[variant, malloc].append(1.0 / max(row["cpu_per_step"] for row in rows))
            if variant == "distrib":
                outside[malloc].append(statistics.median(row["outside_fn_ms"] for row in rows))
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v}/{m} {wall[v, m][-1]:.2f}/s" for v, m in configs),
            file=sys.stderr,
            flush=True,
        )

    base = mallocs[0]
    by_malloc: dict[str, Any] = {}
    for m in mallocs:
        entry: dict[str, Any] = {
            "env": allocator_env(m),
            "steps_per_s_wall": {v: round(statistics.median(wall[v, m]), 3) for v in variants},
            "steps_per_s_cpu_estimate": {v: round(statistics.median(cpu[v, m]), 3) for v in variants},
            "ratios_wall": {
                f"distrib_vs_{o}": median_ratio(wall["distrib", m], wall[o, m])
                for o in variants
                if o != "distrib" and "distrib" in variants
            },
            "ratios_cpu_estimate": {
                f"distrib_vs_{o}": median_ratio(cpu["distrib", m], cpu[o, m])
                for o in variants
                if o != "distrib" and "distrib" in variants
            },
        }
        if outside[m]:
            entry["distrib_outside_step_fn_ms"] = round(statistics.median(outside[m]), 2)
        if m != base:  # the same variant under this setting against the first setting, within each round
            entry[f"vs_{base}_wall"] = {v: median_ratio(wall[v, m], wall[v, base]) for v in variants}
            entry[f"vs_{base}_cpu_estimate"] = {v: median_ratio(cpu[v, m], cpu[v, base]) for v in variants}
        by_malloc[m] = entry
    total = params(args.width, args.blocks)
    summary: dict[str, Any] = {
        "params": total,
        "width": args.width,
        "blocks": args.blocks,
        "batch_per_worker": args.batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "workers": 2,
        "variants": variants,
        "malloc": by_malloc,
        "raw": {f"{v}/{m}": {"wall": wall[v, m], "cpu_estimate": cpu[v, m]} for v, m in configs},
    }
    if args.profile and "distrib" in variants:
        summary["profile_distrib_worker0"] = run("distrib", base, args, profile=True)[0]["profile"]
    print(json.dumps(summary, indent=1))
    print(
        f"\n{total / 1e6:.1f}M parameters, fp32 Adam, 2 workers, batch {args.batch} per worker; medians of "
        f"{args.rounds} rounds; ratios within a round, their median"
    )
    width = max(8, *(len(m) for m in mallocs))
    print(
        f"{'malloc':<{width}} {'variant':<8} {'steps/s wall':>13} {'steps/s cpu est.':>17} "
        f"{'vs ' + base + ' wall/cpu':>{width + 12}}"
    )
    for m in mallocs:
        e = by_malloc[m]
        for v in variants:
            vs = f"{e[f'vs_{base}_wall'][v]}/{e[f'vs_{base}_cpu_estimate'][v]}" if m != base else ""
            print(
                f"{m:<{width}} {v:<8} {e['steps_per_s_wall'][v]:>13} {e['steps_per_s_cpu_estimate'][v]:>17} "
                f"{vs:>{width + 12}}"
            )
        for name in e["ratios_wall"]:
            print(
                f"{m:<{width}} {name:<18} wall {e['ratios_wall'][name]:>6}  cpu est. "
                f"{e['ratios_cpu_estimate'][name]:>6}"
            )
        if "distrib_outside_step_fn_ms" in e:
            print(f"{m:<{width}} distrib's time outside the step function: {e['distrib_outside_step_fn_ms']} ms/step")
    if args.profile and "distrib" in variants:
        for k, v in summary["profile_distrib_worker0"]["self_cpu_ms_per_step"].items():
            print(f"  {k:<24} {v:>8} ms/step (self CPU)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
