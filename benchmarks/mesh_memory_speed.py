"""Mesh parallelism on 4 workers: peak memory per worker, activations at a long sequence, and speed against torch.

    python benchmarks/mesh_memory_speed.py [--meshes fsdp,hybrid,fsdp_tp,tp,mwms] [--dim 640] [--layers 10]
                                           [--heads 8] [--vocab 2048] [--batch 4] [--seq 64] [--steps 3]
                                           [--rounds 4] [--round-steps 2] [--short-seq 128] [--long-seq 1024]
                                           [--activation-meshes fsdp,fsdp_tp,tp] [--speed-meshes hybrid,fsdp_tp]
                                           [--malloc mmap:128k+thp]
                                           [--json out.json]

The model: a GPT-style decoder (token and learned position embeddings, ``--layers`` pre-norm blocks of causal
self-attention, ``--heads`` heads through ``F.scaled_dot_product_attention``, and a 4x GELU MLP, a final
LayerNorm and an unshared output layer), by default 640 wide, 10 blocks, a vocabulary of 2,048 and a context
of ``--long-seq``: 52.5M parameters (counted on the meta device, printed), float32, ``torch.optim.Adam``.
Each mesh runs in 4 fresh worker processes (``distrib launch --workers 4``, gloo over loopback, one torch
thread each, the allocator setting ``--malloc`` in their environment: by default distrib's recipe for sharded
CPU workers, a fixed 128 KiB mmap threshold and transparent huge pages):

* ``fsdp``: ``ds.ShardedStrategy`` (FSDP over 4); ``hybrid``: ``MeshStrategy`` on
  ``DeviceMesh((2, 2), ("replicate", "batch"))``; ``fsdp_tp``: ``DeviceMesh((2, 2), ("batch", "model"))``;
  ``tp``: ``DeviceMesh((1, 4), ("batch", "model"))``; ``mwms``: ``ds.MultiWorkerMirroredStrategy``. Every
  block is an FSDP unit (``ShardingPolicy(module_classes=[Block])``); the layout map splits the token
  embedding's vocabulary, attention's q, k, v (Colwise) and o (Rowwise), the MLP's up (Colwise) and down
  (Rowwise).

Each worker, in order:

1. **Memory** (RSS from ``/proc/self/status``, the kernel's count of what the process holds; CPU figures): the
   baseline is VmRSS once the process group exists, one collective ran and the code of FSDP, DTensor, Adam and
   attention is loaded; the model and Adam are built in ``strategy.scope()`` (deferred init), then ``1 +
   --steps`` training steps on ``--batch`` global sequences of ``--seq`` tokens. ``peak``: the high-water mark
   (VmHWM, reset through ``/proc/self/clear_refs``) over the build and the steps, above the baseline.
   Expected beside it: 16 bytes per local parameter (the parameter, its gradient and Adam's two states, as the
   mesh divides them) + the activations (the formula below, for this worker's part of the batch) + FSDP's
   gathered parameters (two whole units, the one running and the one prefetched, and the root, which FSDP
   keeps whole between forward and backward; each on this worker's tensor-parallel shard).
2. **Activations** (``--activation-meshes``): one forward pass (no backward) on one sequence per data
   replica, at ``--short-seq`` and ``--long-seq`` tokens: the bytes autograd saves for backward (counted by
   ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters left out), and the RSS growth
   from before the forward to after it (graph alive). Formula (float32, derived from what each op saves;
   ``F.scaled_dot_product_attention`` on the CPU is flash attention, which saves q, k, v, its output and a
   log-sum-exp, no seq x seq matrix)::

       A = 4 bytes x b x s x (L x (h x (4 + 12 / T) + 4 + a / T) + 2 h + V + 2) + 8 bytes x s x (2 b + 1) + 4

   per layer 16 values per token and feature at T = 1 (64 bytes): LayerNorm 1's input and output, q, k, v,
   attention's output (laid out (b, s, a, d) by the CPU kernel, so o's input is a view of it, no copy),
   LayerNorm 2's input and output, the MLP's 4h up output and 4h GELU output; tensor parallelism over T divides
   the 12 that live between a Colwise and a Rowwise layer, not the 4 LayerNorm tensors (no sequence
   parallelism); per token and layer also the LayerNorms' mean and 1/std (4) and attention's log-sum-exp (one
   per head, a heads); then the final LayerNorm's input and output (2h), the log-softmax over the vocabulary
   (V), its mean and 1/std (2), the token ids, positions and targets (int64) and the loss's weight (a float32
   scalar); b sequences of s tokens, width h,
   L layers.
3. **Speed** (``--speed-meshes``; any but ``mwms``): the same mesh written directly with torch's calls, in the same
   processes: ``init_device_mesh``, ``parallelize_module`` with the same plan (``ColwiseParallel`` /
   ``RowwiseParallel``), ``fully_shard(mesh=...)`` per block then the root, ``set_gradient_divide_factor(1.0)``
   and ``set_force_sum_reduction_for_comms(True)`` (distrib's settings), ``torch.optim.Adam``, the local part of
   each global batch sliced by hand, a plain loop. ``--rounds`` rounds alternate ``--round-steps`` steps of
   distrib's (``strategy.run``, ``ds.compute_average_loss``) with as many of torch's, the order swapped every
   round, each block between two barriers; a round's time is the slower worker's. Reported: distrib / torch in
   steps per second, the median over rounds and the spread (lowest, highest), by wall time and by CPU time (the
   figure to trust on a loaded machine). Also: each variant's first loss on the first global batch (the same
   seed: the same model, the same number).

Prints a JSON object and three tables (memory, activations, speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from sharded_model import reset_high_water_mark, vm_status, warm_up, worker_env  # this directory is sys.path[0]

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from mesh_decoder import Block, Decoder  # noqa: E402 - the example's decoder, at the benchmark's size
from torch import nn
from torch.nn import functional as F

MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]] | None] = {
    "fsdp": ((4,), ("batch",)),
    "hybrid": ((2, 2), ("replicate", "batch")),
    "fsdp_tp": ((2, 2), ("batch", "model")),
    "tp": ((1, 4), ("batch", "model")),
    "mwms": None,
}
WORKERS = 4
MB = 1e6


def build(args: argparse.Namespace) -> Decoder:
    torch.manual_seed(0)
    return Decoder(args.vocab, args.dim, args.heads, args.layers, args.long_seq)


def per_sequence_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


#: which weights the model axis splits (the same in distrib's layout map and torch's plan)
TP_LINEARS = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise"}
TP_LINEARS.update({"up": "colwise", "down": "rowwise"})


def layout_map(mesh: Any) -> Any:
    from distrib.experimental import LayoutMap

    layouts = LayoutMap(mesh)
    layouts[r"^tok\.weight$"] = ("model", None)  # the vocabulary split: RowwiseParallel(input_layouts=Replicate())
    for name, style in TP_LINEARS.items():
        key = r"\." + re.escape(name) + r"\.weight$"
        layouts[key] = ("model", None) if style == "colwise" else (None, "model")
    return layouts


def torch_plan(layers: int) -> dict[str, Any]:
    """``parallelize_module``'s plan for the same layouts, written as torch's documentation does."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"tok": RowwiseParallel(input_layouts=Replicate())}
    for i in range(layers):
        for name, style in TP_LINEARS.items():
            plan[f"blocks.{i}.{name}"] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    return plan


