"""What a user tells the input pipeline (``InputOptions``, ``AutoShardPolicy``) and what it tells a dataset function
(``InputContext``): TF's names, with PyTorch's meaning.

TF attaches the auto-shard policy to the dataset (``tf.data.Options().experimental_distribute.auto_shard_policy``);
a ``DataLoader`` has no options, so distrib takes it in :class:`InputOptions` (``experimental_auto_shard_policy``),
passed as ``strategy.experimental_distribute_dataset(loader, options=ds.InputOptions(...))``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["AutoShardPolicy", "InputContext", "InputOptions", "InputReplicationMode", "resolve_options"]


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shares the input work between workers
    (``tf.data.experimental.AutoShardPolicy``, same names and values).

    * ``AUTO`` (the default): a ``DataLoader`` over a map-style dataset is sharded by index: each worker's
      loader reads, transforms and collates only the examples of its own replicas' part of every global
      batch, and the global batches stay those one process would read. Anything else (an iterable-style
      dataset, a generator, a list of batches) is read whole by every worker, which keeps its share (``DATA``),
      with a warning once under several workers, since every worker then does the whole input work.
    * ``DATA``: every worker reads every global batch and keeps its replicas' part (TF: "each worker will
      process the whole dataset and discard the portion that is not for itself").
    * ``OFF``: no auto-sharding: as ``DATA`` in distrib (TF's ``OFF`` gives every worker the whole data,
      which would train on every example once per worker; distrib's elements are global batches, so the step's
      math never depends on the number of workers).
    * ``FILE``, ``HINT``: TF's file- and hint-based sharding have no ``DataLoader`` counterpart; refused.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class InputReplicationMode(enum.Enum):
    """Whether ``distribute_datasets_from_function`` calls its function once per worker (``PER_WORKER``, the
    default) or once per replica (``PER_REPLICA``), as ``tf.distribute.InputReplicationMode``."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclass(frozen=True)
class InputOptions:
    """Options of ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``
    (``tf.distribute.InputOptions``, plus the auto-shard policy TF keeps on the dataset).

    Passed as ``strategy.experimental_distribute_dataset(loader, options=ds.InputOptions(...))`` (or to
    ``distribute_datasets_from_function``); the defaults suit most training loops.

    Attributes:
        experimental_fetch_to_device: each replica's part is copied to its device (pinned host memory first
            where the device is a GPU, then a ``non_blocking`` copy). False: parts stay on the host as the
            pipeline made them; the step moves them. None (the default): True, unless
            ``experimental_place_dataset_on_device``.
        experimental_replication_mode: :class:`InputReplicationMode` (``distribute_datasets_from_function``
            only; ``PER_REPLICA`` calls the function once per local replica, with one input pipeline per
            replica).
        experimental_place_dataset_on_device: the function's pipeline already yields tensors on its replica's
            device (``PER_REPLICA`` only, with ``experimental_fetch_to_device=False``, as TF).
        experimental_per_replica_buffer_size: how many steps ahead the parts are copied to GPU replicas'
            devices, on a side CUDA stream, while the current step runs; 0 turns the prefetch off. Nothing is
            read ahead when every replica is on the CPU (there is no copy to overlap).
        experimental_auto_shard_policy: how the workers share the input work: see :class:`AutoShardPolicy`
            (default ``AUTO``).

    Raises:
        ValueError: ``experimental_per_replica_buffer_size`` is negative; ``experimental_place_dataset_on_device``
            with ``experimental_fetch_to_device=True`` or without ``PER_REPLICA``; a replication mode or an
            auto-shard policy that is not one of their enums' values.

    Example::

        >>> import distrib as ds
        >>> ds.InputOptions(experimental_auto_shard_policy=ds.AutoShardPolicy.DATA).experimental_fetch_to_device
        True
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    experimental_auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        if self.experimental_fetch_to_device is None:
            object.__setattr__(self, "experimental_fetch_to_device", not self.experimental_place_dataset_on_device)
        object.__setattr__(
            self, "experimental_replication_mode", InputReplicationMode(self.experimental_replication_mode)
        )
        object.__setattr__(self, "experimental_auto_shard_policy", AutoShardPolicy(self.experimental_auto_shard_policy))
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError(
                f"experimental_per_replica_buffer_size={self.experimental_per_replica_buffer_size}: "
                "use 0 (no prefetch) or more"
            )
        if self.experimental_place_dataset_on_device:
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "experimental_place_dataset_on_device=True and experimental_fetch_to_device=True "
                    "cannot both be set: a pipeline already on the device has nothing to fetch "
                    "(as in TF)"
                )
            if self.experimental_replication_mode is not InputReplicationMode.PER_REPLICA:
                raise ValueError(
                    "experimental_place_dataset_on_device=True needs experimental_replication_mode="
                    "InputReplicationMode.PER_REPLICA (one pipeline per replica device), as in TF"
                )


def resolve_options(options: Any, entry: str) -> InputOptions:
    """``options`` as :class:`InputOptions` (None: the defaults); TypeError naming the class for anything else."""
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"{entry}(..., options=...) takes a ds.InputOptions, not a {type(options).__name__}: "
            "e.g. ds.InputOptions(experimental_auto_shard_policy=ds.AutoShardPolicy.DATA)"
        )
    return options


@dataclass(frozen=True)
class InputContext:
    """What one worker's input pipeline needs to know to read its share (``tf.distribute.InputContext``).

    ``distribute_datasets_from_function(dataset_fn)`` calls ``dataset_fn(ctx)`` with one (once per worker, or
    per replica with ``InputReplicationMode.PER_REPLICA``): the function reads its share of the data
    (e.g. a ``DistributedSampler(num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id)``) in
    batches of ``ctx.get_per_replica_batch_size(global_batch_size)`` per replica.

    Attributes:
        num_input_pipelines: how many input pipelines there are in all (the workers, or the replicas with
            ``PER_REPLICA``).
        input_pipeline_id: this pipeline's index, from 0 to ``num_input_pipelines - 1``.
        num_replicas_in_sync: the replicas a global batch is split over (all workers').

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
        """The batch size each replica gets from a global batch: ``global_batch_size / num_replicas_in_sync``.

        Args:
            global_batch_size: the batch size of one step over all replicas.

        Returns:
            ``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: ``num_replicas_in_sync`` does not divide ``global_batch_size`` (the message proposes the
                next multiple).
        """
        if global_batch_size % self.num_replicas_in_sync:
            up = math.ceil(global_batch_size / self.num_replicas_in_sync) * self.num_replicas_in_sync
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by num_replicas_in_sync="
                f"{self.num_replicas_in_sync}; use a multiple of {self.num_replicas_in_sync} (e.g. {up})"
            )
        return global_batch_size // self.num_replicas_in_sync
