"""A worker-only cluster from torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

The same variables describe a cluster under Kubeflow's PyTorchJob (which sets all four
in every pod), under ``distrib launch`` (which exports them beside ``TF_CONFIG``), and a
process group a script initialised itself (``mp.spawn`` tutorials set ``MASTER_ADDR`` and
``MASTER_PORT``; see :meth:`TorchrunClusterResolver.from_process_group`).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping

from distrib.cluster.resolver import ClusterResolver
from distrib.cluster.spec import ClusterSpec

__all__ = ["TorchrunClusterResolver"]

_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TorchrunClusterResolver(ClusterResolver):
    """Worker ``RANK`` of ``WORLD_SIZE``; they rendezvous at ``MASTER_ADDR:MASTER_PORT``.

    torchrun does not tell the other workers' addresses, and collectives only need the
    rendezvous point, so worker *i* is listed as ``MASTER_ADDR:MASTER_PORT+i``: worker 0's
    address is the rendezvous address. ``rpc_layer`` is None. ``local_rank`` and
    ``local_world_size`` are torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (None when
    unset); ``spans_hosts`` says whether the workers run on several hosts (None: unknown).

    Args:
        environ: the variables to read (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
            optionally ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); None: ``os.environ``.

    Raises:
        ValueError: one of the four variables is missing, ``RANK``/``WORLD_SIZE``/``MASTER_PORT`` (or a local
            one) is not an integer or out of range, or ``MASTER_ADDR`` is not a valid host.

    Example::

        >>> r = TorchrunClusterResolver({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
        >>> r.task_type, r.task_id, r.rendezvous_address(), r.master()
        ('worker', 1, 'h:29500', 'h:29501')
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        missing = [v for v in _VARS if v not in env]
        if missing:
            raise ValueError(f"torchrun variables missing: {', '.join(missing)} (need {', '.join(_VARS)})")
        try:
            rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        except ValueError:
            raise ValueError(
                f"RANK, WORLD_SIZE and MASTER_PORT must be integers, got "
                f"{env['RANK']!r}, {env['WORLD_SIZE']!r}, {env['MASTER_PORT']!r}"
            ) from None
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
        if not 0 < port <= 65536 - world:
            raise ValueError(
                f"MASTER_PORT={port} must be in 1..{65536 - world} (workers are listed at "
                f"MASTER_PORT..MASTER_PORT+WORLD_SIZE-1)"
            )
        host = env["MASTER_ADDR"]
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address (torchrun may give one bare): bracketed in host:port
        try:
            self._spec = ClusterSpec({"worker": [f"{host}:{port + i}" for i in range(world)]})
        except ValueError as e:
            raise ValueError(f"MASTER_ADDR={host!r} is not a valid host: {e}") from None
        self.task_type, self.task_id = "worker", rank
        self.local_rank = _optional_int(env, "LOCAL_RANK")
        self.local_world_size = _optional_int(env, "LOCAL_WORLD_SIZE")
        if (
            self.local_rank is not None
            and self.local_world_size is not None
            and not (0 <= self.local_rank < self.local_world_size <= world)
        ):
            raise ValueError(
                f"LOCAL_RANK={self.local_rank} and LOCAL_WORLD_SIZE={self.local_world_size} do not fit "
                f"in WORLD_SIZE={world}: need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE"
            )

    @classmethod
    def from_process_group(
        cls, rank: int, world_size: int, environ: Mapping[str, str] | None = None
    ) -> TorchrunClusterResolver:
        """The cluster of a process group that is already initialised (rank ``rank`` of ``world_size``).

        Its rendezvous point is ``MASTER_ADDR:MASTER_PORT`` when set (the ``mp.spawn``
        tutorials set them), else ``localhost:29500`` (torch's default port): the group is
        used as it is, so the addresses are descriptive only.

        Args:
            rank: this process's rank in the group.
            world_size: the group's size.
            environ: where to read ``MASTER_ADDR`` and ``MASTER_PORT``; None: ``os.environ``.

        Returns:
            A resolver of ``world_size`` workers, this one worker ``rank``.

        Raises:
            ValueError: ``rank`` is out of range for ``world_size``, or ``MASTER_ADDR`` is not a valid host.

        Example::

            >>> r = TorchrunClusterResolver.from_process_group(1, 2, {"MASTER_ADDR": "localhost", "MASTER_PORT": "12355"})
            >>> r.task_id, r.cluster_spec().num_tasks("worker"), r.rendezvous_address()
            (1, 2, 'localhost:12355')
        """
        env = os.environ if environ is None else environ
        port = env.get("MASTER_PORT", "29500")
        if not port.isdigit() or not 0 < int(port) <= 65536 - world_size:
            port = "29500"
        return cls(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": env.get("MASTER_ADDR", "localhost"),
                "MASTER_PORT": port,
            }
        )

    @property
    def spans_hosts(self) -> bool | None:
        """Whether the workers run on several hosts: ``WORLD_SIZE > LOCAL_WORLD_SIZE`` (None when unknown).

        A loopback ``MASTER_ADDR`` (``localhost``, ``127.0.0.1``, ``::1``: torchrun ``--standalone``,
        or several agents on one host) means one host whatever the local sizes: a worker on
        another host would reach its own loopback, not this store.

        Example (two torchrun agents of one process each, on one host)::

            >>> env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
            ...        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
            >>> TorchrunClusterResolver(env).spans_hosts, TorchrunClusterResolver({**env, "MASTER_ADDR": "n0"}).spans_hosts
            (False, True)
        """
        if _is_loopback_host(self.rendezvous_address().rpartition(":")[0].strip("[]")):
            return False
        if self.local_world_size is None:
            return None
        return self.cluster_spec().num_tasks("worker") > self.local_world_size

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> TorchrunClusterResolver:
        """This resolver read from ``environ``, as ``resolve()`` builds it.

        Args:
            environ: the variables to read; None: ``os.environ``.

        Returns:
            ``TorchrunClusterResolver(environ)``.

        Raises:
            ValueError: a variable is missing or malformed (see the class).
        """
        return cls(environ)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``environ`` describes a torchrun cluster (how ``resolve()`` picks this resolver).

        Args:
            environ: the variables to look at; None: ``os.environ``.

        Returns:
            True when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set.
        """
        env = os.environ if environ is None else environ
        return all(v in env for v in _VARS)

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


def _is_loopback_host(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None
