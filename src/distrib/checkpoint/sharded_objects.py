"""A ``Checkpoint``'s objects as a sharded directory, ``<prefix>.dcp``: written in parallel, read anywhere.

Under a strategy whose :attr:`~distrib.strategies.base.Strategy.checkpoint_format` is
``"sharded"`` (``ShardedStrategy`` with several workers), ``Checkpoint`` does not gather the
model: every worker hands its own state (``strategy.local_checkpoint_state``: ``DTensor``
shards) to :func:`~distrib.checkpoint.sharded.save_sharded`, which writes each worker's shards
in parallel into one directory with distrib's manifest (atomic, CRC-checked, never unpickled).
The directory holds ``{"save_counter": n, "objects": {name: state}}``, the same layout as the
single file ``<prefix>.pt``.

Reading it back needs targets shaped like what was saved: the saved structure comes from the
manifest alone (``sharded_readers.read_structure``, as ``consolidate`` builds it), every tensor a
``meta`` tensor (a shape and a dtype, no storage) or read whole. Then:

* a strategy that keeps whole states (every other one, or a plain process) reads every tensor
  whole (:func:`read_whole`, no collective: each process reads alone), and the result goes through
  the same validation and all-or-nothing restore as a ``.pt`` file;
* a sharded strategy reads into tensors laid out like the live objects' (:func:`read_like`:
  a parameter's shard, an optimizer state's shard like its parameter's), so each worker reads only
  the bytes of its own shards, whatever number of workers wrote them (DCP's resharding), and no
  worker ever holds the whole model.

Plain PyTorch reads it without distrib: ``torch.distributed.checkpoint.load({"objects": {"model":
model.state_dict()}}, checkpoint_id="ckpt-1.dcp")``, or ``format_utils.dcp_to_torch_save``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from distrib.checkpoint.errors import CheckpointError, checkpoint_timeout

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["SUFFIX", "write", "read_whole", "read_like"]

#: the directory of checkpoint ``<prefix>`` in the sharded format (the single-file format is ``<prefix>.pt``)
SUFFIX = ".dcp"


def write(
    strategy: Strategy, path: str, counter: int, states: dict[str, Any], timeout: float | None
) -> CheckpointError | None:
    """Every worker writes its shards of ``states`` into ``<path>.dcp``; the error (on every worker), or None.

    DCP's collectives (the chief gathers every worker's plan and results) wait under the
    checkpoint's timeout, not the collectives' shorter one: a worker still writing is not dead.
    """
    from distrib.checkpoint.sharded import save_sharded

    def save() -> CheckpointError | None:
        try:
            save_sharded(path + SUFFIX, {"save_counter": counter, "objects": states})
        except CheckpointError as e:  # every worker raises it (save_sharded shares the failure)
            error = CheckpointError(
                f"Writing the sharded checkpoint {path + SUFFIX!r} failed ({e}); the "
                "checkpoints written before it are as they were"
            )
            error.__cause__ = e
            return error
        return None

    return strategy.communicator.guarded(
        f"writing the sharded checkpoint {path + SUFFIX!r}", save, timeout=checkpoint_timeout(timeout)
    )


# --------------------------------------------------------------- reading
def _read(directory: str, tensor: str) -> dict[str, Any]:
    """The checkpoint's ``{"save_counter": n, "objects": {...}}`` from its checked manifest; each tensor ``meta``
    (a shape and a dtype: a skeleton to lay targets out by) or ``whole`` (read and checked by this process)."""
    from distrib.checkpoint.sharded import manifest_of
    from distrib.checkpoint.sharded_readers import fill_tensor, read_structure

    manifest = manifest_of(directory)

    def make(fqn: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if tensor == "meta":
            return torch.empty(size, dtype=dtype, device="meta")
        out = torch.empty(size, dtype=dtype)
        fill_tensor(directory, manifest, fqn, out)
        return out

    data, _ = read_structure(directory, manifest, make)
    if not (isinstance(data, dict) and isinstance(data.get("objects"), dict)):
        raise CheckpointError(
            f"{directory!r} is a sharded checkpoint but not one of ds.Checkpoint (it holds "
            f"{sorted(data) if isinstance(data, dict) else type(data).__name__}, not 'objects'); "
            "load it with distrib.checkpoint.sharded.load_sharded"
        )
    from distrib.checkpoint import sharded_format as sf

    for state in data["objects"].values():
        sf.int_optimizer_keys(state)
    return data


def read_whole(directory: str) -> dict[str, Any]:
    """``{"save_counter": n, "objects": {...}}`` with every tensor whole, read by this process alone."""
    return _read(directory, "whole")


def read_like(directory: str, objects: Mapping[str, Any], strategy: Strategy) -> dict[str, Any]:
    """``{"save_counter": n, "objects": {...}}`` read into tensors laid out as ``objects``' live states are
    (``strategy.local_checkpoint_state``): every worker calls it (DCP's collectives), each reads its shards."""
    from distrib.checkpoint.sharded import load_sharded

    data = _read(directory, "meta")
    stored = data["objects"]
    targets = {name: _target(obj, stored[name], strategy) for name, obj in objects.items() if name in stored}
    wanted = {**data, "objects": targets}  # what is not tracked is not read (its names stay, for the status)

    def load() -> CheckpointError | None:
        try:
            load_sharded(directory, wanted, all_or_nothing=False)  # fresh targets: nothing live changes yet
        except CheckpointError as e:  # every worker has it: not a CollectiveError of the guard
            return e
        return None

    error = strategy.communicator.guarded(f"reading the sharded checkpoint {directory!r}", load)
    if error is not None:
        raise error
    return {**wanted, "objects": {**stored, **targets}}


# --------------------------------------------------------------- targets
def _empty(state: Any) -> Any:
    """``state`` with every meta tensor replaced by an uninitialised whole one (filled by the load)."""
    from distrib.checkpoint import sharded_format as sf

    return pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype), state, is_leaf=sf.stored_whole
    )


def _like(meta: Any, live: Any) -> Any:
    """A target for a saved tensor: laid out as the live tensor (a DTensor shard) when the shapes agree."""
    if isinstance(meta, torch.Tensor) and isinstance(live, torch.Tensor) and tuple(live.shape) == tuple(meta.shape):
        return torch.empty_like(live, dtype=meta.dtype)
    return _empty(meta)


def _target(obj: Any, saved: Any, strategy: Strategy) -> Any:
    if isinstance(obj, torch.optim.Optimizer) and isinstance(saved, dict) and isinstance(saved.get("state"), dict):
        params = [p for group in obj.param_groups for p in group["params"]]
        state = {
            i: {k: _like(v, params[i] if isinstance(i, int) and i < len(params) else None) for k, v in entry.items()}
            if isinstance(entry, dict)
            else entry
            for i, entry in saved["state"].items()
        }
        return {**{k: _empty(v) for k, v in saved.items() if k != "state"}, "state": state}
    if isinstance(obj, torch.Tensor) or not isinstance(saved, dict):
        return _empty(saved)
    live = strategy.local_checkpoint_state(obj)
    return {k: _like(v, live.get(k) if isinstance(live, Mapping) else None) for k, v in saved.items()}
