"""``strategy.experimental_distribute_dataset``: global batches, each split over the replicas in sync.

Under several workers a ``DataLoader`` over a map-style dataset is auto-sharded (``AutoShardPolicy.AUTO``):
each worker loads only its replicas' part of each global batch (:mod:`distrib.input.sharding`). Anything else
is read whole by every worker, which keeps its replicas' part (``DATA``). Either way the workers agree at every
step, with one small all-reduce, that they are reading the same global batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from distrib.comm import CollectiveError
from distrib.input.batches import batch_len, empty_like, fingerprint, peek_spec, shapes_fingerprint, split_batch
from distrib.input.iterators import DistributedIterator, prefetching
from distrib.input.options import AutoShardPolicy, InputReplicationMode, resolve_options
from distrib.input.positions import numbered_batches, split_xy
from distrib.input.sharding import GlobalBatch, ShardedLoader, sharded_loader, why_not_shardable

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy
    from distrib.strategies.group_random import GroupRandomStream

__all__ = ["DistributedDataset"]


class DistributedDataset:
    """Global batches of ``dataset``, each split over the replicas in sync.

    Iterate it with ``for x in dist_ds`` or ``iter``/``next`` (or TF's ``get_next()``);
    each element is what ``strategy.run`` takes: the local replicas' parts (a structure
    of PerReplica leaves when this process has several replicas, the plain part when it
    has one). Under multi-worker strategies every worker must see the same global
    batches (same data, same shuffle seed); each keeps its replicas' parts. The workers
    check this at every step (one small all-reduce): a worker whose data ends early, or
    whose batch differs, is a :class:`~distrib.CollectiveError` on every worker.

    With several workers, a ``DataLoader`` over a map-style dataset is auto-sharded (``options``, a
    :class:`~distrib.input.InputOptions`, picks the :class:`~distrib.input.AutoShardPolicy`): each worker's
    copy of the loader loads only its own replicas' examples, and the global batches stay those of the
    original loader (same order, same content, from the same seeds). ``loader_stream``: the random stream a
    sharded loader draws its worker processes' seed and its main-process transforms from (a mesh's
    tensor-parallel group's, so that the group's workers load alike); None: the process's generators.
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        strategy: Strategy,
        options: Any = None,
        loader_stream: GroupRandomStream | None = None,
    ) -> None:
        self._options = resolve_options(options, "experimental_distribute_dataset")
        policy = self._options.experimental_auto_shard_policy
        if policy in (AutoShardPolicy.FILE, AutoShardPolicy.HINT):
            raise ValueError(
                f"AutoShardPolicy.{policy.name} has no DataLoader counterpart (a DataLoader has no files "
                "or shard hints): use AUTO (a DataLoader over a map-style dataset is sharded by index) "
                "or DATA, or read each worker's files in distribute_datasets_from_function"
            )
        if self._options.experimental_replication_mode is not InputReplicationMode.PER_WORKER:
            raise ValueError(
                "experimental_replication_mode=PER_REPLICA is for distribute_datasets_from_function "
                "(one pipeline per replica), as in TF; experimental_distribute_dataset splits global "
                "batches"
            )
        _refuse_per_worker_sampler(dataset, strategy)
        self._dataset = dataset
        self._strategy = strategy
        self._spec: Any = None
        self._sharded: ShardedLoader | None = None
        if strategy.num_workers > 1 and policy is AutoShardPolicy.AUTO:
            reason = why_not_shardable(dataset)
            if reason is None:
                n = strategy.num_local_replicas
                self._sharded = sharded_loader(
                    dataset, strategy.num_replicas_in_sync, strategy.data_worker_index * n, n, loader_stream
                )
            elif _has_input_work(dataset):
                warnings.warn(
                    f"experimental_distribute_dataset cannot auto-shard this input ({reason}), so every worker "
                    "loads every global batch and keeps its replicas' part (AutoShardPolicy.DATA): the input work "
                    "is done once per worker. Say so to silence this with options=ds.InputOptions("
                    "experimental_auto_shard_policy=ds.AutoShardPolicy.DATA), or give each worker its own data "
                    "with strategy.distribute_datasets_from_function",
                    stacklevel=3,
                )

    @property
    def auto_sharded(self) -> bool:
        """Whether each worker loads only its own replicas' examples (a sharded ``DataLoader``)."""
        return self._sharded is not None

    def __iter__(self) -> DistributedIterator:
        return self._iterate(start=0, cycle=False, numbered=False)

    def numbered_batches(self, start: int = 0, cycle: bool = False) -> DistributedIterator:
        """``fit``'s elements: each global batch as ``(x, y, global_batch_size)``, split over the replicas, from
        global position ``start`` (with ``cycle``, the data is read again when it ends, calling ``set_epoch(pass)``
        when the data has one), as :func:`distrib.input.positions.numbered_batches`. A sharded loader skips
        to ``start`` in its batch sampler: the skipped batches' indices are drawn, never loaded."""
        return self._iterate(start=start, cycle=cycle, numbered=True)

    def _iterate(self, start: int, cycle: bool, numbered: bool) -> DistributedIterator:
        if self._sharded is not None:
            parts = self._sharded_parts(self._sharded, start, cycle, numbered)
        else:
            parts = self._read_all_parts(start, cycle, numbered)
        options = self._options
        elements = prefetching(
            parts,
            self._strategy.local_devices,
            bool(options.experimental_fetch_to_device),
            options.experimental_per_replica_buffer_size,
        )
        return DistributedIterator(elements, self._strategy)

    def _read_all_parts(self, start: int, cycle: bool, numbered: bool) -> Iterator[list[Any]]:
        """Every worker reads every global batch and keeps its local replicas' parts (policy DATA / OFF)."""
        s = self._strategy
        batches: Iterator[Any] = numbered_batches(self._dataset, start, cycle) if numbered else iter(self._dataset)
        n, total = s.num_local_replicas, s.num_replicas_in_sync
        first = s.data_worker_index * n
        for batch in _agreed(batches, s):
            yield [batch] if total == 1 else split_batch(batch, total)[first : first + n]

    def _sharded_parts(self, sharded: ShardedLoader, start: int, cycle: bool, numbered: bool) -> Iterator[list[Any]]:
        """This worker's loaded share of each global batch, split over its local replicas."""
        agreement = _ShardAgreement(self._strategy)
        steps = sharded.steps(start, cycle)
        n = self._strategy.num_local_replicas
        while True:
            item = next(steps, None)
            share = agreement.check(item)
            if share is None:
                return
            assert item is not None
            if numbered:
                x, y = split_xy(share)
                share = (x, y, item[0].size if isinstance(x, torch.Tensor) else len(x))
            yield [share] if n == 1 else split_batch(share, n)

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` structure of one replica's element (batch dimension None); reads one batch."""
        if self._spec is None:
            self._spec = peek_spec(self._dataset)
        return self._spec

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]


def _has_input_work(dataset: Any) -> bool:
    """Whether ``dataset`` loads (a DataLoader, a torch dataset) rather than holds ready batches (a list)."""
    from torch.utils.data import DataLoader, Dataset

    return isinstance(dataset, (DataLoader, Dataset))


class _ShardAgreement:
    """The per-step check of sharded input: every worker drew the same global batch (size and a checksum of its
    indices, never the examples: each worker holds other ones), its share has the same structure (tensors' number
    of dimensions and dtypes), and the data ends at the same step everywhere. One all-reduce of a few integers per worker per step; a worker whose share
    of a step is empty but never held one learns the batch structure from a worker that did (once)."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._template: Any = None
        self._step = 0

    def check(self, item: tuple[GlobalBatch, Any | None] | None) -> Any | None:
        """This worker's share of the step (an empty batch where it holds none), or None at the agreed end."""
        s = self._strategy
        share = None if item is None else item[1]
        if share is not None:
            self._template = empty_like(share)
        if s.num_workers == 1:
            return None if item is None else (share if share is not None else self._template)
        rows = torch.zeros(s.num_workers, 5, dtype=torch.int64)
        if item is not None:
            batch = item[0]
            shapes = shapes_fingerprint(share) if share is not None else 0
            rows[s.worker_index] = torch.tensor([1, batch.size, batch.indices_crc, shapes, self._template is None])
        s.communicator.all_reduce([rows])
        has = rows[:, 0].tolist()
        if not any(has):
            return None
        step = self._step
        if not all(has):
            raise CollectiveError(
                f"experimental_distribute_dataset: the data of worker(s) {[i for i, h in enumerate(has) if not h]} "
                f"ended after {step} global batches while worker(s) {[i for i, h in enumerate(has) if h]} have "
                "more. Every worker must read the same global batches: give every worker the same dataset"
            )
        if bool((rows[:, 1:3] != rows[0, 1:3]).any()):
            raise CollectiveError(
                f"experimental_distribute_dataset: global batch {step} differs between workers (sizes "
                f"{rows[:, 1].tolist()}, or the indices drawn). Every worker must draw the same global batches: seed "
                "the shuffle the same way on every worker (DataLoader(..., generator=torch.Generator()."
                "manual_seed(seed))), or give each worker its own data with strategy.distribute_datasets_from_function"
            )
        if len({v for v in rows[:, 3].tolist() if v}) > 1:
            raise CollectiveError(
                f"experimental_distribute_dataset: the examples of global batch {step} have tensors of different "
                "ranks or dtypes on different workers: every worker must read the same dataset"
            )
        if bool(rows[:, 4].any()):
            templates = s.communicator.all_gather_object(self._template)
            if self._template is None:
                self._template = next((t for t in templates if t is not None), None)
        self._step += 1
        if share is not None:
            return share
        if self._template is None:
            raise ValueError(f"experimental_distribute_dataset: global batch {step} is empty on every worker")
        return self._template


# --------------------------------------------------------------------------- checks


def _refuse_per_worker_sampler(dataset: Any, strategy: Strategy) -> None:
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
            "(no DistributedSampler; distrib shards it by index so that each worker loads only its own examples), "
            "or build per-worker data with strategy.distribute_datasets_from_function(lambda ctx: DataLoader(..., "
            "sampler=DistributedSampler(data, ctx.num_input_pipelines, ctx.input_pipeline_id)))"
        )


def _agreed(batches: Iterator[Any], strategy: Strategy) -> Iterator[Any]:
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
            rows[rank] = torch.tensor([1, batch_len(batch), fingerprint(batch)])
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
                "strategy.distribute_datasets_from_function"
            )
        if bool((rows[:, 1:] != rows[0, 1:]).any()):
            raise CollectiveError(
                f"experimental_distribute_dataset: global batch {step} differs between workers (sizes "
                f"{rows[:, 1].tolist()}). Every worker must read the same global batches: seed the shuffle the "
                "same way on every worker, or give each worker its own data with "
                "strategy.distribute_datasets_from_function"
            )
        step += 1
        yield batch
