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
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from distrib.comm import CollectiveError
from distrib.tensor_bytes import byte_view
from distrib.values import regroup

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["InputContext", "DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator",
           "OptionalValue", "OutOfRangeError", "TensorSpec", "split_batch", "spec_of"]


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

    def __str__(self) -> str:
        return f"distrib.InputContext(input pipeline id {self.input_pipeline_id}, total: {self.num_input_pipelines})"

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
    if num_parts > 1 and any(isinstance(x, torch.Tensor) and x.dim() == 0 for x in leaves):
        raise ValueError(f"a batch holds a 0-d tensor, which cannot be split across {num_parts} replicas: batch "
                         "the input first (e.g. DataLoader(dataset, batch_size=...)), so that every tensor has a "
                         "batch dimension")
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

    Iterate it with ``for x in dist_ds`` or ``iter``/``next`` (or TF's ``get_next()``);
    each element is what ``strategy.run`` takes: the local replicas' parts (a structure
    of PerReplica leaves when this process has several replicas, the plain part when it
    has one). Under multi-worker strategies every worker must see the same global
    batches (same data, same shuffle seed); each keeps its replicas' parts. The workers
    check this at every step (one small all-reduce): a worker whose data ends early, or
    whose batch differs, is a :class:`~distrib.CollectiveError` on every worker.
    """

    def __init__(self, dataset: Iterable[Any], strategy: "Strategy", options: Any = None) -> None:
        _refuse_per_worker_sampler(dataset, strategy)
        self._dataset = dataset
        self._strategy = strategy
        self._spec: Any = None

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self._split_batches(), self._strategy)

    def _split_batches(self) -> Iterator[Any]:
        for batch in _agreed(iter(self._dataset), self._strategy):
            yield self._split(batch)

    def _split(self, batch: Any) -> Any:
        s = self._strategy
        devices = s.local_devices
        if s.num_replicas_in_sync == 1:
            return _to_device(batch, devices[0])
        n = s.num_local_replicas
        first = s.worker_index * n
        parts = split_batch(batch, s.num_replicas_in_sync)[first:first + n]
        return regroup([_to_device(p, d) for p, d in zip(parts, devices)])

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` structure of one replica's element (batch dimension None); reads one batch."""
        if self._spec is None:
            self._spec = _peek_spec(self._dataset)
        return self._spec

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]


