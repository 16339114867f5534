"""Auto-sharding a ``DataLoader`` over a map-style dataset: each worker loads only its own replicas' examples.

The global batches are the original loader's batch sampler's: every worker iterates that sampler in full (it
yields indices, which cost nothing to make), so every worker knows each global batch, in the same order as one
process would, from the same seeds. Of each global batch of indices a worker hands its rebuilt ``DataLoader``
only the slice its replicas' parts cover (:func:`~distrib.input.batches.part_bounds`, the same split as
``split_batch`` makes of a whole batch), so ``__getitem__``, the transforms and the collate run on its own examples
only; the loader keeps every setting of the original (``num_workers``, ``collate_fn``, ``pin_memory``,
``worker_init_fn``, ``generator``, ``persistent_workers``, ...), as Accelerate's ``BatchSamplerShard`` does.

Skipping to a position (an exact resume) happens here too, in the batch sampler: the skipped global batches'
indices are drawn (so the random state moves as it did) but never loaded.

Under a mesh the workers of one tensor-parallel group load the same examples, and must transform them alike: the
strategy hands in its input stream (:class:`~distrib.strategies.group_random.GroupRandomStream`), from which the
rebuilt loader draws its worker processes' base seed and, loading in the main process, the transforms draw. The
sampler keeps drawing from the process's own generators: the global batches must be the same on every worker.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
import zlib
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from distrib.input.batches import part_bounds

if TYPE_CHECKING:
    from distrib.strategies.group_random import GroupRandomStream

__all__ = ["GlobalBatch", "ShardedBatchSampler", "ShardedLoader", "sharded_loader", "why_not_shardable"]


@dataclass(frozen=True)
class GlobalBatch:
    """What a worker knows of one global batch: its size, a checksum of its indices (equal on every worker that
    reads the same data in the same order), and how many of its examples are this worker's."""

    size: int
    indices_crc: int
    local_size: int


def _indices_crc(indices: list[Any]) -> int:
    try:
        return zlib.crc32(array("q", indices).tobytes())
    except (TypeError, OverflowError):  # keys that are not machine integers
        return zlib.crc32(repr(indices).encode())


_END = object()


@dataclass
class _Run:
    """One pass of the sampler, as the consumer asked for it: batches to skip, and what was drawn."""

    skip: int = 0
    drawn: int = 0
    batches: deque[GlobalBatch] = field(default_factory=deque)


class ShardedBatchSampler:
    """The batch sampler of one worker's rebuilt loader: its replicas' slice of each of ``global_batches``'s
    batches of indices (replicas ``first .. first+count-1`` of ``num_parts``). A slice that is empty (a short
    last batch) is not handed to the loader; the consumer learns of it from the run's record. The global batches
    are drawn with the process's own generators live, even where the loader runs inside a group's ``stream``."""

    def __init__(
        self,
        global_batches: Iterable[Any],
        num_parts: int,
        first: int,
        count: int,
        stream: GroupRandomStream | None = None,
    ) -> None:
        self.global_batches = global_batches
        self.num_parts, self.first, self.count = num_parts, first, count
        self.run = _Run()
        self._stream = stream

    def _own_generators(self) -> contextlib.AbstractContextManager[None]:
        return self._stream.suspended() if self._stream is not None else contextlib.nullcontext()

    def __len__(self) -> int:
        return len(self.global_batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[Any]]:
        # torch calls iter() on the batch sampler more than once per pass (e.g. the multiprocessing iterator's
        # first reset): every call serves the consumer's current run, and only the one advanced draws
        return self._slices(self.run)

    def _slices(self, run: _Run) -> Iterator[list[Any]]:
        with self._own_generators():
            drawn = iter(self.global_batches)
        while True:
            with self._own_generators():  # the shuffle: the same on every worker
                batch: Any = next(drawn, _END)
            if batch is _END:
                return
            indices = batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)
            run.drawn += 1
            if run.skip > 0:
                run.skip -= 1
                continue
            lo, hi = part_bounds(len(indices), self.num_parts, self.first, self.count)
            run.batches.append(GlobalBatch(len(indices), _indices_crc(indices), hi - lo))
            if hi > lo:
                yield indices[lo:hi]


