"""Distributing input: global batches split over replicas, or one pipeline per worker.

Two entry points, as in ``tf.distribute``:

* ``strategy.experimental_distribute_dataset(dataset, options=None)``: ``dataset`` yields *global*
  batches; each is split along dim 0 over every replica in sync, as evenly as
  possible. Nothing is dropped or duplicated: a short last batch of 6 over 4
  replicas gives 2, 2, 1, 1 examples, and a replica left with nothing gets an
  empty batch (dim 0 of size 0) so that every replica still runs the step. Under
  several workers a ``DataLoader`` over a map-style dataset is auto-sharded: each
  worker loads only its own replicas' examples (:class:`AutoShardPolicy`).
* ``strategy.distribute_datasets_from_function(dataset_fn, options=None)``: ``dataset_fn`` is
  called once per worker with an :class:`InputContext` and yields *per-replica*
  batches; local replicas take consecutive batches.

``options`` is an :class:`InputOptions` (TF's ``tf.distribute.InputOptions``, plus the auto-shard policy).

Modules: :mod:`~distrib.input.options` (what the user passes), :mod:`~distrib.input.batches` (splitting and
moving batches), :mod:`~distrib.input.sharding` (a worker's share of a ``DataLoader``),
:mod:`~distrib.input.datasets` and :mod:`~distrib.input.per_worker` (the two entry points),
:mod:`~distrib.input.iterators` (TF's iterator API, the copy to the devices and its prefetch),
:mod:`~distrib.input.positions` (``fit``'s numbered batches from a global data position).
"""

from __future__ import annotations

from distrib.input.batches import TensorSpec, spec_of, split_batch
from distrib.input.datasets import DistributedDataset
from distrib.input.iterators import DistributedIterator, OptionalValue, OutOfRangeError
from distrib.input.options import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode
from distrib.input.per_worker import DistributedDatasetsFromFunction

__all__ = [
    "AutoShardPolicy",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "OptionalValue",
    "OutOfRangeError",
    "TensorSpec",
    "split_batch",
    "spec_of",
]
