"""Gradient all-reduce across workers, bucketed and overlapped with the backward pass.

This is the mechanism of PyTorch's DDP, kept small and with SUM semantics (the
user scaled the loss by the global batch, so ``optimizer.step()`` must not divide):

* parameters are grouped into buckets of about ``bucket_bytes``, in reverse
  registration order, which is roughly the order backward produces gradients;
* a post-accumulate-grad hook marks a parameter ready; when a bucket is complete
  and every earlier bucket is already launched, its gradients are flattened into
  one buffer and an asynchronous all-reduce starts, while backward continues;
* ``synchronize()`` (called by ``optimizer.step()``) launches what is left, in
  bucket order, waits, and copies the sums back into ``param.grad``.

Buckets are always launched in index order, so workers whose backward passes
produce gradients in different orders (or skip a parameter) still pair up the
same collectives. A second backward before ``step()`` (gradient accumulation)
is detected, and every bucket is then reduced again from the accumulated grads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from distrib.collectives import ProcessGroupCommunicator

__all__ = ["BucketedGradientReducer"]


class BucketedGradientReducer:
    """Sums the gradients of ``params`` over all workers, overlapping communication with backward."""

    def __init__(self, params: Sequence[torch.Tensor], communicator: "ProcessGroupCommunicator",
                 bucket_bytes: int) -> None:
        self._comm = communicator
        trainable = [p for p in params if p.requires_grad]
        self._buckets: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        size = 0
        for p in reversed(trainable):
            if current and (size >= bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
                self._buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self._buckets.append(current)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket}
        self._buffers = [torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                         for bucket in self._buckets]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]
        self._reset_step()

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def _reset_step(self) -> None:
        self._ready = [0] * len(self._buckets)
        self._seen: set[int] = set()
        self._work: list[Optional["dist.Work"]] = [None] * len(self._buckets)
        self._next = 0
        self._accumulating = False

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if id(param) in self._seen:
            self._accumulating = True  # a second backward before step(): launched sums are stale
            return
        self._seen.add(id(param))
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        while self._next < len(self._buckets) and self._ready[self._next] == len(self._buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        buffer, offset = self._buffers[b], 0
        with torch.no_grad():
            for p in self._buckets[b]:
                n = p.numel()
                if p.grad is None:
                    buffer[offset:offset + n].zero_()
                else:
                    buffer[offset:offset + n].copy_(p.grad.reshape(-1))
                offset += n
        self._work[b] = self._comm.all_reduce_async(buffer)

    def synchronize(self) -> None:
        """Finish every bucket's all-reduce and write the sums into ``param.grad``."""
        try:
            if self._accumulating:
                for work in self._work:
                    if work is not None:
                        self._comm.wait(work)
                self._work = [None] * len(self._buckets)
                self._next = 0
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            with torch.no_grad():
                for b, bucket in enumerate(self._buckets):
                    work = self._work[b]
                    assert work is not None
                    self._comm.wait(work)
                    offset = 0
                    for p in bucket:
                        n = p.numel()
                        reduced = self._buffers[b][offset:offset + n].view_as(p)
                        if p.grad is None:
                            p.grad = reduced.clone()
                        else:
                            p.grad.copy_(reduced)
                        offset += n
        finally:
            self._reset_step()

    def discard(self) -> None:
        """Forget this step's launched reductions (``zero_grad()`` without ``step()``)."""
        if self._next:
            # Collectives pair up by order: a bucket launched here is matched on every worker,
            # so finish them rather than leave them dangling.
            for work in self._work:
                if work is not None:
                    self._comm.wait(work)
        self._reset_step()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
