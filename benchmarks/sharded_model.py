"""What the sharded-strategy benchmarks and the memory-limit test share: the model, its data, the memory probes.

Imported by benchmarks/sharded_memory.py, benchmarks/sharded_speed.py (both run as scripts, so this
directory is on ``sys.path``) and tests/scripts/sharded_memory_limit.py (which puts this directory on
``sys.path`` itself). One definition, so the three measure the same model the same way:

* :class:`Block`, :func:`build_model`: ``blocks`` residual blocks ``x + relu(Linear(width, width)(x))``,
  each a natural sharding unit (:func:`make_strategy` shards per ``Block``);
* :func:`batches`: the (inputs, targets) global batches, from a fixed seed; :func:`make_step`: the step;
* :func:`vm_status`, :func:`reset_high_water_mark`, :func:`warm_up`: what the memory figures rest on;
* :func:`allocator_env`, :func:`after_step`: glibc allocator settings named on the command line
  (``--malloc``), put in the workers' environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

import torch
from torch import nn

#: set in a worker's environment by allocator_env("...+trim"): after_step() then calls glibc's malloc_trim(0)
TRIM_VARIABLE = "DISTRIB_BENCH_MALLOC_TRIM"
#: the glibc variables allocator_env sets; any of them inherited from the caller is removed first
MALLOC_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_ARENA_MAX",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
    "MALLOC_CONF",
    TRIM_VARIABLE,
)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


class Block(nn.Module):
    """A residual block ``x + relu(fc(x))``: one sharding unit."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


def build_model(width: int, blocks: int, seed: int = 0) -> nn.Sequential:
    """``blocks`` :class:`Block` of ``width`` in a row, initialised from ``seed`` (the same in every variant)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def params(width: int, blocks: int) -> int:
    """The parameter count of ``build_model(width, blocks)``."""
    return blocks * (width * width + width)


def make_strategy(name: str) -> Any:
    """``"sharded"``: ``ds.ShardedStrategy`` with every :class:`Block` a unit; ``"mwms"``: MultiWorkerMirrored."""
    import distrib as ds

    if name == "sharded":
        return ds.ShardedStrategy(sharding_policy=ds.ShardingPolicy(module_classes=[Block]))
    if name == "mwms":
        return ds.MultiWorkerMirroredStrategy()
    raise ValueError(f"unknown strategy {name!r}: use 'sharded' or 'mwms'")


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, global_batch: int) -> Any:
    """The training step every variant runs inside ``strategy.run``: mean squared error per row, scaled by the
    global batch (``ds.compute_average_loss``), backward, Adam; returns the loss."""
    import distrib as ds

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss((model(x) - y).pow(2).mean(1), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def batches(n: int, global_batch: int, width: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches (inputs, targets) of ``global_batch`` rows, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(global_batch, width, generator=g), torch.randn(global_batch, width, generator=g)) for _ in range(n)
    ]


def vm_status() -> dict[str, int]:
    """This process's ``Vm*`` figures from /proc/self/status (VmRSS, VmHWM, VmSize, VmPeak, ...), in bytes."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if line.startswith("Vm"))}


def reset_high_water_mark() -> None:
    """Reset VmHWM (the kernel's peak RSS) to the current RSS (Linux >= 4.0, ``clear_refs`` 5).

    VmPeak (virtual) cannot be reset."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def warm_up() -> None:
    """Load what the measured phases would otherwise load on first use (FSDP2's modules, Adam, autograd), so
    that code is counted in the baseline, not in the model's memory."""
    import torch.distributed.fsdp  # noqa: F401  (the sharded strategy imports it when it first shards)
    import torch.distributed.tensor  # noqa: F401

    layer = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def _size(text: str) -> int | None:
    """``"128k"`` -> 131072 (binary units k, m, g); None when ``text`` is no size."""
    text = text.strip().lower()
    unit = text[-1:] if text[-1:] in ("k", "m", "g") else ""
    try:
        return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
    except ValueError:
        return None


def allocator_env(spec: str) -> dict[str, str]:
    """The workers' environment variables for the allocator setting ``spec``.

    ``default`` (glibc as it comes: a dynamic mmap threshold), or parts joined by ``+``:
    ``mmap:SIZE`` (``MALLOC_MMAP_THRESHOLD_``, a fixed threshold; glibc ignores one over 32 MiB on 64-bit),
    ``trimthr:SIZE`` (``MALLOC_TRIM_THRESHOLD_``), ``toppad:SIZE`` (``MALLOC_TOP_PAD_``), ``arena:N``
    (``MALLOC_ARENA_MAX``), ``trim`` (glibc's ``malloc_trim(0)`` after every step, see :func:`after_step`),
    ``thp`` (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc >= 2.35: malloc asks for transparent huge pages,
    ``madvise(MADV_HUGEPAGE)``, on what it maps, so a fresh 16 MB block takes 8 page faults instead of 4096).
    SIZE takes k/m/g (binary). ``mmap`` alone means ``mmap:128k``. Note: glibc fixes the mmap threshold
    (no longer dynamic) once any of the mmap, trim-threshold or top-pad variables is set.
    """
    env: dict[str, str] = {}
    if spec == "default":
        return env
    names = {"mmap": "MALLOC_MMAP_THRESHOLD_", "trimthr": "MALLOC_TRIM_THRESHOLD_", "toppad": "MALLOC_TOP_PAD_"}
    for part in spec.split("+"):
        key, _, value = part.partition(":")
        if key == "mmap" and not value:
            value = "128k"
        size = _size(value) if value else None
        if key in names and size is not None:
            env[names[key]] = str(size)
        elif key == "arena" and value.isdigit():
            env["MALLOC_ARENA_MAX"] = value
        elif key == "trim" and not value:
            env[TRIM_VARIABLE] = "1"
        elif key == "thp" and not value:
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        elif key == "jemalloc" and (not value or value.isdigit()):
            library = ctypes.util.find_library("jemalloc")
            if library is None:
                raise ValueError("jemalloc is not installed (Debian: apt-get install libjemalloc2)")
            env["LD_PRELOAD"] = library
            if value:
                env["MALLOC_CONF"] = f"dirty_decay_ms:{value},muzzy_decay_ms:{value}"
        else:
            raise ValueError(
                f"unknown allocator setting {part!r} in {spec!r}: use default, mmap:SIZE, "
                "trimthr:SIZE, toppad:SIZE, arena:N, trim, thp, jemalloc or jemalloc:MS, joined by '+'"
            )
    return env


def worker_env(spec: str) -> dict[str, str]:
    """This process's environment for a benchmark's workers: one torch thread, no TF_CONFIG, the allocator
    variables of ``spec`` only (any inherited from the caller removed)."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES and k != "TF_CONFIG"}
    return {**env, "OMP_NUM_THREADS": "1", **allocator_env(spec)}


_libc: Any = None


def after_step() -> None:
    """Call glibc's ``malloc_trim(0)`` (return every free page of every arena to the system) when the worker
    runs under an allocator setting with ``trim``; otherwise nothing."""
    global _libc
    if os.environ.get(TRIM_VARIABLE) != "1":
        return
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim(0)
