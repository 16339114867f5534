"""The GPU benchmark of ``scripts/gpu_check.sh``: the main job's examples/s and distrib's per-step overhead.

    PYTHONPATH=src python3 benchmarks/gpu.py [--device cuda|cpu] [--rounds 5] [--steps 200] [--json out.json]

The main job is ``distrib train``'s (seed 000): the Fashion-MNIST CNN, Adam with Keras' eps,
``make_steps``' replica function (loss scaled by the global batch, accuracy metric). Data: Fashion-MNIST
when its IDX files are found, else random data of its shape (the JSON's ``data`` says which); it is
put on the device once, so every loop measures the step, not the host-to-device copy. Loops:

* ``plain_eager``: the plain PyTorch loop anyone would write (``nn.Sequential`` textbook model,
  ``torch.optim.Adam``; autocast and ``GradScaler`` by hand for mixed precision);
* ``plain_same_step``: the main job's own step function called directly, without any strategy;
* ``default``, ``one_device``, ``mirrored``: the same step through ``strategy.run`` + ``strategy.reduce``
  under distrib's default strategy, ``OneDeviceStrategy(dev)`` and ``MirroredStrategy([dev])``.

Each in fp32, bf16 autocast and fp16 with a GradScaler, eager and under ``torch.compile`` (the model's
forward, as ``distrib train --compile``; compiled variants only for ``--compile-precisions``, and skipped,
saying so, once ``--budget-s`` is spent). No loop synchronises inside a step (losses add up on the
device); ``torch.cuda.synchronize()`` brackets each timed run. Rounds alternate the loops; medians are quoted.
distrib's overhead: per-step time of a strategy loop minus ``plain_same_step``'s, in microseconds, median
over rounds, at the seed's batch (64) and at ``--large-batch`` (GPU-bound). ``--mw-steps``: 2-process
``MultiWorkerMirroredStrategy`` on the one device over gloo (``distrib launch --workers 2``).
A variant that fails (e.g. compile unsupported) is recorded in the JSON's ``failed`` and the rest goes on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from single_process import load_data  # benchmarks/ is on sys.path

import distrib as ds
from distrib.app import models
from distrib.app.train import make_steps

BATCH = 64
PRECISIONS = {"fp32": "32", "bf16": "bf16-mixed", "fp16": "16-mixed"}
KINDS = ("plain_eager", "plain_same_step", "default", "one_device", "mirrored")
Step = Callable[[Any], None]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Forever:
    """The batches, cycled without end (an iterable: a strategy distributes it once)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return itertools.cycle(self.batches)


def compiled(model: torch.nn.Module, backend: str) -> Any:
    """``torch.compile`` of the forward, without maybe_compile's silent eager fallback: a failure must show."""
    return torch.compile(model, backend=backend)


def plain_eager(device: torch.device, precision: str, compile_backend: str | None, batch: int) -> Step:
    torch.manual_seed(0)
    model = models.plain_fashion_mnist_cnn().to(device)
    forward = compiled(model, compile_backend) if compile_backend else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    total = torch.zeros((), device=device)

    def step(b: Any) -> None:
        x, y = b
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x), y, reduction="sum") / batch
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        total.add_(loss.detach())

    return step


def main_job(
    kind: str, device: torch.device, precision: str, compile_backend: str | None, batch: int
) -> tuple[Step, ds.Strategy | None]:
    """The main job's step under ``kind`` (``plain_same_step``: no strategy); the strategy distributes the data."""
    strategy: ds.Strategy | None = {
        "default": lambda: ds.get_strategy(),
        "one_device": lambda: ds.OneDeviceStrategy(str(device)),
        "mirrored": lambda: ds.MirroredStrategy([str(device)]),
    }.get(kind, lambda: None)()
    torch.manual_seed(0)
    with (strategy or ds.get_strategy()).scope():
        model = models.fashion_mnist_cnn()
        if strategy is None or kind == "default":
            model.to(device)  # the default strategy leaves tensors where they are, as TF's
        opt = models.fashion_mnist_optimizer(model.parameters())
        metrics = (ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean(), ds.metrics.SparseCategoricalAccuracy())
    forward = compiled(model, compile_backend) if compile_backend else model
    train_step, _ = make_steps(forward, opt, batch, *metrics, precision=PRECISIONS[precision])
    total = torch.zeros((), device=device)
    if strategy is None:

        def step(b: Any) -> None:
            total.add_(train_step(b).detach())

        return step, None
    run_in = strategy

    def strategy_step(b: Any) -> None:
        total.add_(run_in.reduce(ds.ReduceOp.SUM, run_in.run(train_step, args=(b,)), axis=None).detach())

    return strategy_step, (None if kind == "default" else strategy)


