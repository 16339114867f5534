"""Gradient reduction across workers: bucketed, overlapped with backward, through a comm hook.

:class:`BucketedGradientReducer` is the mechanism of PyTorch's DDP, kept small and
with SUM semantics (the user scaled the loss by the global batch, so nothing divides):

* parameters are grouped into buckets of about ``bucket_bytes``, in reverse
  registration order, which is roughly the order backward produces gradients
  (:func:`bucket_layout`);
  each bucket owns one flat buffer, and after the first step every ``param.grad``
  is a view into it, so nothing is flattened or copied back;
* a post-accumulate-grad hook marks a parameter ready; when a bucket is complete
  and every earlier bucket has been launched, the comm hook (see
  :mod:`distrib.comm.hooks`) starts reducing its buffer while backward goes on;
* at the end of the backward pass (a callback queued on autograd's engine, as DDP
  does) the rest is launched and everything is waited for: when ``loss.backward()``
  returns, ``param.grad`` holds the gradient summed over all workers, so clipping
  or inspecting gradients sees what a single device would see.

Buckets are always launched in index order, so workers whose backward passes
produce gradients in different orders, or skip a parameter, still pair up the same
collectives. A second backward before ``step()`` (gradient accumulation) reduces
only the new contribution, captured by a tensor hook into a side buffer.

:func:`reduce_gradients` does the same synchronously for gradients that are
already complete (several local replicas summed first, then one reduction).

Both paths bucket through one function, :func:`bucket_layout`, with the same size
(``CommunicationOptions.bytes_per_pack``): given the same parameters, bucket ``i``
holds the same tensors on both, so a hook that keeps state per ``bucket.index``
(PowerSGD's error feedback) means the same bucket whichever path reduces it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.futures import Future

from distrib import torch_patches
from distrib.comm.communicator import Communicator
from distrib.comm.hooks import CommHook, GradBucket, allreduce_hook

__all__ = ["BucketedGradientReducer", "bucket_layout", "reduce_gradients"]


class _Bucket:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.delta: torch.Tensor | None = None  # new contributions, while accumulating

    def view(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def bucket_layout(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Which of ``tensors`` go in which bucket: lists of their indices, bucket 0 first.

    ``tensors`` are the trainable parameters in registration order (or their
    gradients, which have the same sizes). Buckets take them in *reverse* order,
    roughly the order backward produces gradients (as DDP), in consecutive runs of
    one dtype and device, a new bucket starting once one holds ``bucket_bytes`` or
    more. Every gradient path buckets through this function, so a bucket's index
    names the same tensors on all of them.

    Example::

        >>> sizes = [torch.zeros(4), torch.zeros(2), torch.zeros(8)]  # 16, 8 and 32 bytes
        >>> bucket_layout(sizes, bucket_bytes=32), bucket_layout(sizes, bucket_bytes=1 << 20)
        ([[2], [1, 0]], [[2, 1, 0]])
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[int]] = []
    size = 0
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        if (
            not groups
            or size >= bucket_bytes
            or t.dtype != tensors[groups[-1][0]].dtype
            or t.device != tensors[groups[-1][0]].device
        ):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += t.numel() * t.element_size()
    return groups


class BucketedGradientReducer:
    """Sums the gradients of ``params`` over all workers, overlapping communication with backward.

    Call :meth:`synchronize` from ``optimizer.step()``, :meth:`discard` from
    ``zero_grad()`` and :meth:`close` when the optimizer goes away (it removes the
    autograd hooks).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        communicator: Communicator,
        bucket_bytes: int,
        hook: CommHook = allreduce_hook,
    ) -> None:
        self._comm = communicator
        self._hook = hook
        trainable = [p for p in params if p.requires_grad]
        self._buckets = [_Bucket([trainable[i] for i in group]) for group in bucket_layout(trainable, bucket_bytes)]
        self._where = {id(p): (b, i) for b, bucket in enumerate(self._buckets) for i, p in enumerate(bucket.params)}
        self._handles = [
            h
            for p in trainable
            for h in (
                p.register_post_accumulate_grad_hook(self._on_grad_ready),
                p.register_hook(self._make_contribution_hook(p)),
            )
        ]
        self._synced = False
        self._reset_pass()

    def set_hook(self, hook: CommHook) -> None:
        """Reduce buckets with ``hook`` from the next backward pass on."""
        self._hook = hook

    def _reset_pass(self) -> None:
        self._ready = [0] * len(self._buckets)
        self._seen: set[int] = set()
        self._work: list[Future[torch.Tensor] | None] = [None] * len(self._buckets)
        self._next = 0
        self._callback_queued = False

    def _make_contribution_hook(self, param: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._synced:  # accumulating onto already-summed gradients: keep this pass's part apart
                b, i = self._where[id(param)]
                bucket = self._buckets[b]
                if bucket.delta is None:
                    bucket.delta = torch.zeros_like(bucket.buffer)
                bucket.view(i, bucket.delta).copy_(grad)

        return hook

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch_patches.queue_backward_callback(self.finish)
        if id(param) in self._seen:
            return
        self._seen.add(id(param))
        b, i = self._where[id(param)]
        bucket = self._buckets[b]
        if not self._synced:
            view = bucket.view(i, bucket.buffer)
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)
                param.grad = view
        self._ready[b] += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self._buckets) and (
            force or self._ready[self._next] == len(self._buckets[self._next].params)
        ):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        with torch.no_grad():
            if self._synced:
                if bucket.delta is None:
                    bucket.delta = torch.zeros_like(bucket.buffer)
                for i, p in enumerate(bucket.params):
                    if id(p) not in self._seen:
                        bucket.view(i, bucket.delta).zero_()
                    elif p.grad is not None:
                        p.grad.sub_(bucket.view(i, bucket.delta))  # back to the summed gradient
                self._work[b] = self._hook(self._comm, GradBucket(b, bucket.delta, bucket.params))
                return
            for i, p in enumerate(bucket.params):
                view = bucket.view(i, bucket.buffer)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
            self._work[b] = self._hook(self._comm, GradBucket(b, bucket.buffer, bucket.params))

    def finish(self) -> None:
        """Launch what is left, wait for every bucket, and leave the sums in ``param.grad``."""
        try:
            self._launch_ready(force=True)
            with torch.no_grad():
                for b, bucket in enumerate(self._buckets):
                    work = self._work[b]
                    assert work is not None, "every bucket is launched before it is waited for"
                    flat = bucket.delta if self._synced else bucket.buffer
                    assert flat is not None
                    result = self._comm.wait(work)
                    if result is not flat:
                        flat.copy_(result)
                    for i, p in enumerate(bucket.params):
                        if self._synced:
                            reduced = bucket.view(i, flat)
                            if p.grad is None:
                                p.grad = reduced.clone()
                            else:
                                p.grad.add_(reduced)
                        elif p.grad is not None or bucket.view(i, flat).any():
                            # a parameter no worker computed a gradient for keeps grad None, as on one device
                            p.grad = bucket.view(i, flat)
        finally:
            self._synced = True
            self._reset_pass()

    def synchronize(self) -> None:
        """Called by ``optimizer.step()``: make sure this step's gradients were summed, then start a new step."""
        if not self._synced:
            self.finish()  # no backward reached us (no gradients): still pair up the collectives
        self._synced = False

    def discard(self) -> None:
        """``zero_grad()``: a new step begins; a half-finished pass is completed so collectives stay paired."""
        if self._next:
            self.finish()
        self._synced = False

    def abandon(self) -> None:
        """Drop a pass that failed part way (a peer was lost): nothing is waited for, the next pass starts afresh."""
        self._synced = False
        self._reset_pass()
        for bucket in self._buckets:
            bucket.delta = None

    def close(self) -> None:
        """Remove the autograd hooks: this reducer reduces nothing from now on."""
        for h in self._handles:
            h.remove()
        self._handles = []