def why_not_shardable(dataset: Any) -> str | None:
    """None when ``dataset`` is a ``DataLoader`` this module can shard; else why not (for the warning)."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(dataset, DataLoader):
        return f"a {type(dataset).__name__} is not a DataLoader"
    if type(dataset) is not DataLoader:
        return (
            f"{type(dataset).__name__} is a subclass of DataLoader, which distrib cannot rebuild with a sharded "
            "batch sampler without losing what the subclass adds"
        )
    if isinstance(dataset.dataset, IterableDataset):
        return (
            "its dataset is an IterableDataset: its examples have no indices to share out (shard it yourself "
            "with distribute_datasets_from_function, e.g. by InputContext.input_pipeline_id)"
        )
    if dataset.batch_sampler is None:
        return "it does not batch (batch_size=None): its elements are not global batches of indexed examples"
    if not getattr(dataset, "in_order", True):
        return "in_order=False lets its batches come in any order, which differs between workers"
    return None


class ShardedLoader:
    """One worker's share of a ``DataLoader``: the same loader rebuilt over a :class:`ShardedBatchSampler`.

    With a ``stream`` (a tensor-parallel group's), the loader draws its worker processes' base seed and runs
    its main-process transforms with the stream live, so the workers of one group load alike."""

    def __init__(
        self, loader: Any, num_parts: int, first: int, count: int, stream: GroupRandomStream | None = None
    ) -> None:
        from torch.utils.data import DataLoader

        # weakly: the cache of sharded_loader() is keyed by the original loader, and must not keep it alive
        self._original = weakref.ref(loader)
        self._stream = stream
        self.sampler = ShardedBatchSampler(loader.batch_sampler, num_parts, first, count, stream)
        workers = loader.num_workers
        self.loader = DataLoader(
            loader.dataset,
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context if workers else None,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor if workers else None,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device,
            in_order=getattr(loader, "in_order", True),
        )

    def steps(self, start: int = 0, cycle: bool = False) -> Iterator[tuple[GlobalBatch, Any | None]]:
        """``(global batch, this worker's loaded share of it or None when its share is empty)`` for every global
        batch from position ``start`` (with ``cycle``, passes over the data follow each other for ever, calling the
        original loader's ``set_epoch(pass)`` when it has one, as ``numbered_batches`` does)."""
        skip = start
        passes: Iterable[int | None] = itertools.count() if cycle else [None]
        for n_pass in passes:
            original = self._original()
            if n_pass is not None and original is not None and hasattr(original, "set_epoch"):
                original.set_epoch(n_pass)
            run = self.sampler.run = _Run(skip=skip)
            with self._group_generators():  # the worker processes' base seed
                loaded = iter(self.loader)
            held: deque[Any] = deque()  # shares loaded ahead of their global batch's turn
            exhausted = False
            while True:
                while not run.batches and not exhausted:
                    try:
                        with self._group_generators():  # the transforms, where the main process loads
                            held.append(next(loaded))  # the loader draws from the sampler: the run learns of batches
                    except StopIteration:
                        exhausted = True
                if not run.batches:
                    break
                batch = run.batches.popleft()
                if batch.local_size == 0:
                    yield batch, None
                elif held:
                    yield batch, held.popleft()
                else:
                    with self._group_generators():
                        share = next(loaded)
                    yield batch, share
            skip = run.skip
            if run.drawn == 0:
                return

    def _group_generators(self) -> contextlib.AbstractContextManager[None]:
        return self._stream.active() if self._stream is not None else contextlib.nullcontext()


_SHARDED: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int, int | None], ShardedLoader]] = (
    weakref.WeakKeyDictionary()
)


def sharded_loader(
    loader: Any, num_parts: int, first: int, count: int, stream: GroupRandomStream | None = None
) -> ShardedLoader:
    """The :class:`ShardedLoader` of ``loader`` for this worker's parts, made once per loader, topology and stream.

    Distributing the same loader again (``fit`` does, every epoch) reuses it, so that its loader processes and
    random draws go on as the original loader's would: a loader with ``persistent_workers`` keeps its processes,
    and draws its workers' base seed once, as when it is iterated plainly.
    """
    per_topology = _SHARDED.setdefault(loader, {})
    key = (num_parts, first, count, id(stream) if stream is not None else None)
    if key not in per_topology:
        per_topology[key] = ShardedLoader(loader, num_parts, first, count, stream)
    return per_topology[key]
