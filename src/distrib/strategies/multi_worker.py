"""``MultiWorkerMirroredStrategy``: Mirrored, plus a collective across worker processes."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from distrib import cluster
from distrib.cluster.resolver import ClusterResolver, worker_rank  # worker_rank: re-exported
from distrib.comm import CommunicationOptions, Communicator, LocalCommunicator
from distrib.comm.process_group import ProcessGroupCommunicator, current_group
from distrib.strategies.devices import parse_device, worker_devices
from distrib.strategies.synchronous import SynchronousStrategy

__all__ = ["MultiWorkerMirroredStrategy", "worker_rank"]

log = logging.getLogger("distrib.strategies")


class MultiWorkerMirroredStrategy(SynchronousStrategy):
    """Synchronous training over worker processes, each with one or more local replicas.

    The cluster comes from ``cluster_resolver``, else from a ``torch.distributed`` process
    group the script already initialised (``mp.spawn`` tutorials, frameworks: its rank,
    world size and backend are used), else from ``TF_CONFIG``, torchrun's variables or
    Slurm's; without any, it is one worker. Workers rendezvous at the chief's address
    and all-reduce gradients (gloo on CPU, NCCL on GPU) in buckets overlapped with the
    backward pass. Parameters of modules built in the scope start equal everywhere: the
    chief's values are broadcast. ``devices`` (an extension of TF's API) sets the local
    replicas, e.g. ``["cpu:0", "cpu:1"]``. The default is one GPU per process when a
    launcher starts several processes on a host (``cuda:LOCAL_RANK`` under torchrun,
    ``cuda:SLURM_LOCALID`` under Slurm), else every local GPU, or the CPU
    (:func:`~distrib.strategies.devices.worker_devices`).

    Example (run it with ``distrib launch --workers 2 script.py``)::

        strategy = ds.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model()
            optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
        if strategy.is_chief:
            print(f"worker {strategy.worker_index} of {strategy.num_workers}")
    """

    def __init__(self, cluster_resolver: Optional[ClusterResolver] = None,
                 communication_options: Optional[CommunicationOptions] = None,
                 devices: Optional[Sequence[str]] = None) -> None:
        group = current_group()
        resolver = cluster_resolver or _resolver_for(group)
        options = communication_options or CommunicationOptions()
        names = list(devices) if devices is not None else worker_devices(group=group[:2] if group else None)
        parsed = [parse_device(n) for n in names]
        rank, world = worker_rank(resolver)
        if group is not None:
            _check_group(group, rank, world, "the cluster_resolver" if cluster_resolver is not None
                         else f"the environment ({type(resolver).__name__})")
        communicator: Communicator
        if world > 1:
            spec = resolver.cluster_spec()
            hosts = [spec.task_address(job, i).rpartition(":")[0].strip("[]")
                     for job in ("chief", "worker") if job in spec.jobs for i in spec.task_indices(job)]
            communicator = ProcessGroupCommunicator(resolver.rendezvous_address(), rank, world, options,
                                                    uses_cuda=parsed[0].type == "cuda", hosts=hosts,
                                                    across_hosts=resolver.spans_hosts, device=parsed[0])
        else:
            communicator = LocalCommunicator()
        super().__init__(parsed, communicator, resolver, device_names=names, bucket_bytes=options.bucket_bytes)
        self._options = options
        log.info("MultiWorkerMirroredStrategy: worker %d of %d, local devices %s, communication %r",
                 rank, world, names, communicator)
        self.register_comm_hook(options.comm_hook())  # compression=...: every gradient reduction goes through it

    @property
    def communication_options(self) -> CommunicationOptions:
        """The options this strategy was made with."""
        return self._options


def _resolver_for(group: Optional[tuple[int, int, str]]) -> ClusterResolver:
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
        "/ Slurm's variables that describe another cluster), or destroy the group first")