class Variant:
    """One loop: its step, its data iterator, its rates per round (examples/s) or its failure."""

    def __init__(
        self, name: str, build: Callable[[], tuple[Step, ds.Strategy | None]], data: Forever, batch: int, warmup: int
    ) -> None:
        self.name, self.batch, self.rates, self.error = name, batch, [], None
        self.warmup_s = 0.0
        self.notes: list[str] = []
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.step, strategy = build()
                self.batches = iter(strategy.experimental_distribute_dataset(data) if strategy else data)
                for _ in range(warmup):
                    self.step(next(self.batches))
            self.notes = sorted({str(w.message)[:200] for w in caught if issubclass(w.category, RuntimeWarning)})
        except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
            self.fail(e)
        self.warmup_s = time.perf_counter() - start

    def fail(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc(limit=3)[-1500:]

    def measure(self, steps: int, device: torch.device) -> None:
        if self.error:
            return
        try:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                self.step(next(self.batches))
            sync(device)
            self.rates.append(steps * self.batch / (time.perf_counter() - start))
        except Exception as e:  # noqa: BLE001
            self.fail(e)


def dispatch_overhead(device: torch.device, calls: int, rounds: int, batch: int) -> dict[str, Any]:
    """distrib's own cost per step, without the step's noise: ``strategy.reduce(SUM, strategy.run(fn, (x,)))``
    against ``fn(x)``, where ``fn`` launches one small kernel. Launches are asynchronous, so this times the
    host side that distrib adds to every step (Python, context switches, any extra kernel launch), which is
    what shows on a GPU once a step is shorter than its launches. Rounds alternate; medians in microseconds."""
    x = torch.ones(batch, device=device)

    def fn(b: torch.Tensor) -> torch.Tensor:
        return b.sum()

    strategies = {
        "default": ds.get_strategy(),
        "one_device": ds.OneDeviceStrategy(str(device)),
        "mirrored": ds.MirroredStrategy([str(device)]),
    }
    loops: dict[str, Callable[[], Any]] = {"bare": lambda: fn(x)}
    for name, s in strategies.items():
        loops[name] = lambda s=s: s.reduce(ds.ReduceOp.SUM, s.run(fn, args=(x,)), axis=None)
    times: dict[str, list[float]] = {k: [] for k in loops}
    for call in loops.values():
        for _ in range(200):
            call()
    for _ in range(rounds):
        for name, call in loops.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                call()
            sync(device)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    bare = statistics.median(times["bare"])
    return {
        "bare_us_per_call": bare,
        "overhead_us_per_call": {k: statistics.median(times[k]) - bare for k in strategies},
        "all_us_per_call": times,
        "calls_per_round": calls,
    }


def multi_worker(args: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    """2 worker processes on the one device over gloo; the chief's examples/s (global batch 2 x --batch)."""
    result_file = os.path.join(out_dir, "mw_result.json")
    cmd = [
        sys.executable,
        "-m",
        "distrib.app.cli",
        "launch",
        "--workers",
        "2",
        os.path.abspath(__file__),
        "--mw-worker",
        result_file,
        "--device",
        args.device,
        "--mw-steps",
        str(args.mw_steps),
        "--batch",
        str(args.batch),
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.mw_timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {args.mw_timeout}s", "output": str(e.stdout)[-3000:]}
    if proc.returncode != 0 or not os.path.exists(result_file):
        return {"error": f"exit {proc.returncode}", "output": (proc.stdout + proc.stderr)[-3000:]}
    with open(result_file) as f:
        out: dict[str, Any] = json.load(f)
    out["wall_s"] = time.perf_counter() - start
    return out


def device_batches(device: torch.device) -> tuple[Callable[[int], Forever], str]:
    """The main job's data put on ``device`` once (every loop then measures the step, not the copy) and a function
    of the batch size giving its whole batches, cycled; with where the data came from (``load_data``'s word)."""
    images, labels, source = load_data(None)
    images, labels = images.to(device), labels.to(device)

    def data(batch: int) -> Forever:
        n = len(labels) // batch * batch
        return Forever([(images[i : i + batch], labels[i : i + batch]) for i in range(0, n, batch)])

    return data, source


def seeded_main_job_step(
    strategy: ds.Strategy, global_batch: int, compile_backend: str | None = None
) -> Callable[[Any], Any]:
    """The main job's replica step (``make_steps``), its model, optimizer and metrics built in ``strategy``'s scope
    from seed 0 (the model's forward ``torch.compile`` d with ``compile_backend`` when given)."""
    torch.manual_seed(0)
    with strategy.scope():
        model = models.fashion_mnist_cnn()
        opt = models.fashion_mnist_optimizer(model.parameters())
        metrics = (ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean(), ds.metrics.SparseCategoricalAccuracy())
    forward = compiled(model, compile_backend) if compile_backend else model
    train_step, _ = make_steps(forward, opt, global_batch, *metrics)
    return train_step


def mw_worker(result_file: str, device_type: str, steps: int, batch: int) -> None:
    """One worker of :func:`multi_worker` (run by ``distrib launch``)."""
    strategy = ds.MultiWorkerMirroredStrategy(
        devices=[f"{device_type}:0"],
        communication_options=ds.CommunicationOptions(implementation="ring", timeout_seconds=60),
    )
    device = strategy.local_devices[0]
    assert device is not None
    images, labels, source = load_data(None)
    images, labels = images.to(device), labels.to(device)
    global_batch = batch * strategy.num_replicas_in_sync
    n = len(labels) // global_batch * global_batch
    batches = [(images[i : i + global_batch], labels[i : i + global_batch]) for i in range(0, n, global_batch)]
    train_step = seeded_main_job_step(strategy, global_batch)
    total = torch.zeros((), device=device)
    it = iter(strategy.experimental_distribute_dataset(Forever(batches)))
    rates = []
    for r in range(4):  # 1 warm-up round, 3 timed
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            total.add_(strategy.reduce(ds.ReduceOp.SUM, strategy.run(train_step, args=(next(it),)), axis=None).detach())
        sync(device)
        if r:
            rates.append(steps * global_batch / (time.perf_counter() - start))
    if strategy.is_chief:
        with open(result_file, "w") as f:
            json.dump(
                {
                    "examples_per_s_median": statistics.median(rates),
                    "examples_per_s_all": rates,
                    "global_batch": global_batch,
                    "backend": getattr(strategy.communicator, "backend", "?"),
                    "devices": [str(device)] * 2,
                    "data": source,
                    "finite": bool(torch.isfinite(total)),
                },
                f,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="timed steps per loop per round at batch 64")
    p.add_argument("--batch", type=int, default=BATCH, help="the seed's batch (64); smaller for a quick dry run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per loop before the rounds (compiled: +3)")
    p.add_argument("--large-batch", type=int, default=4096)
    p.add_argument("--large-steps", type=int, default=30)
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated: the eager variants at --batch")
    p.add_argument("--compile-precisions", default="fp32,bf16,fp16", help="comma-separated; '' for none")
    p.add_argument("--compile-backend", default="inductor", help="'eager' for a quick dry run of dynamo")
    p.add_argument("--budget-s", type=float, default=150.0, help="no new compiled variant after this many seconds")
    p.add_argument(
        "--dispatch-calls",
        type=int,
        default=5000,
        help="calls per round of the host-side overhead measurement; 0: skip it",
    )
    p.add_argument("--mw-steps", type=int, default=100, help="steps per round of the 2-process run; 0: skip it")
    p.add_argument("--mw-timeout", type=float, default=120.0)
    p.add_argument("--mw-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.mw_worker:
        mw_worker(args.mw_worker, args.device, args.mw_steps, args.batch)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: CUDA is not available; --device cpu runs the same loops on the CPU")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    data, source = device_batches(device)
    compile_precisions = [c for c in args.compile_precisions.split(",") if c]
    small = args.batch
    eager_precisions = [c for c in args.precisions.split(",") if c]
    plan: list[tuple[str, str, bool, int]] = [(k, prec, False, small) for prec in eager_precisions for k in KINDS]
    plan += [(k, "fp32", False, args.large_batch) for k in KINDS]
    plan += [(k, prec, True, small) for prec in compile_precisions for k in KINDS]
    variants: dict[str, Variant] = {}
    skipped: dict[str, str] = {}
    for kind, prec, comp, batch in plan:
        name = f"{kind}/{prec}/{'compiled' if comp else 'eager'}/b{batch}"
        if comp and time.perf_counter() - started > args.budget_s:
            skipped[name] = f"time budget ({args.budget_s:.0f}s) spent before its compile"
            continue
        backend = args.compile_backend if comp else None
        if kind == "plain_eager":

            def build(
                kind: str = kind, prec: str = prec, backend: str | None = backend, batch: int = batch
            ) -> tuple[Step, ds.Strategy | None]:
                return plain_eager(device, prec, backend, batch), None
        else:

            def build(
                kind: str = kind, prec: str = prec, backend: str | None = backend, batch: int = batch
            ) -> tuple[Step, ds.Strategy | None]:
                return main_job(kind, device, prec, backend, batch)

        variants[name] = Variant(name, build, data(batch), batch, warmup=args.warmup + 3 * comp)
        print(f"ready {name} ({variants[name].warmup_s:.1f}s){' FAILED' if variants[name].error else ''}", flush=True)
    for r in range(args.rounds):
        for v in variants.values():
            v.measure(args.steps if v.batch == small else args.large_steps, device)
        print(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - started:.0f}s", flush=True)
    ok = {k: v for k, v in variants.items() if not v.error and v.rates}
    med = {k: statistics.median(v.rates) for k, v in ok.items()}

    def overhead(kind: str, batch: int) -> float | None:
        a, b = ok.get(f"{kind}/fp32/eager/b{batch}"), ok.get(f"plain_same_step/fp32/eager/b{batch}")
        if a is None or b is None:
            return None
        return statistics.median((batch / x - batch / y) * 1e6 for x, y in zip(a.rates, b.rates))

    overheads = {
        f"{k}_b{b}": overhead(k, b) for k in ("default", "one_device", "mirrored") for b in (small, args.large_batch)
    }

    def plain_of(name: str) -> str:
        _, prec, comp, batch = name.split("/")
        return f"plain_eager/{prec}/{comp}/{batch}"

    ratios = {k: med[k] / med[plain_of(k)] for k in med if plain_of(k) in med}
    dispatch = dispatch_overhead(device, args.dispatch_calls, args.rounds, small) if args.dispatch_calls else {}
    mw = multi_worker(args, os.path.dirname(os.path.abspath(args.json)) if args.json else ".") if args.mw_steps else {}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "data": source,
        "rounds": args.rounds,
        "steps_per_round": {f"b{small}": args.steps, f"b{args.large_batch}": args.large_steps},
        "compile_backend": args.compile_backend,
        "examples_per_s_median": med,
        "vs_plain_eager_same_precision_and_compile": ratios,
        "overhead_us_per_step_vs_plain_same_step": overheads,
        "dispatch_overhead": dispatch,
        "multi_worker_2_processes_one_device": mw,
        "failed": {k: v.error for k, v in variants.items() if v.error},
        "skipped": skipped,
        "warnings": {k: v.notes for k, v in variants.items() if v.notes},
        "warmup_s": {k: round(v.warmup_s, 2) for k, v in variants.items()},
        "examples_per_s_all": {k: v.rates for k, v in ok.items()},
        "total_s": time.perf_counter() - started,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text)
    print(f"\n{result['device']}, torch {torch.__version__}, data: {source}, medians of {args.rounds} rounds")
    print(f"{'loop/precision/compile/batch':<44}{'examples/s':>12}{'vs plain_eager':>16}")
    for name in variants:
        if name in med:
            ratio = ratios.get(name)
            print(f"{name:<44}{med[name]:>12.0f}{'' if ratio is None else f'{ratio:16.3f}'}")
        else:
            print(f"{name:<44}{'FAILED':>12}  {(variants[name].error or 'no rate').splitlines()[0][:60]}")
    for name, why in skipped.items():
        print(f"{name:<44}{'skipped':>12}  {why}")
    print(
        "\ndistrib's overhead per step vs plain_same_step (us; target <= 50; the difference of two "
        "noisy step times: see the host-side figure below):"
    )
    for k, v in overheads.items():
        print(f"  {k:<24}{'n/a' if v is None else f'{v:8.1f}'}")
    if dispatch:
        print(
            f"\ndistrib's host-side cost per strategy.run + reduce (us; one small kernel, bare call "
            f"{dispatch['bare_us_per_call']:.1f} us):"
        )
        for k, v in dispatch["overhead_us_per_call"].items():
            print(f"  {k:<24}{v:8.1f}")
    if mw:
        print(
            f"\n2-process MultiWorkerMirrored on one {args.device}: "
            + (
                f"{mw['examples_per_s_median']:.0f} examples/s ({mw.get('backend')})"
                if "error" not in mw
                else f"FAILED: {mw['error']}"
            )
        )


if __name__ == "__main__":
    main()
