"""``MultiWorkerMirroredStrategy``: Mirrored, plus a collective across worker processes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from distrib.cluster.resolver import ClusterResolver, worker_rank  # worker_rank: re-exported
from distrib.comm import CommunicationOptions
from distrib.strategies.run_options import RunOptions
from distrib.strategies.synchronous import SynchronousStrategy
from distrib.strategies.workers import join_workers

if TYPE_CHECKING:
    from distrib.strategies.fault_tolerance import FaultTolerantSteps

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
        fault_tolerant: go on without a worker that dies or hangs, in the same processes (start the workers
            with ``distrib launch --fault-tolerant``): the survivors agree on who is left within the timeout,
            the step in flight is redone, and every global batch is split over the survivors. One CPU device
            per worker, gloo, ``strategy.run`` loops fed by ``experimental_distribute_dataset``; see
            ``docs/fault-tolerance.md``. Off by default.

    Raises:
        ValueError: a device is unknown or absent, or ``torch.distributed`` is already initialised with another
            rank or world size than the cluster says; with ``fault_tolerant``, several devices, a GPU, or no
            store (not started by ``distrib launch --fault-tolerant``).

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
        fault_tolerant: bool = False,
    ) -> None:
        options = communication_options or CommunicationOptions()
        workers = join_workers(cluster_resolver, options, devices, fault_tolerant=fault_tolerant)
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
        self._steps: FaultTolerantSteps | None = None
        if fault_tolerant and communicator.world_size > 1:
            from distrib.comm.membership import FaultTolerantCommunicator
            from distrib.strategies.fault_tolerance import FaultTolerantSteps

            assert isinstance(communicator, FaultTolerantCommunicator)
            self._steps = FaultTolerantSteps(communicator, self._engine)

    @property
    def fault_tolerant(self) -> bool:
        """Whether a lost worker is survived (``fault_tolerant=True`` with several workers)."""
        return self._steps is not None

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        if self._steps is None:
            return super().call_for_each_replica(fn, args, kwargs, options)
        parent = super().call_for_each_replica
        return self._steps.run(lambda a, k: parent(fn, a, k, options), args, kwargs)

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Any:
        """Split every global batch of ``dataset`` over all replicas in sync.

        Under fault tolerance every worker reads each global batch whole, and ``run`` splits it over the
        members of the moment, so that the survivors of a fault take over the lost workers' share.

        Args:
            dataset: any iterable of global batches (a ``DataLoader`` with the global batch size, a list).
            options: TF's ``tf.distribute.InputOptions``; ignored under fault tolerance (every worker reads all).

        Returns:
            A :class:`~distrib.input.DistributedDataset`; under fault tolerance a
            :class:`~distrib.strategies.fault_tolerance.FaultTolerantDataset` of
            :class:`~distrib.strategies.fault_tolerance.WholeBatch` elements for ``run``.
        """
        if self._steps is None:
            return super().experimental_distribute_dataset(dataset, options)
        from distrib.strategies.fault_tolerance import FaultTolerantDataset

        return FaultTolerantDataset(dataset)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Any:
        """Call ``dataset_fn(input_context)`` once on this worker; its batches are per-replica batches.

        Args:
            dataset_fn: makes this worker's pipeline from an :class:`~distrib.input.InputContext`.
            options: TF's ``tf.distribute.InputOptions``, handed to the distributed dataset.

        Returns:
            A :class:`~distrib.input.DistributedDatasetsFromFunction`.

        Raises:
            ValueError: under fault tolerance, where no survivor could take over a lost worker's pipeline.
        """
        if self._steps is not None:
            raise ValueError(
                "distribute_datasets_from_function under fault_tolerant=True: each worker's pipeline would hold "
                "a share no survivor could take over; use experimental_distribute_dataset(global_batches)"
            )
        return super().distribute_datasets_from_function(dataset_fn, options)

    @property
    def communication_options(self) -> CommunicationOptions:
        """The options this strategy was made with."""
        return self._options
