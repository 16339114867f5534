"""glibc's allocator under ``ShardedStrategy`` (and ``MeshStrategy``) on the CPU: why sharded workers need a fixed
mmap threshold.

FSDP gathers each unit's whole parameters before its forward and backward, and frees them after; it
does the same with the gradients before each reduce-scatter: blocks of a unit's size, allocated and
freed at every unit of every step. glibc's mmap threshold is dynamic: once such a block was freed, later
ones come from the heap, and the freed heap memory stays in the process. As glibc comes, a sharded worker
therefore holds *more* than a MultiWorkerMirrored one (1.31-1.32x at N=2 and 4, docs/performance.md's
allocator sweep), and sharding saves nothing.

A threshold fixed below the unit size returns every such block to the system at once (0.55x and 0.33x of
MultiWorkerMirrored's peak at N=2 and 4); the fresh mappings then cost page faults (45 % of the step's CPU
time), which transparent huge pages mostly remove (17-19 %). Both are read by glibc when the process starts,
so they go in the workers' environment: ``distrib train --strategy sharded`` puts :data:`RECIPE` there unless
the user chose an allocator; a script started otherwise gets a warning naming it and the strategy it built
(:func:`warn_if_untuned`).
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping

__all__ = ["RECIPE", "OPT_OUT", "recommended_env", "warn_if_untuned"]

log = logging.getLogger("distrib.strategies")

#: what sharded CPU workers should start with (glibc >= 2.35 knows the huge-page tunable; older ones ignore it)
RECIPE = {"MALLOC_MMAP_THRESHOLD_": "131072", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
#: ``DISTRIB_MALLOC=default``: leave glibc as it comes (no recipe, no warning)
OPT_OUT = "DISTRIB_MALLOC"
_warned = False


def _chosen(environ: Mapping[str, str]) -> str | None:
    """What says the allocator was chosen already (the variable), or None."""
    if environ.get(OPT_OUT, "").strip().lower() == "default":
        return OPT_OUT
    for name in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD"):
        if environ.get(name):
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def recommended_env(environ: Mapping[str, str] | None = None, libc: str | None = None) -> dict[str, str]:
    """The variables to add to a sharded CPU worker's environment: :data:`RECIPE`, or nothing when the C library is
    not glibc or the allocator was chosen (``MALLOC_MMAP_THRESHOLD_``, ``LD_PRELOAD``, a ``glibc.malloc``
    tunable, ``DISTRIB_MALLOC=default``). Other tunables in ``GLIBC_TUNABLES`` are kept.

    >>> recommended_env({}, libc="glibc")["MALLOC_MMAP_THRESHOLD_"]
    '131072'
    >>> recommended_env({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, libc="glibc")["GLIBC_TUNABLES"]
    'glibc.cpu.hwcaps=-AVX2:glibc.malloc.hugetlb=1'
    >>> recommended_env({"LD_PRELOAD": "libjemalloc.so.2"}, libc="glibc")
    {}
    """
    environ = os.environ if environ is None else environ
    if (libc if libc is not None else platform.libc_ver()[0]) != "glibc" or _chosen(environ) is not None:
        return {}
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {
        **RECIPE,
        "GLIBC_TUNABLES": f"{tunables}:{RECIPE['GLIBC_TUNABLES']}" if tunables else RECIPE["GLIBC_TUNABLES"],
    }


def warn_if_untuned(device_type: str, num_workers: int, chief: bool, strategy: str = "ShardedStrategy") -> None:
    """Once per process, on the chief: sharded CPU workers on glibc as it comes hold more memory than unsharded
    ones; say what to start them with, naming ``strategy`` (the class the user built) and where the settings go
    for it (``distrib train --strategy sharded`` sets them itself; a ``MeshStrategy`` script is started by the
    user, so the settings go into the launch's environment)."""
    global _warned
    if _warned or not chief or device_type != "cpu" or num_workers < 2 or not recommended_env():
        return
    _warned = True
    setting = " ".join(f"{k}={v}" for k, v in RECIPE.items())
    where = (
        "distrib train --strategy sharded does"
        if strategy == "ShardedStrategy"
        else "in the environment of distrib launch or torchrun: glibc reads them when a process starts"
    )
    log.warning(
        "%s on the CPU with glibc's allocator as it comes: each worker will hold about 1.3x the memory of "
        "MultiWorkerMirroredStrategy (FSDP's freed unit buffers stay in glibc's heap). Start the workers with "
        "%s (%s; docs/performance.md: 0.55x at 2 workers, 0.33x at 4, for 17-19%% of the step's CPU time), or "
        "set %s=default to keep glibc as it is and silence this",
        strategy,
        setting,
        where,
        OPT_OUT,
    )