def make_strategy(mesh_name: str) -> Any:
    import distrib as ds
    from distrib.experimental import DeviceMesh, MeshStrategy

    policy = ds.ShardingPolicy(module_classes=[Block])
    if mesh_name == "mwms":
        return ds.MultiWorkerMirroredStrategy()
    if mesh_name == "fsdp":
        return ds.ShardedStrategy(sharding_policy=policy)
    shape, names = MESHES[mesh_name]  # type: ignore[misc]
    mesh = DeviceMesh(shape, names)
    return MeshStrategy(mesh, layout_map(mesh) if "model" in names else None, sharding_policy=policy)


def global_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


# ----------------------------------------------------------------------------- the figures' formulas
def count_params(args: argparse.Namespace) -> dict[str, int]:
    """The model's parameters, counted on the meta device: all, one block's, the root's (what no block holds),
    and the block parameters that the layout map splits."""
    with torch.device("meta"):
        model = build(args)
    first = model.blocks[0]
    block = sum(p.numel() for p in first.parameters())
    split = sum(first.get_submodule(n).weight.numel() for n in TP_LINEARS)
    split += sum(first.get_submodule(n).bias.numel() for n, s in TP_LINEARS.items() if s == "colwise" and n != "attn.k")
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "block": block, "block_split": split, "root": total - args.layers * block}


