"""Distributing input: global batches split over replicas, or one pipeline per worker.

Two entry points, as in ``tf.distribute``:

* ``strategy.experimental_distribute_dataset(dataset)``: ``dataset`` yields *global*
  batches; each is split along dim 0 over every replica in sync, as evenly as
  possible. Nothing is dropped or duplicated: a short last batch of 6 over 4
  replicas gives 2, 2, 1, 1 examples, and a replica left with nothing gets an
  empty batch (dim 0 of size 0) so that every replica still runs the step.
* ``strategy.distribute_datasets_from_function(dataset_fn)``: ``dataset_fn`` is
  called once per worker with an :class:`InputContext` and yields *per-replica*
  batches; local replicas take consecutive batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from distrib.values import regroup

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["InputContext", "DistributedDataset", "DistributedDatasetsFromFunction", "split_batch"]


@dataclass(frozen=True)
class InputContext:
    """What one worker's input pipeline needs to know to read its share (``tf.distribute.InputContext``).

    Example::

        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        >>> ctx.get_per_replica_batch_size(128)
        32
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; ValueError when it does not divide."""
        if global_batch_size % self.num_replicas_in_sync:
            up = math.ceil(global_batch_size / self.num_replicas_in_sync) * self.num_replicas_in_sync
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by num_replicas_in_sync="
                f"{self.num_replicas_in_sync}; use a multiple of {self.num_replicas_in_sync} (e.g. {up})"
            )
        return global_batch_size // self.num_replicas_in_sync


def _as_tensor(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if hasattr(leaf, "__array__") and not isinstance(leaf, (str, bytes)):
        return torch.as_tensor(leaf)
    return leaf


def split_batch(batch: Any, num_parts: int) -> list[Any]:
    """Split every tensor of ``batch`` along dim 0 into ``num_parts`` near-equal parts.

    The first ``len % num_parts`` parts get one extra example. Non-tensor leaves are
    given to every part unchanged.
    """
    leaves, spec = pytree.tree_flatten(batch)
    leaves = [_as_tensor(x) for x in leaves]
    sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"cannot split a batch whose tensors have different sizes along dim 0: {sorted(sizes)}")
    parts_per_leaf = [
        torch.tensor_split(x, num_parts) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * num_parts
        for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in parts_per_leaf], spec) for i in range(num_parts)]


def _to_device(batch: Any, device: Optional[torch.device]) -> Any:
    if device is None:
        return batch

    def move(x: Any) -> Any:
        x = _as_tensor(x)
        if isinstance(x, torch.Tensor) and x.device != device:
            return x.to(device, non_blocking=x.is_pinned())
        return x

    return pytree.tree_map(move, batch)


def _empty_like(batch: Any) -> Any:
    return pytree.tree_map(lambda x: x[:0] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, batch)


class DistributedDataset:
    """Global batches of ``dataset``, each split over the replicas in sync.

    Iterate it with ``for x in dist_ds`` or ``iter``/``next``; each element is what
    ``strategy.run`` takes: the local replicas' parts (a structure of PerReplica
    leaves when this process has several replicas, the plain part when it has one).
    Under multi-worker strategies every worker must see the same global batches
    (same data, same shuffle seed); each keeps its replicas' parts.
    """

    def __init__(self, dataset: Iterable[Any], strategy: "Strategy") -> None:
        self._dataset = dataset
        self._strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        return _SplitIterator(iter(self._dataset), self._strategy)

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]


class _SplitIterator:
    def __init__(self, iterator: Iterator[Any], strategy: "Strategy") -> None:
        self._it = iterator
        self._strategy = strategy

    def __iter__(self) -> "_SplitIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        s = self._strategy
        devices = s.local_devices
        if s.num_replicas_in_sync == 1:
            return _to_device(batch, devices[0])
        n = s.num_local_replicas
        first = s.worker_index * n
        parts = split_batch(batch, s.num_replicas_in_sync)[first:first + n]
        return regroup([_to_device(p, d) for p, d in zip(parts, devices)])


class DistributedDatasetsFromFunction:
    """One input pipeline per worker, made by ``dataset_fn(InputContext)``; batches are per replica.

    With several local replicas, replica k of a step gets the k-th of consecutive
    batches; if the pipeline ends part-way through a step, the remaining replicas
    get empty batches so that the step still runs and nothing is dropped.
    """

    def __init__(self, dataset_fn: Callable[[InputContext], Iterable[Any]], strategy: "Strategy") -> None:
        self._strategy = strategy
        self.input_context = InputContext(
            num_input_pipelines=strategy.num_workers,
            input_pipeline_id=strategy.worker_index,
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        self._dataset = dataset_fn(self.input_context)

    def __iter__(self) -> Iterator[Any]:
        return _PerReplicaIterator(iter(self._dataset), self._strategy)


class _PerReplicaIterator:
    """Per-replica batches from one worker's pipeline.

    Under several workers, every step first agrees (one small all-reduce) on whether any
    worker still has data: the epoch ends on every worker at the same step, when the
    last pipeline is exhausted; workers that ran out earlier feed empty batches, so no
    collective is left waiting and every example is seen exactly once.
    """

    def __init__(self, iterator: Iterator[Any], strategy: "Strategy") -> None:
        self._it: Optional[Iterator[Any]] = iterator
        self._strategy = strategy
        self._template: Any = None

    def __iter__(self) -> "_PerReplicaIterator":
        return self

    def _next_local(self) -> Optional[Any]:
        if self._it is None:
            return None
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = None
            return None
        self._template = _empty_like(batch)
        return batch

    def __next__(self) -> Any:
        s = self._strategy
        devices = s.local_devices
        batches: list[Any] = []
        for _ in devices:
            batch = self._next_local()
            if batch is None:
                break
            batches.append(batch)
        if s.num_workers > 1:
            flags = torch.tensor([float(bool(batches)), float(self._template is None)])
            s.communicator.all_reduce([flags])
            if flags[0] == 0:
                raise StopIteration
            if flags[1] > 0:  # someone never saw a batch: learn the structure from a worker that did
                templates = s.communicator.all_gather_object(self._template)
                self._template = self._template or next(t for t in templates if t is not None)
        elif not batches:
            raise StopIteration
        while len(batches) < len(devices):
            batches.append(self._template)
        return regroup([_to_device(b, d) for b, d in zip(batches, devices)])
