"""The loopback cluster ``distrib launch`` starts on this host: free ports, its spec, each task's variables.

Every task of a launch runs on this host, so the cluster is a set of loopback addresses picked fresh for each
start (a restart gets new ports, so a task of the old group that is still closing its sockets is never in the
way). What each task is told beside ``TF_CONFIG`` comes from here too: torchrun's variables (a DDP-style script
runs unchanged) and its share of the host's CPUs (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_ports", "make_cluster", "threads_per_task", "torchrun_variables"]


def torchrun_variables(cluster: dict[str, list[str]], task_type: str, index: int) -> dict[str, str]:
    """torchrun's variables for one task of a worker-only local ``cluster``; empty for a ``ps`` task.

    The ranks count the chief first, then the workers, as ``TF_CONFIG``'s resolver does;
    ``MASTER_ADDR:MASTER_PORT`` is rank 0's address, where distrib's rendezvous is.

    Example::

        >>> c = {"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001", "127.0.0.1:5002"]}
        >>> v = torchrun_variables(c, "worker", 1)
        >>> v["RANK"], v["WORLD_SIZE"], v["LOCAL_RANK"], v["MASTER_ADDR"], v["MASTER_PORT"]
        ('2', '3', '2', '127.0.0.1', '5000')
    """
    ranked = [(job, i) for job in ("chief", "worker") for i in range(len(cluster.get(job, [])))]
    if (task_type, index) not in ranked:
        return {}
    rank, world = ranked.index((task_type, index)), len(ranked)
    host, _, port = cluster[ranked[0][0]][0].rpartition(":")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": host.strip("[]"),
        "MASTER_PORT": port,
    }


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_cluster(workers: int, ps: int, chief: bool, host: str = "127.0.0.1") -> dict[str, list[str]]:
    """A loopback cluster spec with fresh ports; a ps cluster always has a chief (the coordinator)."""
    chief = chief or ps > 0
    ports = iter(free_ports(workers + ps + int(chief), host))
    cluster: dict[str, list[str]] = {}
    if chief:
        cluster["chief"] = [f"{host}:{next(ports)}"]
    cluster["worker"] = [f"{host}:{next(ports)}" for _ in range(workers)]
    if ps:
        cluster["ps"] = [f"{host}:{next(ports)}" for _ in range(ps)]
    return cluster


def threads_per_task(cluster: dict[str, list[str]], with_ps: bool, env: dict[str, str]) -> str | None:
    """``OMP_NUM_THREADS`` for each task: the usable CPUs shared among the training tasks; None if ``env`` sets it.

    The training tasks are every chief and worker, or with parameter servers the workers only (the chief
    coordinates, the ps tasks apply updates). torch gives each process as many threads as the host has CPUs, so
    N processes on one host would otherwise run N times as many threads as there are cores.
    """
    if "OMP_NUM_THREADS" in env:
        return None
    training = len(cluster.get("worker", [])) if with_ps else sum(len(cluster.get(t, [])) for t in ("chief", "worker"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return str(max(1, cpus // max(1, training)))