def activation_bytes(args: argparse.Namespace, b: int, s: int, tp: int) -> float:
    """The formula: what autograd saves in one forward pass of ``b`` sequences of ``s`` tokens, float32, on a
    worker of a model axis of size ``tp`` (module docstring)."""
    h, layers, heads = args.dim, args.layers, args.heads
    per_token = layers * (h * (4 + 12 / tp) + 4 + heads / tp) + 2 * h + args.vocab + 2
    return 4.0 * b * s * per_token + 8.0 * s * (2 * b + 1) + 4  # + the int64 ids, positions and targets; a scalar


def expected_peak(args: argparse.Namespace, mesh_name: str, local_params: int, counts: dict[str, int]) -> dict:
    """Expected peak bytes of one worker: state (16 per local parameter) + activations + FSDP's gathered units."""
    shape = MESHES[mesh_name]
    names = shape[1] if shape else ("batch",)
    sizes = dict(zip(names, shape[0])) if shape else {"batch": WORKERS}
    tp = sizes.get("model", 1)
    data = WORKERS // tp
    local_batch = args.batch // data
    acts = activation_bytes(args, local_batch, args.seq, tp)
    unit = 4.0 * (counts["block"] - counts["block_split"] + counts["block_split"] / tp)
    root = 4.0 * (counts["root"] - args.vocab * args.dim * (1 - 1 / tp))  # the token embedding is split too
    gathered = 2 * unit + root if data > 1 and mesh_name != "mwms" else 0.0
    state = 16.0 * local_params
    return {
        "state_mb": round(state / MB, 1),
        "activations_mb": round(acts / MB, 1),
        "fsdp_gathered_mb": round(gathered / MB, 1),
        "expected_peak_mb": round((state + acts + gathered) / MB, 1),
    }


