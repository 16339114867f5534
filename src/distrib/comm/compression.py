"""Casting comm hooks: send each gradient bucket as fp16 or bf16, as DDP's ``fp16_compress_hook``.

``CommunicationOptions(compression="bf16")`` (or ``"fp16"``) installs a :class:`CastHook`:
for every bucket it casts the flat fp32 gradients to the 16-bit type, sums them over
the workers in that type (half the bytes on the wire), and casts the sum back into
the bucket, so ``param.grad`` stays fp32.

The two types differ in range, and so in what can go wrong:

* **bf16** keeps fp32's exponent range: nothing overflows or underflows that would
  not in fp32; each value keeps 8 significant bits (relative rounding <= 2**-8 per
  cast and per addition).
* **fp16** keeps 11 significant bits but only reaches 65504 (and 6e-8 at the small
  end). To keep the *sum* in range, each worker divides its gradients by the
  number of workers before the cast and the sum is multiplied back after (DDP's
  fp16 hook does the same): the sum over ``W`` workers of ``g / W`` is never
  larger than the largest ``|g|``, so the all-reduce overflows only where a
  worker's own gradient is already >= 65504. Such a value becomes ``inf`` in
  ``param.grad``, as it would in fp16 training: ``torch.amp.GradScaler`` sees it and
  skips the step; without a scaler, prefer bf16. Dividing also moves small values
  down: a gradient below about ``6e-8 * W`` loses precision or becomes 0.

Buckets that are not fp32 or fp64 (already 16-bit, or integers) are summed as they are.
"""

from __future__ import annotations

import torch
from torch.futures import Future

from distrib.comm.communicator import Communicator
from distrib.comm.hooks import DeferredFuture, GradBucket

__all__ = ["CastHook", "CAST_DTYPES"]

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CastHook:
    """A comm hook that sums each bucket over the workers in ``"fp16"`` or ``"bf16"``.

    One low-precision buffer per bucket index is kept and reused, so no step
    allocates. For fp16 the bucket is divided by the number of workers before the
    cast and multiplied after (see the module's notes on range).

    Example::

        >>> from distrib.comm import LocalCommunicator
        >>> hook = CastHook("bf16")
        >>> bucket = GradBucket(0, torch.tensor([1.0, 1.0 + 2 ** -10]), [torch.zeros(2)])
        >>> hook(LocalCommunicator(), bucket).wait()  # 1 + 2**-10 is not a bf16: it rounds to 1
        tensor([1., 1.])
    """

    def __init__(self, dtype: str) -> None:
        if dtype not in CAST_DTYPES:
            raise ValueError(f"CastHook(dtype={dtype!r}): dtype must be 'fp16' or 'bf16'")
        self.name = dtype
        self.dtype = CAST_DTYPES[dtype]
        self._buffers: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"CastHook({self.name!r})"

    def _buffer(self, bucket: GradBucket) -> torch.Tensor:
        flat = bucket.buffer
        low = self._buffers.get(bucket.index)
        if low is None or low.numel() != flat.numel() or low.device != flat.device:
            low = torch.empty(flat.numel(), dtype=self.dtype, device=flat.device)
            self._buffers[bucket.index] = low
        return low

    def __call__(self, communicator: Communicator, bucket: GradBucket) -> Future[torch.Tensor]:
        flat = bucket.buffer
        if flat.dtype not in (torch.float32, torch.float64):
            return communicator.all_reduce_async(flat)  # nothing to gain, or nothing to cast to
        workers = communicator.world_size
        low = self._buffer(bucket)
        with torch.no_grad():
            low.copy_(flat.reshape(-1))
            if self.dtype == torch.float16 and workers > 1:
                # after the cast: copy_ is vectorised, a fused divide-and-cast is 4x slower; dividing by a
                # power of two is exact in fp16 (bar subnormals), and |g| / W fits wherever g did
                low.div_(workers)
        work = communicator.all_reduce_async(low)

        def finish() -> torch.Tensor:
            summed = communicator.wait(work)
            with torch.no_grad():
                flat.view(-1).copy_(summed)
                if self.dtype == torch.float16 and workers > 1:
                    flat.mul_(workers)  # in fp32: the sum itself may exceed fp16's range
            return flat

        return DeferredFuture(finish)
