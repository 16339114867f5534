"""``SlurmClusterResolver``: a worker cluster from the variables Slurm sets for each task."""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from distrib.cluster.resolver import ClusterResolver
from distrib.cluster.spec import ClusterSpec

__all__ = ["SlurmClusterResolver", "expand_hostlist"]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: ``"n[01-03,07],gpu5"`` -> n01, n02, n03, n07, gpu5."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


class SlurmClusterResolver(ClusterResolver):
    """Every Slurm task is a worker; worker addresses are ``node:port_base+k`` for the k-th task on a node."""

    def __init__(self, port_base: int = 8888, environ: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if environ is None else environ
        missing = [v for v in ("SLURM_PROCID", "SLURM_NTASKS") if v not in env]
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if missing or not nodelist:
            raise ValueError("not inside a Slurm job step: SLURM_PROCID, SLURM_NTASKS and SLURM_STEP_NODELIST "
                             "(or SLURM_JOB_NODELIST) must be set; run this under srun")
        nodes = expand_hostlist(nodelist)
        ntasks = int(env["SLURM_NTASKS"])
        per_node = -(-ntasks // len(nodes))
        addresses = [f"{nodes[i // per_node]}:{port_base + i % per_node}" for i in range(ntasks)]
        self._spec = ClusterSpec({"worker": addresses})
        self.task_type, self.task_id = "worker", int(env["SLURM_PROCID"])

    @staticmethod
    def detect(environ: Optional[Mapping[str, str]] = None) -> bool:
        env = os.environ if environ is None else environ
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env

    def cluster_spec(self) -> ClusterSpec:
        return self._spec
