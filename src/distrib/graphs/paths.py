"""Which path a ``ds.function`` signature takes (a CUDA graph, or eager) and the words that say why.

A graph is captured where every part of the step can be: the tensors on one CUDA device, every strategy
the step ran ``run`` on able to (``Strategy.graph_capture_blocker``), no per-replica values (several
replicas in one process), no input that requires a gradient. Everything else runs eagerly, as the same
call without ``ds.function`` would, and the first call says so once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from distrib.graphs.cuda_graph import backend
from distrib.graphs.signature import Inputs

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["capture_device", "input_blocker", "strategy_blocker", "host_syncs", "sync_blocker", "MODES"]

#: ``ds.function(mode=...)``: "auto" captures where it can; "eager" never does; "cuda_graph" makes a
#: failure to capture an error instead of a fallback
MODES = ("auto", "eager", "cuda_graph")


def capture_device(
    inputs: Inputs, strategies: Iterable[Strategy], params: Iterable[torch.Tensor] = ()
) -> torch.device | None:
    """The one CUDA device the step computes on (its tensors', its strategies', its parameters'), or None."""
    kind = backend().device_type
    devices = {t.device for t in inputs.tensors if t.device.type == kind}
    devices.update(p.device for p in params if p.device.type == kind)
    for strategy in strategies:
        devices.update(d for d in strategy.local_devices if d is not None and d.type == kind)
    if len(devices) != 1:
        return None
    device = devices.pop()
    if kind != "cuda":  # a stand-in's device (tests)
        return device
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def input_blocker(inputs: Inputs) -> str | None:
    """Why these arguments cannot go into a graph's buffers, or None."""
    if inputs.has_per_replica:
        return (
            "its arguments hold per-replica values: several replicas run in this process, on threads, and a "
            "CUDA graph holds one thread's kernels"
        )
    if any(t.requires_grad for t in inputs.tensors):
        return "an argument requires a gradient, which a graph's input buffer cannot carry"
    if any(t.is_sparse for t in inputs.tensors):
        return "an argument is a sparse tensor"
    for leaf in inputs.leaves:
        if _is_data_source(leaf):
            return (
                f"an argument is a {type(leaf).__name__}: the batches the function reads from it would be the "
                "capture's at every replay (TF's `for x in dataset` inside a tf.function becomes a graph loop; "
                "a CUDA graph cannot read new data). Decorate the step that takes one batch instead"
            )
    return None


def _is_data_source(leaf: object) -> bool:
    """An iterable or iterator that is not a tensor, a string or a module (a dataset, a DataLoader, an iterator)."""
    if isinstance(leaf, (torch.Tensor, str, bytes, torch.nn.Module)):
        return False
    return hasattr(leaf, "__iter__") or hasattr(leaf, "__next__")


def strategy_blocker(inputs: Inputs, strategies: Iterable[Strategy], params: Iterable[torch.Tensor] = ()) -> str | None:
    """Why the step cannot be captured, given what its warm-up calls ran on and trained; None when it can."""
    strategies = list(strategies)
    for strategy in strategies:
        reason = strategy.graph_capture_blocker
        if reason is not None:
            return reason
    if not backend().available():
        return "CUDA is not available here, and CUDA graphs need a CUDA device"
    params = list(params)
    if capture_device(inputs, strategies, params) is None:
        devices = sorted({str(t.device) for t in inputs.tensors} | {str(p.device) for p in params}) or ["none"]
        return (
            f"its tensors are on {', '.join(devices)}, not on one CUDA device, and CUDA graphs need one "
            "(place the batches on the GPU, e.g. through strategy.experimental_distribute_dataset)"
        )
    return None


@contextlib.contextmanager
def host_syncs(found: list[str], watch: bool = True) -> Iterator[None]:
    """While ``watch``: note in ``found`` where the block makes the host wait for the GPU (``.item()``,
    ``float(t)``, a GradScaler's inf check, a blocking copy), through torch's public
    ``torch.cuda.set_sync_debug_mode("warn")``. The last warm-up call runs under it: a step that waits for the
    GPU cannot be captured (a capture forbids it), so it is known before a capture is tried."""
    if not watch or backend().device_type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if "synchroniz" in str(w.message):
            found.append(f"{w.filename}:{w.lineno}")
        else:  # not ours: shown as they would have been
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def sync_blocker(syncs: list[str]) -> str | None:
    """Why a step that waited for the GPU cannot be captured, naming where it waited; None when it did not."""
    if not syncs:
        return None
    where = ", ".join(dict.fromkeys(syncs))
    return (
        f"the step makes the host wait for the GPU (at {where}: .item(), float(t), print(t), a blocking copy, "
        "or a GradScaler with an optimizer whose step cannot skip on the device: build it with fused=True), "
        "which a CUDA graph cannot hold; move that out of the ds.function"
    )
