"""Steps that survive a lost worker: ``MultiWorkerMirroredStrategy(fault_tolerant=True)``.

Three parts, over the :class:`~distrib.comm.membership.FaultTolerantCommunicator`:

* **whole global batches**: under fault tolerance ``experimental_distribute_dataset`` gives every
  worker each global batch whole (:class:`WholeBatch`); ``strategy.run`` cuts this worker's share
  from it when the step runs, over the membership of that moment. A step redone after a fault,
  and every later one, is so split over the survivors: each example of the global batch is still
  computed once per step, and with a loss summed over the global batch
  (``compute_average_loss(..., global_batch_size=...)``) the steps are those of a run without
  the fault, up to the order of the sums;
* **the commit gate**: ``optimizer.step()`` applies the reduced gradients only once one more
  all-reduce over the members succeeded (it also compares a checksum of each member's global batch,
  the check ``experimental_distribute_dataset`` makes at every step without fault tolerance) (:meth:`FaultTolerantCommunicator.commit
  <distrib.comm.membership.FaultTolerantCommunicator.commit>`); a step is applied by every
  member or by none of the new membership;
* **the step guard** (:class:`FaultTolerantSteps`): a step whose collective failed is given up
  (its gradients dropped) and run again in the new group, in the same process, with no restart
  and no checkpoint read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from distrib.comm import CollectiveError
from distrib.comm.membership import FaultTolerantCommunicator
from distrib.input.batches import fingerprint, split_batch

if TYPE_CHECKING:
    from distrib.strategies.replica_engine import ReplicaEngine

__all__ = ["FaultTolerantDataset", "FaultTolerantSteps", "StepAbandoned", "WholeBatch"]

log = logging.getLogger("distrib.strategies")


class WholeBatch:
    """A global batch that ``strategy.run`` splits over the members when the step runs (fault tolerance).

    What iterating a fault-tolerant strategy's distributed dataset gives: hand it to ``strategy.run``
    as you would a per-replica batch. ``batch`` is the whole global batch; :meth:`share` is one
    member's part (``split_batch``'s: the first ``len % members`` members hold one example more).

    Example::

        >>> import torch
        >>> WholeBatch(torch.arange(5)).share(1, 2)
        tensor([3, 4])
    """

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def share(self, rank: int, members: int) -> Any:
        """Member ``rank``'s part of the batch among ``members``."""
        return self.batch if members == 1 else split_batch(self.batch, members)[rank]

    def __repr__(self) -> str:
        return f"WholeBatch({self.batch!r})"


class FaultTolerantDataset:
    """``experimental_distribute_dataset`` under fault tolerance: each global batch of ``dataset``, whole.

    Every worker reads every global batch (``AutoShardPolicy.DATA``): when a worker is lost, the
    others take over its share of the same batch at once, with nothing to reload. Elements are
    :class:`WholeBatch` objects, which ``strategy.run`` splits.
    """

    def __init__(self, dataset: Iterable[Any]) -> None:
        self._dataset = dataset

    def __iter__(self) -> Iterator[WholeBatch]:
        return (WholeBatch(batch) for batch in self._dataset)

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]


class StepAbandoned(Exception):
    """Raised through the step function by the commit gate: the step is redone over the new membership."""


class FaultTolerantSteps:
    """Runs ``strategy.run``'s steps so that a lost worker costs one redone step (see the module docstring)."""

    def __init__(self, communicator: FaultTolerantCommunicator, engine: ReplicaEngine) -> None:
        self._comm = communicator
        self._engine = engine
        self._gated = False  # whether this step's gradients went through the gate (one optimizer step per run)
        engine.commit_gate = self.commit

    def run(
        self, call: Callable[[tuple[Any, ...], dict[str, Any]], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``call`` on this member's share of ``args``/``kwargs``, again over the survivors until a try completes."""
        redone = 0
        while True:
            comm = self._comm
            local_args, local_kwargs = _shares((args, kwargs), comm.rank, comm.world_size, redone)
            comm.begin_step(_fingerprint((args, kwargs)))
            self._gated = False
            try:
                return call(local_args, local_kwargs)
            except StepAbandoned:
                pass
            except Exception:
                if comm.step_failure is None:
                    raise  # the user's own error
                if comm.recover_step() == "apply":  # only a member holding the gradients may apply them
                    raise
            finally:
                comm.end_step()
            self._engine.abandon_step()
            redone += 1
            log.warning(
                "worker %d: the step is run again over %d worker(s) %s", comm.member_id, comm.world_size, comm.members
            )

    def commit(self) -> None:
        """The engine's commit gate: return to apply the reduced gradients, raise :class:`StepAbandoned` to redo."""
        if self._gated:
            raise ValueError(
                "MultiWorkerMirroredStrategy(fault_tolerant=True) applies one optimizer step per strategy.run (a "
                "fault redoes the whole step function); call strategy.run once per optimizer step"
            )
        self._gated = True
        if not self._comm.commit():
            raise StepAbandoned


def _fingerprint(structure: Any) -> int:
    """A checksum of the step's whole global batches (0 where there are none): equal on every member."""
    wholes = [
        x.batch
        for x in pytree.tree_leaves(structure, is_leaf=lambda x: isinstance(x, WholeBatch))
        if isinstance(x, WholeBatch)
    ]
    return fingerprint(wholes) if wholes else 0


def _shares(structure: Any, rank: int, members: int, redone: int) -> Any:
    """``structure`` with every :class:`WholeBatch` replaced by member ``rank``'s share; on a redone step, other
    tensors are refused: they were cut for the old membership, and nothing can cut them again."""
    leaves, spec = pytree.tree_flatten(structure, is_leaf=lambda x: isinstance(x, WholeBatch))
    if redone and any(isinstance(x, torch.Tensor) and x.dim() > 0 for x in leaves):
        raise CollectiveError(
            "a worker was lost during a step whose inputs are tensors given to strategy.run directly; under "
            "fault_tolerant=True they cannot be split again over the remaining workers. Feed the steps from "
            "strategy.experimental_distribute_dataset(global_batches), whose elements strategy.run splits when the "
            "step runs"
        )
    return pytree.tree_unflatten([x.share(rank, members) if isinstance(x, WholeBatch) else x for x in leaves], spec)
