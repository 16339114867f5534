"""A worker-only cluster from torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

from distrib.cluster.resolver import ClusterResolver
from distrib.cluster.spec import ClusterSpec

__all__ = ["TorchrunClusterResolver"]

_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TorchrunClusterResolver(ClusterResolver):
    """Worker ``RANK`` of ``WORLD_SIZE``; they rendezvous at ``MASTER_ADDR:MASTER_PORT``.

    torchrun does not tell the other workers' addresses, and collectives only need the
    rendezvous point, so worker *i* is listed as ``MASTER_ADDR:MASTER_PORT+i``: worker 0's
    address is the rendezvous address. ``rpc_layer`` is None.

    Example::

        >>> r = TorchrunClusterResolver({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
        >>> r.task_type, r.task_id, r.rendezvous_address(), r.master()
        ('worker', 1, 'h:29500', 'h:29501')
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if environ is None else environ
        missing = [v for v in _VARS if v not in env]
        if missing:
            raise ValueError(f"torchrun variables missing: {', '.join(missing)} (need {', '.join(_VARS)})")
        try:
            rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        except ValueError:
            raise ValueError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers, got "
                             f"{env['RANK']!r}, {env['WORLD_SIZE']!r}, {env['MASTER_PORT']!r}") from None
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
        if not 0 < port <= 65536 - world:
            raise ValueError(f"MASTER_PORT={port} must be in 1..{65536 - world} (workers are listed at "
                             f"MASTER_PORT..MASTER_PORT+WORLD_SIZE-1)")
        host = env["MASTER_ADDR"]
        try:
            self._spec = ClusterSpec({"worker": [f"{host}:{port + i}" for i in range(world)]})
        except ValueError as e:
            raise ValueError(f"MASTER_ADDR={host!r} is not a valid host: {e}") from None
        self.task_type, self.task_id = "worker", rank

    @staticmethod
    def detect(environ: Optional[Mapping[str, str]] = None) -> bool:
        env = os.environ if environ is None else environ
        return all(v in env for v in _VARS)

    def cluster_spec(self) -> ClusterSpec:
        return self._spec
