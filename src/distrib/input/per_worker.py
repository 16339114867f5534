"""``strategy.distribute_datasets_from_function``: pipelines the user builds per worker (or per replica), whose
batches are per-replica batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from distrib.input.batches import empty_like, peek_spec
from distrib.input.iterators import DistributedIterator, prefetching
from distrib.input.options import InputContext, InputReplicationMode, resolve_options

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["DistributedDatasetsFromFunction"]


class DistributedDatasetsFromFunction:
    """One input pipeline per worker, made by ``dataset_fn(InputContext)``; batches are per replica.

    With several local replicas, replica k of a step gets the k-th of consecutive
    batches; if the pipeline ends part-way through a step, the remaining replicas
    get empty batches so that the step still runs and nothing is dropped.

    With ``options=InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)`` the function
    is called once per local replica instead (its context counts replicas as pipelines: ``num_input_pipelines``
    is ``num_replicas_in_sync``, ``input_pipeline_id`` the replica's id in sync), and each replica reads its own
    pipeline; with ``experimental_place_dataset_on_device=True`` each replica's pipeline is built and read under
    its device (``torch.device(replica_device)``), so the tensors it creates are made there and never copied.
    """

    def __init__(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], strategy: Strategy, options: Any = None
    ) -> None:
        self._strategy = strategy
        self._options = resolve_options(options, "distribute_datasets_from_function")
        self._per_replica = self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
        if self._per_replica:
            n = strategy.num_local_replicas
            self._contexts = [
                InputContext(
                    num_input_pipelines=strategy.num_replicas_in_sync,
                    input_pipeline_id=strategy.data_worker_index * n + k,
                    num_replicas_in_sync=strategy.num_replicas_in_sync,
                )
                for k in range(n)
            ]
        else:
            self._contexts = [
                InputContext(
                    num_input_pipelines=strategy.num_data_workers,
                    input_pipeline_id=strategy.data_worker_index,
                    num_replicas_in_sync=strategy.num_replicas_in_sync,
                )
            ]
        self.input_context = self._contexts[0]
        self._datasets = []
        for k, context in enumerate(self._contexts):
            with self._on_device(k):
                self._datasets.append(dataset_fn(context))
        self._dataset = self._datasets[0]
        self._spec: Any = None

    def _on_device(self, replica: int) -> contextlib.AbstractContextManager[Any]:
        """Where replica ``replica``'s pipeline is built and read: under its device with
        ``experimental_place_dataset_on_device``, else as it is."""
        device = self._strategy.local_devices[replica] if self._per_replica else None
        if self._options.experimental_place_dataset_on_device and device is not None:
            return torch.device(device)
        return contextlib.nullcontext()

    def __iter__(self) -> DistributedIterator:
        iterators = []
        for k, dataset in enumerate(self._datasets):
            with self._on_device(k):
                iterators.append(iter(dataset))
        parts = _PerReplicaIterator(iterators, self._strategy, self._on_device)
        options = self._options
        elements = prefetching(
            parts,
            self._strategy.local_devices,
            bool(options.experimental_fetch_to_device),
            options.experimental_per_replica_buffer_size,
        )
        return DistributedIterator(elements, self._strategy)

    def __len__(self) -> int:
        """Steps in this worker's pipeline: its batches over its local replicas, rounded up (a step whose
        pipeline ends part-way still runs). Workers whose pipelines differ in length all run the longest
        one's steps (the others feed empty batches), so give every worker the same number of batches
        (``DistributedSampler`` pads to that) when the count matters. TypeError if the pipeline has no length.
        """
        try:
            batches = [len(d) for d in self._datasets]  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"the dataset_fn returned a {type(self._dataset).__name__}, which has no len(); "
                "return a DataLoader (or another sized iterable) to count steps"
            ) from None
        if self._per_replica:
            return max(batches)
        return -(-batches[0] // self._strategy.num_local_replicas)

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` structure of one replica's element (batch dimension None); reads one batch
        of this worker's pipeline (a fresh iterator of it, so iteration is not disturbed)."""
        if self._spec is None:
            self._spec = peek_spec(self._dataset)
        return self._spec


class _PerReplicaIterator:
    """Per-replica batches from one worker's pipeline (or one pipeline per local replica).

    Under several workers, every step first agrees (one small all-reduce) on whether any
    worker still has data: the epoch ends on every worker at the same step, when the
    last pipeline is exhausted; workers that ran out earlier feed empty batches, so no
    collective is left waiting and every example is seen exactly once.
    """

    def __init__(
        self,
        iterators: list[Iterator[Any]],
        strategy: Strategy,
        on_device: Callable[[int], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self._its: list[Iterator[Any] | None] = list(iterators)
        self._strategy = strategy
        self._on_device = on_device
        self._template: Any = None

    def __iter__(self) -> _PerReplicaIterator:
        return self

    def _next_local(self, pipeline: int) -> Any | None:
        it = self._its[pipeline]
        if it is None:
            return None
        try:
            with self._on_device(pipeline):
                batch = next(it)
        except StopIteration:
            self._its[pipeline] = None
            return None
        self._template = empty_like(batch)
        return batch

    def __next__(self) -> list[Any]:
        s = self._strategy
        replicas = len(s.local_devices)
        batches: list[Any | None] = []
        if len(self._its) == 1:  # PER_WORKER: local replicas take consecutive batches
            for _ in range(replicas):
                batch = self._next_local(0)
                if batch is None:
                    break
                batches.append(batch)
        else:  # PER_REPLICA: each replica reads its own pipeline
            batches = [self._next_local(k) for k in range(replicas)]
        has_data = any(b is not None for b in batches)
        if s.num_workers > 1:
            flags = torch.tensor([float(has_data), float(self._template is None)])
            s.communicator.all_reduce([flags])
            if flags[0] == 0:
                raise StopIteration
            if flags[1] > 0:  # someone never saw a batch: learn the structure from a worker that did
                templates = s.communicator.all_gather_object(self._template)
                if self._template is None:
                    self._template = next(t for t in templates if t is not None)
        elif not has_data:
            raise StopIteration
        batches += [None] * (replicas - len(batches))
        return [self._template if b is None else b for b in batches]
