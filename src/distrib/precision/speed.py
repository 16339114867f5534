"""Whether autocast to bfloat16 or float16 is slow on the CPU at hand: measured once per process.

Why measure: whether a CPU runs a low-precision training step fast depends on which kernels
oneDNN and ATen pick on it, and no CPU flag tells that alone. Measured with the main job
(``distrib train``, docs/performance.md):

* an AMD EPYC with AVX2 only (no AVX512, AVX512-BF16 or AMX): ``bf16-mixed`` ran 12x slower
  than float32 (torch falls back to its generic ``slow_conv2d`` and matrix kernels);
* an AVX512-BF16 CPU (no AMX): bfloat16 1.40x *faster* than float32, float16 14x slower;
* an AMX Xeon that *has* AVX512-FP16: float16 still slow, because oneDNN computes a float16
  convolution's weight gradient with its reference kernel.

So :func:`measured_slowdown` times a small convolution and a linear layer, forward and
backward (the two layer kinds of the main job), under ``torch.autocast`` to the dtype and in
float32, alternating, and returns the median ratio of the times. It runs only when a mixed
precision is asked for (``ds.fit(precision=...)``, ``distrib train --precision``), never at
import; the result is cached for the process. It costs about 25 ms of CPU where the dtype is
fast, and 40-80 ms where it is slow (the slow kernels are what is being timed).

The timings are of one thread's CPU time (``time.thread_time``), with torch's intra-op threads
set to 1 for the measurement and restored after: on a machine shared with other processes the
wall clock measures the scheduler, and a thread's CPU time does not. A ratio of at least
:data:`SLOW_RATIO` is slow. Measured on a Xeon with AMX, natively and limited to AVX512-BF16 or
to AVX2 (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``; docs/performance.md), 6 fresh processes
each: fast dtypes gave 0.9-1.6x, slow ones 4.6-11.5x (the main job itself: 7-90x slower).

Example::

    >>> import torch
    >>> m = measured_slowdown(torch.bfloat16, "cpu")
    >>> m is None or m.ratio > 0
    True
    >>> measured_slowdown(torch.bfloat16, "cuda") is None  # GPUs: decided from the device, not measured
    True
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["SLOW_RATIO", "Slowdown", "measured_slowdown"]

#: a mixed-precision step taking at least this many times its float32 time is called slow
SLOW_RATIO = 2.5
_REPS = 5  # paired float32 / mixed repetitions after one warm-up of each; the median ratio decides


@dataclass(frozen=True)
class Slowdown:
    """A measurement: the autocast step's time over the float32 step's (median of paired repetitions)."""

    ratio: float
    cpu_seconds: float  # what the whole measurement cost this thread, warm-ups included

    @property
    def slow(self) -> bool:
        """Whether autocast to this dtype is markedly slower than float32 here."""
        return self.ratio >= SLOW_RATIO


def _probe_step() -> Callable[[torch.dtype | None], None]:
    """One small training step (convolution + linear, forward and backward) at a dtype; None: float32.

    The tensors come from a private generator, so the user's random stream is untouched.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, 12, 12, generator=g).contiguous(memory_format=torch.channels_last).requires_grad_()
    conv = (torch.randn(16, 8, 3, 3, generator=g) * 0.1).requires_grad_()
    h = torch.randn(64, 512, generator=g).requires_grad_()
    linear = (torch.randn(256, 512, generator=g) * 0.05).requires_grad_()
    leaves = (x, conv, h, linear)

    def step(dtype: torch.dtype | None) -> None:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            y = F.conv2d(x, conv).float().sum() + F.linear(h, linear).float().sum()
        y.backward()
        for t in leaves:
            t.grad = None

    return step


def _time(step: Callable[[torch.dtype | None], None], dtype: torch.dtype | None) -> float:
    start = time.thread_time()
    step(dtype)
    return time.thread_time() - start


def _measure(dtype: torch.dtype) -> Slowdown:
    start = time.thread_time()
    step = _probe_step()
    step(None)  # warm-ups: oneDNN builds its kernels on first use
    step(dtype)
    ratios: list[float] = []
    needed = _REPS // 2 + 1
    while len(ratios) < _REPS:
        fp32 = _time(step, None)
        ratios.append(_time(step, dtype) / max(fp32, 1e-9))
        if sum(r >= SLOW_RATIO for r in ratios) >= needed or sum(r < SLOW_RATIO for r in ratios) >= needed:
            break  # the median's side of the threshold is decided: spare the slow kernels more repetitions
    return Slowdown(statistics.median(ratios), time.thread_time() - start)


@functools.cache
def measured_slowdown(dtype: torch.dtype, device_type: str) -> Slowdown | None:
    """How much slower a small step runs under autocast to ``dtype`` than in float32 on ``device_type``.

    Measured once per process and dtype (cached). None where nothing is measured: devices other
    than the CPU (the caller decides for GPUs from the device's properties, see
    :meth:`distrib.precision.Precision.slow_here`), or if autocast fails here.
    """
    if device_type != "cpu":
        return None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode(False), torch.enable_grad():
            return _measure(dtype)
    except RuntimeError:  # an autocast dtype this build cannot run on the CPU: nothing to say
        return None
    finally:
        torch.set_num_threads(threads)