class DistributedDatasetsFromFunction:
    """One input pipeline per worker, made by ``dataset_fn(InputContext)``; batches are per replica.

    With several local replicas, replica k of a step gets the k-th of consecutive
    batches; if the pipeline ends part-way through a step, the remaining replicas
    get empty batches so that the step still runs and nothing is dropped.
    """

    def __init__(self, dataset_fn: Callable[[InputContext], Iterable[Any]], strategy: "Strategy",
                 options: Any = None) -> None:
        self._strategy = strategy
        self.input_context = InputContext(
            num_input_pipelines=strategy.num_workers,
            input_pipeline_id=strategy.worker_index,
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        self._dataset = dataset_fn(self.input_context)
        self._spec: Any = None

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(_PerReplicaIterator(iter(self._dataset), self._strategy), self._strategy)

    def __len__(self) -> int:
        """Steps in this worker's pipeline: its batches over its local replicas, rounded up (a step whose
        pipeline ends part-way still runs). Workers whose pipelines differ in length all run the longest
        one's steps (the others feed empty batches), so give every worker the same number of batches
        (``DistributedSampler`` pads to that) when the count matters. TypeError if the pipeline has no length.
        """
        try:
            batches = len(self._dataset)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"the dataset_fn returned a {type(self._dataset).__name__}, which has no len(); "
                            "return a DataLoader (or another sized iterable) to count steps") from None
        return -(-batches // self._strategy.num_local_replicas)

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` structure of one replica's element (batch dimension None); reads one batch
        of this worker's pipeline (a fresh iterator of it, so iteration is not disturbed)."""
        if self._spec is None:
            self._spec = _peek_spec(self._dataset)
        return self._spec


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


# --------------------------------------------------------------------------- TF's iterator API

class OutOfRangeError(StopIteration):
    """``get_next()`` at the end of the data (``tf.errors.OutOfRangeError``); a ``StopIteration`` too."""


@dataclass(frozen=True)
class TensorSpec:
    """The shape (``None`` for the batch dimension) and dtype of a tensor (``tf.TensorSpec``)."""

    shape: tuple[Optional[int], ...]
    dtype: torch.dtype


def spec_of(batch: Any) -> Any:
    """``batch``'s structure with every tensor replaced by its :class:`TensorSpec` (batch dimension None)."""
    return pytree.tree_map(
        lambda x: TensorSpec((None, *x.shape[1:]) if x.dim() else (), x.dtype) if isinstance(x, torch.Tensor) else x,
        batch)


def _peek_spec(dataset: Any) -> Any:
    """The spec of a re-iterable dataset's first batch (a fresh iterator: iteration is not disturbed)."""
    iterator = iter(dataset)
    if iterator is dataset:
        raise ValueError("element_spec of a one-pass iterator would consume its first batch: take it from the "
                         "distributed iterator instead (it = iter(dist_dataset); it.element_spec)")
    first = next(iterator, None)
    if first is None:
        raise ValueError("element_spec of an empty dataset is unknown")
    return spec_of(first)


class OptionalValue:
    """What ``get_next_as_optional()`` returns (``tf.experimental.Optional``): a value, or nothing at the end."""

    def __init__(self, value: Any = None, has_value: bool = False) -> None:
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self) -> Any:
        if not self._has_value:
            raise OutOfRangeError("the iterator is exhausted: check has_value() before get_value()")
        return self._value


class DistributedIterator:
    """``iter(distributed_dataset)``: ``next()``, and TF's ``get_next()``, ``get_next_as_optional()``, ``element_spec``.

    Example::

        >>> import distrib as ds, torch
        >>> it = iter(ds.MirroredStrategy(["cpu:0", "cpu:1"]).experimental_distribute_dataset([torch.arange(4.0)]))
        >>> it.element_spec
        TensorSpec(shape=(None,), dtype=torch.float32)
        >>> it.get_next().values
        (tensor([0., 1.]), tensor([2., 3.]))
        >>> it.get_next_as_optional().has_value()
        False
    """

    def __init__(self, elements: Iterator[Any], strategy: "Strategy") -> None:
        self._elements = elements
        self._strategy = strategy
        self._peeked: list[Any] = []
        self._spec: Any = None

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        if self._peeked:
            return self._peeked.pop()
        element = next(self._elements)
        if self._spec is None:
            self._spec = spec_of(self._strategy.experimental_local_results(element)[0])
        return element

    def get_next(self) -> Any:
        """The next element; :class:`OutOfRangeError` at the end, as TF."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> OptionalValue:
        """The next element as an :class:`OptionalValue` (empty at the end), as TF."""
        try:
            return OptionalValue(next(self), True)
        except StopIteration:
            return OptionalValue()

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` structure of one replica's element (reads ahead one element if none was read)."""
        if self._spec is None:
            self._peeked.append(next(self))
        return self._spec


# --------------------------------------------------------------------------- checks

def _refuse_per_worker_sampler(dataset: Any, strategy: "Strategy") -> None:
    """A DataLoader that already shards per worker must not be split again over the workers."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if strategy.num_workers == 1 or not isinstance(dataset, DataLoader):
        return
    samplers = [dataset.sampler, getattr(dataset.batch_sampler, "sampler", None)]
    if any(isinstance(s, DistributedSampler) for s in samplers):
        raise ValueError(
            "experimental_distribute_dataset got a DataLoader with a DistributedSampler: it already gives each "
            "worker 1/num_workers of the data, and distrib would split every batch again over the workers, so "
            "each worker would train on a fraction of its fraction. Either give the DataLoader the whole data "
            "(no DistributedSampler; every worker reads the same global batches), or build per-worker data with "
            "strategy.distribute_datasets_from_function(lambda ctx: DataLoader(..., sampler=DistributedSampler("
            "data, ctx.num_input_pipelines, ctx.input_pipeline_id)))")


def _fingerprint(batch: Any) -> int:
    """A cheap checksum of a global batch: shapes and the first bytes of every tensor."""
    crc = 0
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            head = leaf.detach().reshape(-1)[:256].contiguous().cpu()
            crc = zlib.crc32(str(tuple(leaf.shape)).encode(), crc)
            crc = zlib.crc32(byte_view(head), crc)
    return crc


def _agreed(batches: Iterator[Any], strategy: "Strategy") -> Iterator[Any]:
    """The global batches of one worker, checked against every other worker's at each step.

    Every worker must read the same global batches: a worker whose data ends while others
    go on, or whose batch differs, raises :class:`CollectiveError` on every worker, naming
    the step, instead of a hang or a silently wrong split.
    """
    if strategy.num_workers == 1:
        yield from batches
        return
    comm, rank, step = strategy.communicator, strategy.worker_index, 0
    while True:
        batch = next(batches, None)
        rows = torch.zeros(strategy.num_workers, 3, dtype=torch.int64)
        if batch is not None:
            rows[rank] = torch.tensor([1, _batch_len(batch), _fingerprint(batch)])
        comm.all_reduce([rows])
        has = rows[:, 0].tolist()
        if not any(has):
            return
        if not all(has):
            ended = [i for i, h in enumerate(has) if not h]
            raise CollectiveError(
                f"experimental_distribute_dataset: the data of worker(s) {ended} ended after {step} global "
                f"batches while worker(s) {[i for i, h in enumerate(has) if h]} have more. Every worker must read "
                "the same global batches (same data, same order); for per-worker data use "
                "strategy.distribute_datasets_from_function")
        if bool((rows[:, 1:] != rows[0, 1:]).any()):
            raise CollectiveError(
                f"experimental_distribute_dataset: global batch {step} differs between workers (sizes "
                f"{rows[:, 1].tolist()}). Every worker must read the same global batches: seed the shuffle the "
                "same way on every worker, or give each worker its own data with "
                "strategy.distribute_datasets_from_function")
        step += 1
        yield batch


def _batch_len(batch: Any) -> int:
    sizes = [x.shape[0] for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return sizes[0] if sizes else 0
