"""``MultiWorkerMirroredStrategy``: Mirrored, plus a collective across worker processes."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from distrib.cluster.resolver import ClusterResolver, worker_rank  # worker_rank: re-exported
from distrib.comm import CommunicationOptions
from distrib.strategies.synchronous import SynchronousStrategy
from distrib.strategies.workers import join_workers

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

    Args:
        cluster_resolver: the cluster (``TFConfigClusterResolver``, ``TorchrunClusterResolver``,
            ``SlurmClusterResolver``, ...); None: an initialised ``torch.distributed`` group, else the
            environment, else one worker.
        communication_options: the collectives' options (timeout, bucket size, backend, gradient compression);
            None: ``CommunicationOptions()``.
        devices: this process's local replicas (``["cuda:0"]``, ``["cpu:0", "cpu:1"]``); None: one GPU per
            launched process, else every local GPU, or the CPU.

    Raises:
        ValueError: a device is unknown or absent, or ``torch.distributed`` is already initialised with another
            rank or world size than the cluster says.

    Example (run it with ``distrib launch --workers 2 script.py``)::

        strategy = ds.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model()
            optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
        if strategy.is_chief:
            print(f"worker {strategy.worker_index} of {strategy.num_workers}")
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str] | None = None,
    ) -> None:
        options = communication_options or CommunicationOptions()
        workers = join_workers(cluster_resolver, options, devices)
        names, communicator = workers.device_names, workers.communicator
        rank, world = communicator.rank, communicator.world_size
        super().__init__(
            workers.devices, communicator, workers.resolver, device_names=names, bucket_bytes=options.bucket_bytes
        )
        self._options = options
        log.info(
            "MultiWorkerMirroredStrategy: worker %d of %d, local devices %s, communication %r",
            rank,
            world,
            names,
            communicator,
        )
        self.register_comm_hook(options.comm_hook())  # compression=...: every gradient reduction goes through it

    @property
    def communication_options(self) -> CommunicationOptions:
        """The options this strategy was made with."""
        return self._options
