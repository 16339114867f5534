"""Joining the other worker processes: the cluster, the communicator, this process's devices.

What every strategy that spans worker processes does first (``MultiWorkerMirroredStrategy``,
``ShardedStrategy``). The cluster comes from ``cluster_resolver``, else from a ``torch.distributed``
process group the script already initialised (its rank, world size and backend are used), else
from ``TF_CONFIG``, torchrun's variables or Slurm's; without any, it is one worker. Workers
rendezvous at the chief's address (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distrib import cluster
from distrib.cluster.resolver import ClusterResolver, worker_rank
from distrib.comm import CommunicationOptions, Communicator, LocalCommunicator
from distrib.comm.process_group import ProcessGroupCommunicator, current_group
from distrib.strategies.devices import parse_device, worker_devices

__all__ = ["WorkerGroup", "join_workers", "take_chiefs_values"]

log = logging.getLogger("distrib.strategies")


@dataclass(frozen=True)
class WorkerGroup:
    """This process's place among the workers: the resolver, the communicator and the local devices."""

    resolver: ClusterResolver
    communicator: Communicator
    devices: list[torch.device]
    device_names: list[str]


def join_workers(
    cluster_resolver: ClusterResolver | None,
    options: CommunicationOptions,
    devices: Sequence[str] | None,
    fault_tolerant: bool = False,
) -> WorkerGroup:
    """Resolve the cluster and connect to the other workers (a process group when there are several).

    ``devices``: this process's local devices (default: one GPU per launched process, else every
    local GPU, or the CPU: :func:`~distrib.strategies.devices.worker_devices`). ``fault_tolerant``: join
    through the store ``distrib launch --fault-tolerant`` hosts, in a group whose membership may shrink
    (:class:`~distrib.comm.membership.FaultTolerantCommunicator`).
    """
    group = current_group()
    resolver = cluster_resolver or _resolver_for(group)
    names = list(devices) if devices is not None else worker_devices(group=group[:2] if group else None)
    parsed = [parse_device(n) for n in names]
    rank, world = worker_rank(resolver)
    if group is not None:
        _check_group(
            group,
            rank,
            world,
            "the cluster_resolver" if cluster_resolver is not None else f"the environment ({type(resolver).__name__})",
        )
    communicator: Communicator
    if fault_tolerant:
        communicator = _fault_tolerant_communicator(rank, world, options, parsed)
    elif world > 1:
        spec = resolver.cluster_spec()
        hosts = [
            spec.task_address(job, i).rpartition(":")[0].strip("[]")
            for job in ("chief", "worker")
            if job in spec.jobs
            for i in spec.task_indices(job)
        ]
        communicator = ProcessGroupCommunicator(
            resolver.rendezvous_address(),
            rank,
            world,
            options,
            uses_cuda=parsed[0].type == "cuda",
            hosts=hosts,
            across_hosts=resolver.spans_hosts,
            device=parsed[0],
        )
    else:
        communicator = LocalCommunicator()
    return WorkerGroup(resolver, communicator, parsed, names)


def _fault_tolerant_communicator(
    rank: int, world: int, options: CommunicationOptions, devices: list[torch.device]
) -> Communicator:
    """The communicator of a fault-tolerant worker: joined through the store named in the environment."""
    from distrib.comm.membership import STORE_VARIABLE, FaultTolerantCommunicator

    if len(devices) != 1:
        raise ValueError(
            f"MultiWorkerMirroredStrategy(fault_tolerant=True) runs one replica per worker, got devices={devices}: "
            "give one device per worker (devices=['cpu']) and start more workers instead"
        )
    address = os.environ.get(STORE_VARIABLE)
    if address is None:
        if world == 1:
            return LocalCommunicator()  # one worker: no peer to lose
        raise ValueError(
            f"MultiWorkerMirroredStrategy(fault_tolerant=True) needs a store that outlives every worker, named in "
            f"{STORE_VARIABLE}: start the workers with distrib launch --fault-tolerant"
        )
    return FaultTolerantCommunicator(address, rank, world, options, uses_cuda=devices[0].type == "cuda")


def take_chiefs_values(communicator: Communicator, module: torch.nn.Module) -> None:
    """Give every worker the chief's parameters and buffers of ``module`` (built on each worker, maybe unseeded).

    The workers first check that they built the same thing (names, dtypes, shapes): a mismatch is a
    ``CollectiveError`` on every worker naming the difference, not a broadcast of garbage.
    """
    if communicator.world_size == 1:
        return
    named = [*module.named_parameters(), *module.named_buffers()]
    communicator.verify_same(
        "; ".join(f"{name}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for name, t in named),
        f"the {type(module).__name__} built in strategy.scope()",
    )
    communicator.broadcast([t.detach() for _, t in named], src=0)


def _resolver_for(group: tuple[int, int, str] | None) -> ClusterResolver:
    """The cluster when no resolver is given: the environment's, else the initialised group's, else one worker."""
    found = cluster.resolve()
    if found is not None:
        return found  # checked against an initialised group by _check_group, as a given resolver is
    if group is None:
        return cluster.TFConfigClusterResolver(environ={})
    rank, world, backend = group
    log.info("using the initialised %s process group as the cluster: rank %d of %d", backend, rank, world)
    return cluster.TorchrunClusterResolver.from_process_group(rank, world)


def _check_group(group: tuple[int, int, str], rank: int, world: int, source: str) -> None:
    """A ``torch.distributed`` group the script initialised must be the cluster ``source`` describes."""
    if group[:2] == (rank, world):
        return
    raise ValueError(
        f"torch.distributed is already initialised as rank {group[0]} of {group[1]}, but {source} says rank {rank} "
        f"of {world}: the strategy's cluster must be the initialised group. Initialise the group with that rank and "
        "world size, or take the cluster from the group (pass no cluster_resolver and unset TF_CONFIG / torchrun's "
        "/ Slurm's variables that describe another cluster), or destroy the group first"
    )
