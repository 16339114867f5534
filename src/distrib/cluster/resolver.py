"""The base of cluster resolvers: who is in the cluster and which task this process is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from distrib.cluster.spec import ClusterSpec

__all__ = ["ClusterResolver", "SimpleClusterResolver"]


class ClusterResolver:
    """A cluster spec plus this process's task. Subclasses read one environment each.

    ``rpc_layer`` is kept as TF reads it (from ``TF_CONFIG``) but does not choose a
    transport: workers always talk through ``torch.distributed`` (gloo or NCCL) and
    parameter servers through gRPC (see docs/migration.md).
    """

    rpc_layer: Optional[str] = "grpc"

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    task_type: Optional[str] = None
    task_id: Optional[int] = None

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None) -> str:
        """Address of the given task (default: the chief), where collectives rendezvous."""
        spec = self.cluster_spec()
        if task_type is None:
            task_type, task_id = spec.chief()
        return spec.task_address(task_type, task_id or 0)

    @property
    def is_chief(self) -> bool:
        """True for the ``chief`` task, or worker 0 when the cluster has no chief (or for no task)."""
        spec = self.cluster_spec()
        if self.task_type is None:
            return True
        return (self.task_type, self.task_id or 0) == spec.chief()

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: object = None) -> dict[str, int]:
        """The accelerators of this machine, ``{"GPU": n}`` (``{}`` without CUDA).

        TF asks the given task; distrib can only see this process's machine, so
        ``task_type``, ``task_id`` and ``config_proto`` are accepted and ignored.
        """
        import torch

        return {"GPU": torch.cuda.device_count()} if torch.cuda.is_available() else {}


@dataclass
class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit values (``tf.distribute.cluster_resolver.SimpleClusterResolver``).

    Example::

        >>> r = SimpleClusterResolver(ClusterSpec({"worker": ["localhost:1111", "localhost:2222"]}), "worker", 1)
        >>> r.is_chief, r.master()
        (False, 'localhost:1111')
    """

    spec: ClusterSpec
    task_type: Optional[str] = None
    task_id: Optional[int] = None
    rpc_layer: Optional[str] = "grpc"

    def __post_init__(self) -> None:
        self.spec = ClusterSpec(self.spec)
        if self.task_type is not None:
            self.spec.task_address(self.task_type, self.task_id or 0)  # validates both

    def cluster_spec(self) -> ClusterSpec:
        return self.spec
