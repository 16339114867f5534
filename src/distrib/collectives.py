"""Cross-worker collectives, behind one small interface.

Strategies never call ``torch.distributed`` themselves: each holds a
:class:`Communicator`. A single-process strategy holds :class:`LocalCommunicator`,
for which every collective is the identity; multi-worker strategies hold one
backed by a ``torch.distributed`` process group.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from distrib.values import ReduceOp

__all__ = ["CollectiveError", "CommunicationOptions", "Communicator", "LocalCommunicator", "ProcessGroupCommunicator"]

log = logging.getLogger("distrib.collectives")


class Communicator(Protocol):
    """The collectives a strategy needs across worker processes."""

    @property
    def rank(self) -> int:
        """This worker's index among the workers (0 on the chief's side of the collective)."""
        ...

    @property
    def world_size(self) -> int:
        """How many worker processes take part."""
        ...

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
        """Reduce every tensor in place over all workers (SUM, or MEAN over workers)."""
        ...

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate ``tensor`` from every worker along ``axis``; sizes along ``axis`` may differ."""
        ...

    def barrier(self) -> None:
        """Return once every worker has called it."""
        ...


class LocalCommunicator:
    """The communicator of a single process: one worker, every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None


# --------------------------------------------------------------------------- multi-worker

DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_BYTES_PER_PACK = 25 << 20  # DDP's default bucket size


@dataclass(frozen=True)
class CommunicationOptions:
    """How workers talk (``tf.distribute.experimental.CommunicationOptions``).

    ``bytes_per_pack``: gradient bucket size for the all-reduce overlapped with the
    backward pass (0: 25 MiB, DDP's default). ``timeout_seconds``: how long any
    collective may wait for a peer before it fails (None: 300 s); a dead or hung
    worker becomes an error on every survivor within this time. ``implementation``:
    ``"auto"`` (NCCL on GPU, gloo on CPU), ``"ring"``/``"gloo"``, or ``"nccl"``.
    """

    bytes_per_pack: int = 0
    timeout_seconds: Optional[float] = None
    implementation: str = "auto"

    def __post_init__(self) -> None:
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive or None, got {self.timeout_seconds}")
        if self.implementation.lower() not in ("auto", "ring", "gloo", "nccl"):
            raise ValueError(f"implementation must be 'auto', 'ring', 'gloo' or 'nccl', got {self.implementation!r}")

    @property
    def timeout(self) -> float:
        return self.timeout_seconds if self.timeout_seconds is not None else DEFAULT_TIMEOUT_SECONDS

    @property
    def bucket_bytes(self) -> int:
        return self.bytes_per_pack or DEFAULT_BYTES_PER_PACK

    def backend(self, uses_cuda: bool) -> str:
        impl = self.implementation.lower()
        if impl == "nccl" or (impl == "auto" and uses_cuda):
            return "nccl"
        return "gloo"


class CollectiveError(RuntimeError):
    """A collective across workers failed: a peer died, hung past the timeout, or the rendezvous failed."""


class ProcessGroupCommunicator:
    """A :class:`Communicator` over a ``torch.distributed`` process group (gloo or NCCL).

    Joining is a rendezvous at ``master_address`` (the chief's ``host:port``): it waits
    at most ``options.timeout`` for every worker to arrive.
    """

    def __init__(self, master_address: str, rank: int, world_size: int,
                 options: CommunicationOptions, uses_cuda: bool = False) -> None:
        self.options = options
        self._rank, self._world_size = rank, world_size
        self.backend = options.backend(uses_cuda)
        host, _, port = master_address.rpartition(":")
        if host in ("localhost", "127.0.0.1", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep loopback clusters off other interfaces
        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise CollectiveError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but this cluster says rank {rank} of {world_size}")
            self.group = dist.group.WORLD
            return
        log.info("worker %d/%d joining at %s (%s, timeout %.0fs)", rank, world_size, master_address,
                 self.backend, options.timeout)
        try:
            dist.init_process_group(self.backend, init_method=f"tcp://{host.strip('[]')}:{port}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=options.timeout))
        except Exception as e:  # noqa: BLE001 - re-raised with what to check
            raise CollectiveError(
                f"worker {rank} could not join the {world_size}-worker cluster at {master_address} within "
                f"{options.timeout:.0f}s: {e}. Check that every worker is started with the same cluster "
                "and that the chief's address is reachable") from e
        self.group = dist.group.WORLD

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _failed(self, what: str, error: Exception) -> CollectiveError:
        return CollectiveError(
            f"{what} across {self._world_size} workers failed on worker {self._rank}: {error}. A peer died "
            f"or did not answer within {self.options.timeout:.0f}s (CommunicationOptions(timeout_seconds=...)); "
            "see the other workers' logs")

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
        if not tensors:
            return
        try:
            if len(tensors) == 1:
                dist.all_reduce(tensors[0], group=self.group)
            else:
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.all_reduce(flat, group=self.group)
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        except RuntimeError as e:
            raise self._failed("all-reduce", e) from e
        if op is ReduceOp.MEAN:
            for t in tensors:
                t.div_(self._world_size)

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        try:
            size = torch.tensor([tensor.shape[axis]], device=tensor.device)
            sizes = [torch.zeros_like(size) for _ in range(self._world_size)]
            dist.all_gather(sizes, size, group=self.group)
            longest = int(max(s.item() for s in sizes))
            pad = list(tensor.shape)
            pad[axis] = longest - tensor.shape[axis]
            padded = torch.cat([tensor, tensor.new_zeros(pad)], dim=axis)
            parts = [torch.empty_like(padded) for _ in range(self._world_size)]
            dist.all_gather(parts, padded.contiguous(), group=self.group)
        except RuntimeError as e:
            raise self._failed("all-gather", e) from e
        return torch.cat([p.narrow(axis, 0, int(s.item())) for p, s in zip(parts, sizes)], dim=axis)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every worker with worker ``src``'s values."""
        if not tensors:
            return
        try:
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            dist.broadcast(flat, src, group=self.group)
        except RuntimeError as e:
            raise self._failed("broadcast", e) from e
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def barrier(self) -> None:
        try:
            dist.barrier(group=self.group)
        except RuntimeError as e:
            raise self._failed("barrier", e) from e

    def all_reduce_async(self, tensor: torch.Tensor) -> "dist.Work":
        """Start a SUM all-reduce of ``tensor`` in place; wait on the returned work."""
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def wait(self, work: "dist.Work") -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise self._failed("all-reduce", e) from e
