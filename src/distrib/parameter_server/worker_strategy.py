"""The strategy a function scheduled with ``ClusterCoordinator.schedule`` sees on its worker.

On a worker, ``ds.get_strategy()`` inside a scheduled function (and the strategy the function
captured, which travels as a reference) is this object: one replica, run in place, no ps
placement (a module built inside a scheduled function stays on its worker), never the chief.
It answers ``isinstance(strategy, ds.ParameterServerStrategy)`` as TF's workers do (a virtual
subclass, registered by :mod:`distrib.parameter_server.strategy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from distrib.cluster import ClusterSpec, SimpleClusterResolver
from distrib.input import InputContext
from distrib.parameter_server.datasets import DatasetSource
from distrib.strategies.base import Strategy
from distrib.strategies.replica import InPlaceMerger, ReplicaContext, run_in_place
from distrib.strategies.run_options import RunOptions

if TYPE_CHECKING:
    from distrib.strategies.execution import StepExecutor

__all__ = ["ParameterServerWorkerStrategy"]


class ParameterServerWorkerStrategy(Strategy):
    """The worker-side ``ParameterServerStrategy``: built by each worker task for ``worker_index``."""

    should_use_with_coordinator = True

    def __init__(self, cluster_spec: ClusterSpec, worker_index: int, device: torch.device | None = None) -> None:
        on_gpu = device is not None and device.type == "cuda"
        super().__init__(
            # on the CPU nothing is placed (as before workers had a device); on a GPU, the replica's device
            [device if on_gpu else None],
            cluster_resolver=SimpleClusterResolver(cluster_spec, "worker", worker_index),
            device_names=[
                f"/job:worker/replica:0/task:{worker_index}/device:"
                + (f"GPU:{device.index or 0}" if on_gpu and device is not None else "CPU:0")
            ],
        )
        self._spec = cluster_spec
        self._replica = ReplicaContext(self, 0, InPlaceMerger())
        #: a worker schedules nothing: always None (the coordinator's strategy holds its ClusterCoordinator)
        self.cluster_coordinator: Any = None

    @property
    def is_chief(self) -> bool:
        """Never: the coordinator alone writes checkpoints."""
        return False

    @property
    def on_coordinator(self) -> bool:
        """False: this is the strategy a scheduled function sees on a worker."""
        return False

    @property
    def cluster_spec(self) -> ClusterSpec:
        """The cluster: its ``ps``, ``worker`` and ``chief`` tasks."""
        return self._spec

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(ps={self._spec.num_tasks('ps')}, workers={self._spec.num_tasks('worker')}, "
            f"on {self._device_names[0]})"
        )

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions
    ) -> Any:
        """``fn`` once, here, on this worker (one replica per worker)."""
        return run_in_place(self._replica, fn, args, kwargs)

    def distribute_module(self, module: torch.nn.Module) -> None:
        """A module built inside a scheduled function stays on its worker, on the worker's device."""
        device = self.local_devices[0]
        if device is not None:
            module.to(device)

    def distribute_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: an optimizer built inside a scheduled function is a plain local one."""

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> DatasetSource:
        """A dataset source, as on the coordinator (per-worker datasets are made there)."""
        return DatasetSource(dataset=dataset)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: Any = None
    ) -> DatasetSource:
        """A dataset source, as on the coordinator (per-worker datasets are made there)."""
        return DatasetSource(dataset_fn=dataset_fn)

    @property
    def graph_capture_blocker(self) -> str | None:
        """Scheduled steps pull and push parameters over RPC, on the host: ``ds.function`` runs them eagerly."""
        return (
            "A scheduled function's steps pull parameters from and push gradients to the ps tasks over "
            "RPC, on the host, which a CUDA graph cannot hold"
        )

    def step_executor(self) -> StepExecutor:
        raise RuntimeError("fit/evaluate/predict run on the coordinator, not inside a scheduled function")