# ----------------------------------------------------------------------------- one worker
def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def forward_activations(model: nn.Module, run: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One forward pass, graph kept: what autograd saves (each storage once, no parameter) and the RSS growth."""
    import gc

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    kept: list[torch.Tensor] = []

    def forward(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kept.append(per_sequence_loss(model, x, y).sum())

    gc.collect()
    before = vm_status()
    reset_high_water_mark()
    run(forward, x, y)
    after = vm_status()
    kept.clear()
    gc.collect()
    return {
        "saved_bytes": sum(saved.values()),
        "saved_mb": round(sum(saved.values()) / MB, 2),
        "rss_growth_mb": round((after["VmRSS"] - before["VmRSS"]) / MB, 1),
        "hwm_growth_mb": round((after["VmHWM"] - before["VmRSS"]) / MB, 1),
    }


def direct(args: argparse.Namespace, mesh_name: str) -> tuple[nn.Module, Any, int, int]:
    """The same mesh written with torch's calls: the model, Adam, this worker's data index and the data size."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    shape, names = MESHES[mesh_name]  # type: ignore[misc]
    if names == ("batch", "model") and shape[0] == 1:  # TP over every worker: torch's mesh is the model axis alone
        shape, names = (shape[1],), ("model",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build(args)
    if "model" in names:
        parallelize_module(model, mesh["model"], torch_plan(args.layers))
    data_axes = tuple(n for n in names if n != "model")
    data_size = math.prod(mesh[a].size() for a in data_axes) if data_axes else 1
    if data_size > 1:
        data_mesh = mesh[data_axes] if len(data_axes) > 1 else mesh[data_axes[0]]
        for module in [*model.blocks, model]:
            fully_shard(module, mesh=data_mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    index = 0
    for axis in data_axes:
        index = index * mesh[axis].size() + mesh[axis].get_local_rank()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dist.barrier()
    return model, optimizer, index, data_size


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.tensor.parallel  # noqa: F401  (loaded before the baseline, as FSDP's code is)

    import distrib as ds

    torch.set_num_threads(1)
    mesh_name = args.measure
    strategy = make_strategy(mesh_name)
    strategy.barrier()
    warm_up()
    tiny = Block(32, 4)  # attention's and GELU's code, loaded before the baseline too
    tiny(torch.randn(1, 4, 32)).sum().backward()
    del tiny
    base = vm_status()
    reset_high_water_mark()
    with strategy.scope():
        model = build(args)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    built = vm_status()
    global_batch = args.batch
    data = global_batches(1 + args.steps, global_batch, args.seq, args.vocab)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(per_sequence_loss(model, x, y), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    wall, cpu, losses = [], [], []
    for x, y in strategy.experimental_distribute_dataset(data):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = strategy.run(step, args=(x, y))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(float(strategy.reduce("sum", loss, axis=None)))
    trained = vm_status()
    local = sum(_local(p).numel() for p in model.parameters())
    row: dict[str, Any] = {
        "worker": strategy.worker_index,
        "mesh": mesh_name,
        "local_params": local,
        "baseline_rss_mb": round(base["VmRSS"] / MB, 1),
        "after_build_mb": round((built["VmRSS"] - base["VmRSS"]) / MB, 1),
        "peak_mb": round((max(built["VmHWM"], trained["VmHWM"]) - base["VmRSS"]) / MB, 1),
        "steps_wall_s": [round(t, 3) for t in wall],
        "steps_cpu_s": [round(t, 3) for t in cpu],
        "first_loss_distrib": losses[0],
    }

    if mesh_name in args.activation_meshes.split(","):
        num_data = getattr(strategy, "num_data_workers", strategy.num_replicas_in_sync)
        row["activations"] = {}
        for seq in (args.short_seq, args.long_seq):
            batch = global_batches(1, num_data, seq, args.vocab, seed=2)
            x, y = next(iter(strategy.experimental_distribute_dataset(batch)))
            row["activations"][str(seq)] = forward_activations(
                model, lambda fn, a, b: strategy.run(fn, args=(a, b)), x, y
            )
            row["activations"][str(seq)]["local_batch"] = int(x.shape[0])

    if mesh_name in args.speed_meshes.split(",") and MESHES[mesh_name] is not None and args.rounds > 0:
        d_model, d_opt, index, d_size = direct(args, mesh_name)
        n_batches = args.rounds * args.round_steps
        speed_data = global_batches(n_batches, global_batch, args.seq, args.vocab)
        part = global_batch // d_size
        local_data = iter(
            [(x[index * part : (index + 1) * part], y[index * part : (index + 1) * part]) for x, y in data]
        )
        first_direct = []

        def direct_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = per_sequence_loss(d_model, x, y).sum() / global_batch
            loss.backward()
            d_opt.step()
            d_opt.zero_grad()
            return loss.detach()

        # the first global batch once, for the first loss: torch's model from the same seed must give distrib's
        x0, y0 = next(local_data)
        first = direct_step(x0, y0)
        dist.all_reduce(first)
        first_direct.append(float(first) / (WORKERS // d_size))  # each tensor-parallel worker holds the same loss
        distrib_iter = iter(strategy.experimental_distribute_dataset(speed_data))
        direct_iter = iter(
            [(x[index * part : (index + 1) * part], y[index * part : (index + 1) * part]) for x, y in speed_data]
        )
        rounds: dict[str, list[dict[str, float]]] = {"distrib": [], "torch": []}

        def block(name: str) -> None:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.round_steps):
                if name == "distrib":
                    strategy.run(step, args=next(distrib_iter))
                else:
                    direct_step(*next(direct_iter))
            rounds[name].append(
                {
                    "wall": (time.perf_counter() - start) / args.round_steps,
                    "cpu": (time.process_time() - start_cpu) / args.round_steps,
                }
            )
            dist.barrier()

        for r in range(args.rounds):
            for name in ("distrib", "torch") if r % 2 == 0 else ("torch", "distrib"):
                block(name)
        row["rounds"] = rounds
        row["first_loss_torch"] = first_direct[0]
    return row


# ----------------------------------------------------------------------------- the parent
def run(mesh_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "distrib.app.cli", "launch", "--workers", str(WORKERS), str(pathlib.Path(__file__))]
    cmd += ["--measure", mesh_name] + [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("measure", "json", "meshes", "malloc")
    ]
    out = subprocess.run(cmd, env=worker_env(args.malloc), capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(line[line.index('{"worker"') :]) for line in out.stdout.splitlines() if '"local_params"' in line]
    if out.returncode != 0 or len(rows) != WORKERS:
        raise RuntimeError(f"{mesh_name} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return sorted(rows, key=lambda r: r["worker"])


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "low": round(min(values), 3), "high": round(max(values), 3)}


def summarize(mesh_name: str, rows: list[dict[str, Any]], args: argparse.Namespace, counts: dict) -> dict[str, Any]:
    worst = max(rows, key=lambda r: r["peak_mb"])
    entry: dict[str, Any] = {
        "workers": rows,
        "local_params": [r["local_params"] for r in rows],
        "peak_mb": worst["peak_mb"],
        "after_build_mb": max(r["after_build_mb"] for r in rows),
        **expected_peak(args, mesh_name, worst["local_params"], counts),
        # the slower worker's step, the median over the timed steps (the first is the warm-up)
        "step_wall_s": round(
            statistics.median(max(r["steps_wall_s"][i] for r in rows) for i in range(1, 1 + args.steps)), 3
        ),
        "step_cpu_s": round(
            statistics.median(max(r["steps_cpu_s"][i] for r in rows) for i in range(1, 1 + args.steps)), 3
        ),
    }
    entry["peak_over_expected"] = round(entry["peak_mb"] / entry["expected_peak_mb"], 3)
    if "activations" in rows[0]:
        shape = MESHES[mesh_name]
        tp = dict(zip(shape[1], shape[0])).get("model", 1) if shape else 1
        acts = {}
        for seq in (args.short_seq, args.long_seq):
            got = [r["activations"][str(seq)] for r in rows]
            b = got[0]["local_batch"]
            acts[str(seq)] = {
                "local_batch": b,
                "formula_mb": round(activation_bytes(args, b, seq, tp) / MB, 1),
                "saved_mb": max(g["saved_mb"] for g in got),
                "rss_growth_mb": max(g["rss_growth_mb"] for g in got),
            }
        entry["activations"] = acts
    if "rounds" in rows[0]:
        n = args.rounds
        ratios = {}
        for kind in ("wall", "cpu"):
            d = [max(r["rounds"]["distrib"][i][kind] for r in rows) for i in range(n)]
            t = [max(r["rounds"]["torch"][i][kind] for r in rows) for i in range(n)]
            ratios[kind] = spread([tt / dd for dd, tt in zip(d, t)])  # distrib / torch in steps per second
            ratios[f"{kind}_distrib_s"] = round(statistics.median(d), 3)
            ratios[f"{kind}_torch_s"] = round(statistics.median(t), 3)
        entry["speed"] = ratios
        entry["first_loss"] = {"distrib": rows[0]["first_loss_distrib"], "torch": rows[0]["first_loss_torch"]}
    return entry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meshes", default=",".join(MESHES))
    p.add_argument("--dim", type=int, default=640)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="global batch, in sequences")
    p.add_argument("--seq", type=int, default=64, help="training sequence length")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (memory phase)")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="speed rounds (distrib and torch alternating, each leading in turn); 0: none",
    )
    p.add_argument("--round-steps", type=int, default=2)
    p.add_argument("--short-seq", type=int, default=128)
    p.add_argument("--long-seq", type=int, default=1024, help="also the model's context")
    p.add_argument("--activation-meshes", default="fsdp,fsdp_tp,tp")
    p.add_argument("--speed-meshes", default="hybrid,fsdp_tp", help="meshes timed against torch's calls")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--malloc", default="mmap:128k+thp", help="benchmarks/sharded_model.py's allocator_env grammar")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mesh")
    p.add_argument("--json", default=None)
    p.add_argument("--measure", choices=sorted(MESHES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args)), flush=True)
        return
    meshes = args.meshes.split(",")
    unknown = set(meshes) - set(MESHES)
    if unknown:
        p.error(f"unknown meshes {sorted(unknown)}: use some of {', '.join(MESHES)}")
    counts = count_params(args)
    print(f"{counts['total']:,} parameters", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {
        "params": counts,
        "config": {k: v for k, v in vars(args).items() if k not in ("measure", "json")},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_before": os.getloadavg(),
        "meshes": {},
    }
    for name in meshes:
        start = time.monotonic()
        summary["meshes"][name] = summarize(name, run(name, args), args, counts)
        print(f"{name}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    summary["load_after"] = os.getloadavg()
    summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(json.dumps(summary, indent=1))
    report(summary, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))


def report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    meshes = summary["meshes"]
    print(
        f"\n{summary['params']['total']:,} parameters, float32 Adam, 4 workers (CPU, gloo), global batch {args.batch} x "
        f"{args.seq} tokens; MB = 10^6 bytes, the largest worker; loads {summary['load_before']} -> "
        f"{summary['load_after']}"
    )
    print(
        f"{'mesh':<8} {'local params':>12} {'16 B/param':>10} {'acts':>6} {'FSDP':>6} {'expected':>9} "
        f"{'peak':>7} {'peak/exp':>8} {'built':>6} {'step wall/cpu s':>16}"
    )
    for name, e in meshes.items():
        print(
            f"{name:<8} {max(e['local_params']):>12,} {e['state_mb']:>10} {e['activations_mb']:>6} "
            f"{e['fsdp_gathered_mb']:>6} {e['expected_peak_mb']:>9} {e['peak_mb']:>7} {e['peak_over_expected']:>8} "
            f"{e['after_build_mb']:>6} {e['step_wall_s']:>7}/{e['step_cpu_s']:<7}"
        )
    print("\nactivations, one forward pass (MB): formula 4 B x b x s x (L (h (4 + 12/T) + 4 + a/T) + 2h + V + 2) + ...")
    print(f"{'mesh':<8} {'seq':>5} {'b':>2} {'formula':>8} {'saved':>8} {'RSS':>8}")
    for name, e in meshes.items():
        for seq, a in e.get("activations", {}).items():
            print(
                f"{name:<8} {seq:>5} {a['local_batch']:>2} {a['formula_mb']:>8} {a['saved_mb']:>8} "
                f"{a['rss_growth_mb']:>8}"
            )
    print(f"\nspeed, distrib / torch (steps per second), median over {args.rounds} rounds [low, high]")
    for name, e in meshes.items():
        if "speed" in e:
            s = e["speed"]
            print(
                f"{name:<8} wall {s['wall']['median']:>6} [{s['wall']['low']}, {s['wall']['high']}]  cpu "
                f"{s['cpu']['median']:>6} [{s['cpu']['low']}, {s['cpu']['high']}]  step distrib/torch wall "
                f"{s['wall_distrib_s']}/{s['wall_torch_s']} s; first loss {e['first_loss']['distrib']:.6f} / "
                f"{e['first_loss']['torch']:.6f}"
            )


if __name__ == "__main__":
    main()