def reduce_gradients(
    communicator: Communicator,
    grads: Sequence[torch.Tensor],
    bucket_bytes: int,
    hook: CommHook = allreduce_hook,
    parameters: Sequence[torch.Tensor] | None = None,
) -> None:
    """Sum complete gradients over all workers in place, bucket by bucket through ``hook``.

    ``grads`` are in the parameters' registration order (the optimizer's), the order
    :class:`BucketedGradientReducer` is given its parameters in: both bucket through
    :func:`bucket_layout`, so with the same ``bucket_bytes`` bucket ``i`` is the same
    on both. ``parameters``: whose gradients these are, what each :class:`GradBucket`
    names (default: the gradients themselves, which have the same shapes).
    """
    if not grads:
        return
    if parameters is not None and len(parameters) != len(grads):
        raise ValueError(f"reduce_gradients got {len(grads)} gradients for {len(parameters)} parameters")
    owners = parameters if parameters is not None else grads
    pending = []
    for index, members in enumerate(bucket_layout(grads, bucket_bytes)):
        group = [grads[i] for i in members]
        flat = torch.cat([g.reshape(-1) for g in group])
        pending.append((group, flat, hook(communicator, GradBucket(index, flat, [owners[i] for i in members]))))
    with torch.no_grad():
        for group, _flat, future in pending:
            result = communicator.wait(future)
            offset = 0
            for g in group:
                g.copy_(result[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
