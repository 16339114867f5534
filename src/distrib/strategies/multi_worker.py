"""``MultiWorkerMirroredStrategy``: Mirrored, plus a collective across worker processes."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from distrib import cluster
from distrib.cluster.resolver import ClusterResolver
from distrib.collectives import CommunicationOptions, LocalCommunicator, ProcessGroupCommunicator
from distrib.gradients import BucketedGradientReducer
from distrib.mirroring import optimizer_params
from distrib.strategies.base import Strategy
from distrib.strategies.devices import local_devices, parse_device

__all__ = ["MultiWorkerMirroredStrategy", "worker_rank"]

log = logging.getLogger("distrib.strategies")


def worker_rank(resolver: ClusterResolver) -> tuple[int, int]:
    """``(rank, world_size)`` of this task among the cluster's chief and worker tasks (chief first)."""
    spec = resolver.cluster_spec()
    tasks = [("chief", 0)] * spec.num_tasks("chief") + [("worker", i) for i in range(spec.num_tasks("worker"))]
    if not tasks:
        return 0, 1
    if resolver.task_type not in ("chief", "worker"):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, but this task is "
            f"{resolver.task_type!r}: check TF_CONFIG's 'task.type'")
    return tasks.index((resolver.task_type, resolver.task_id or 0)), len(tasks)


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training over worker processes, each with one or more local replicas.

    The cluster comes from ``cluster_resolver``, else from ``TF_CONFIG`` or torchrun's
    variables; without any, it is one worker. Workers rendezvous at the chief's address
    and all-reduce gradients (gloo on CPU, NCCL on GPU) in buckets overlapped with the
    backward pass. Parameters of modules built in the scope start equal everywhere: the
    chief's values are broadcast. ``devices`` (an extension of TF's API) sets the local
    replicas, e.g. ``["cpu:0", "cpu:1"]``; the default is every local GPU, or the CPU.

    Example (run it with ``distrib launch --workers 2 script.py``)::

        strategy = ds.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model()
            optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    """

    def __init__(self, cluster_resolver: Optional[ClusterResolver] = None,
                 communication_options: Optional[CommunicationOptions] = None,
                 devices: Optional[Sequence[str]] = None) -> None:
        resolver = cluster_resolver or cluster.resolve() or cluster.TFConfigClusterResolver(environ={})
        options = communication_options or CommunicationOptions()
        names = list(devices) if devices is not None else local_devices()
        parsed = [parse_device(n) for n in names]
        rank, world = worker_rank(resolver)
        if world > 1:
            communicator = ProcessGroupCommunicator(resolver.master(), rank, world, options,
                                                    uses_cuda=parsed[0].type == "cuda")
        else:
            communicator = LocalCommunicator()
        super().__init__(parsed, communicator, resolver, device_names=names)
        self._options = options
        self._reducers: list[BucketedGradientReducer] = []
        log.info("MultiWorkerMirroredStrategy: worker %d of %d, local devices %s, communication %s",
                 rank, world, names, getattr(communicator, "backend", "local"))

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    @property
    def is_chief(self) -> bool:
        return self._cluster_resolver.is_chief

    def _distribute_module(self, module: torch.nn.Module) -> None:
        super()._distribute_module(module)
        if self._num_workers > 1:  # every worker starts from the chief's initial values
            self._communicator.broadcast(list(module.parameters()) + list(module.buffers()), src=0)
            self._mirrored.refresh(module)

    def _on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        super()._on_optimizer_created(optimizer)
        if self._num_workers > 1 and self._num_local_replicas == 1:
            reducer = BucketedGradientReducer(optimizer_params(optimizer), self._communicator,
                                              self._options.bucket_bytes)
            optimizer._distrib_reducer = reducer  # type: ignore[attr-defined]
            self._reducers.append(reducer)

    def _apply_update(self, optimizer, step, args, kwargs):  # type: ignore[no-untyped-def]
        reducer = getattr(optimizer, "_distrib_reducer", None)
        if reducer is None:
            return super()._apply_update(optimizer, step, args, kwargs)
        reducer.synchronize()
        result = step(*args, **kwargs)
        self._mirrored.refresh(average_buffers=True)
        return result

    def _optimizer_zero_grad(self, optimizer, zero_grad, set_to_none):  # type: ignore[no-untyped-def]
        reducer = getattr(optimizer, "_distrib_reducer", None)
        if reducer is not None:
            reducer.discard()
        super()._optimizer_zero_grad(optimizer, zero_grad, set_to_none)
