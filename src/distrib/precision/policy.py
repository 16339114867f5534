"""A training precision by Lightning's name, for the loops (``ds.fit``, ``distrib train``).

A loop concept, not a strategy's: it says which autocast a step's forward pass runs under and
whether a ``GradScaler`` scales the loss. How a ``GradScaler``'s calls agree over replicas and
workers is the strategies' part (:mod:`distrib.strategies.amp`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

from distrib.precision import speed
from distrib.precision.speed import Slowdown

__all__ = ["Precision", "backward_and_step"]

#: Lightning's precision names (``Trainer(precision=...)``) and the autocast dtype of each (None: no autocast)
_PRECISIONS: dict[str, torch.dtype | None] = {
    "32": None,
    "32-true": None,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}
#: Lightning's older names, accepted with its warning
_LEGACY = {"16": "16-mixed", "bf16": "bf16-mixed"}


@dataclass(frozen=True)
class Precision:
    """A training precision by Lightning's name: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``.

    Mixed precision runs the forward pass and the loss under ``torch.autocast`` (bfloat16 or
    float16 matrix products, float32 parameters and optimizer); ``"16-mixed"`` also needs a
    ``GradScaler`` (float16's range is small: the loss is scaled up so that small gradients
    do not underflow, and a step whose gradients overflow is skipped). Used by ``ds.fit`` and
    ``distrib train --precision``.

    Example::

        >>> import torch
        >>> p = Precision.parse("bf16-mixed")
        >>> with p.autocast("cpu"):
        ...     y = torch.nn.Linear(4, 2)(torch.ones(3, 4))
        >>> y.dtype, p.grad_scaler("cpu")
        (torch.bfloat16, None)
        >>> type(Precision.parse("16-mixed").grad_scaler("cpu")).__name__
        'GradScaler'
    """

    name: str
    dtype: torch.dtype | None

    @classmethod
    def parse(cls, precision: str | int, argument: str = "precision") -> Precision:
        """The precision named ``precision``; a ValueError naming ``argument`` for an unknown one."""
        name = str(precision)
        if name in _LEGACY:
            warnings.warn(
                f"{argument}={precision!r} is Lightning's older name; use {argument}={_LEGACY[name]!r}",
                UserWarning,
                stacklevel=3,
            )
            name = _LEGACY[name]
        if name not in _PRECISIONS:
            raise ValueError(
                f"{argument}={precision!r} is not a precision distrib knows: give '32' (full float32), "
                "'bf16-mixed' (autocast to bfloat16) or '16-mixed' (autocast to float16 with a "
                "GradScaler), Lightning's names"
            )
        return cls(name, _PRECISIONS[name])

    @property
    def mixed(self) -> bool:
        """Whether steps run under ``torch.autocast``."""
        return self.dtype is not None

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The context a step's forward pass and loss run in on a ``device_type`` device."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    def grad_scaler(self, device_type: str) -> GradScaler | None:
        """A new ``GradScaler`` for float16 training on ``device_type``; None where no scaling applies."""
        return GradScaler(device_type) if self.dtype is torch.float16 else None

    def slow_here(self, device_type: str, slowdown: SlowdownProbe | None = None) -> str | None:
        """A note naming the faster choice when this precision is correct but slow on ``device_type``, else None.

        Whether a CPU runs bfloat16 or float16 autocast fast depends on the kernels oneDNN and ATen
        pick on it, so it is measured (:func:`distrib.strategies.speed.measured_slowdown`: 25-80 ms
        of CPU, once per process, only for a mixed precision). The note never recommends a
        precision that is slow here: the other mixed precision if it is not slow, else ``'32'``.
        On CUDA nothing is measured: float16 is fast on every GPU, bfloat16 where
        ``torch.cuda.is_bf16_supported(including_emulation=False)``. Other devices: None.

        ``slowdown(dtype, device_type)`` is the measurement, returning a
        :class:`~distrib.precision.speed.Slowdown` or None; None (the default) is
        ``speed.measured_slowdown``, looked up at each call, so that a test can give the
        outcome here or, for ``ds.fit`` and ``distrib train``, by replacing that function.
        """
        if self.dtype is None:
            return None
        if device_type == "cuda":
            if (
                self.dtype is torch.bfloat16
                and torch.cuda.is_available()
                and not torch.cuda.is_bf16_supported(including_emulation=False)
            ):
                return (
                    "bfloat16 autocast is slow on this GPU (no bfloat16 arithmetic: "
                    "torch.cuda.is_bf16_supported() is False); '16-mixed' is the faster choice here"
                )
            return None
        if device_type != "cpu":
            return None
        slowdown = slowdown or speed.measured_slowdown
        mine = slowdown(self.dtype, device_type)
        if mine is None or not mine.slow:
            return None
        other_dtype = torch.float16 if self.dtype is torch.bfloat16 else torch.bfloat16
        other = slowdown(other_dtype, device_type)
        said = (
            f"{_NAMES[self.dtype]} autocast is slow on this CPU: a small convolution and linear step took "
            f"{mine.ratio:.1f}x its float32 time here"
        )
        if other is not None and not other.slow:
            return (
                f"{said}; '{_MIXED[other_dtype]}' is the faster choice here ({_NAMES[other_dtype]} took "
                f"{other.ratio:.1f}x float32's time)"
            )
        if other is not None:
            said += f", and {_NAMES[other_dtype]} is slow here too ({other.ratio:.1f}x)"
        return f"{said}; '32' (float32) is the faster choice here"


#: what the notes call each autocast dtype, and the mixed precision that uses it
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MIXED = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
#: the measurement :meth:`Precision.slow_here` consults: ``(dtype, device_type) -> Slowdown or None``
SlowdownProbe = Callable[[torch.dtype, str], Slowdown | None]


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: GradScaler | None) -> None:
    """``loss.backward(); optimizer.step()``, through ``scaler`` when one is given (float16): PyTorch's own
    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``. The loops of ``ds.fit`` and
    ``distrib train`` share it."""
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
