"""``CommunicationOptions``: how workers talk (``tf.distribute.experimental.CommunicationOptions``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from distrib.comm.hooks import CommHook
from distrib.comm.powersgd import PowerSGD

__all__ = ["CommunicationImplementation", "CommunicationOptions", "DEFAULT_TIMEOUT_SECONDS", "DEFAULT_BYTES_PER_PACK"]

DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_BYTES_PER_PACK = 25 << 20  # DDP's default bucket size


class CommunicationImplementation(str, enum.Enum):
    """TF's ``tf.distribute.experimental.CommunicationImplementation``; the same as the strings."""

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


@dataclass(frozen=True)
class CommunicationOptions:
    """How workers talk (``tf.distribute.experimental.CommunicationOptions``).

    Give it to ``MultiWorkerMirroredStrategy(communication_options=...)`` (and the strategies built on it:
    ``ShardedStrategy``, ``MeshStrategy``). ``compression`` is distrib's addition (TF has none): every
    compressed result is (an approximation of) the sum over workers, as without it. :meth:`comm_hook` makes
    the hook the strategy reduces gradients with.

    Attributes:
        bytes_per_pack: gradient bucket size, in bytes, of the all-reduce across workers (0: 25 MiB, DDP's
            default), overlapped with the backward pass or, with several local replicas, after their gradients
            are summed: both bucket alike.
        timeout_seconds: how long any collective may wait for a peer before it fails (None: 300 s); a dead or
            hung worker becomes an error on every survivor within this time.
        implementation: ``"auto"`` (NCCL on GPU, gloo on CPU), ``"ring"``/``"gloo"``, or ``"nccl"`` (any
            case, or TF's :class:`CommunicationImplementation`); stored lower-cased.
        compression: how gradients travel between workers. None: float32, exact. ``"bf16"`` / ``"fp16"``:
            each bucket is cast to 16 bits for the all-reduce and back (half the bytes; see
            :mod:`distrib.comm.compression` for rounding and fp16's range). ``PowerSGD(rank=...,
            start_iter=...)``: a low-rank approximation of each gradient matrix with error feedback, after
            ``start_iter`` exact steps (see :mod:`distrib.comm.powersgd`).

    Raises:
        ValueError: ``bytes_per_pack`` is negative, ``timeout_seconds`` is not positive, ``implementation`` is
            not one of the names above, or ``compression`` is not None, ``"fp16"``, ``"bf16"`` or a
            ``PowerSGD`` instance (the message says what was meant, e.g. ``"bfloat16"`` -> ``"bf16"``).

    Example::

        >>> CommunicationOptions(timeout_seconds=30).timeout
        30.0
        >>> CommunicationOptions(compression="bf16").comm_hook()
        CastHook('bf16')
        >>> CommunicationOptions(implementation="NCCL").implementation
        'nccl'
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: str | CommunicationImplementation = "auto"
    compression: None | str | PowerSGD = None

    def __post_init__(self) -> None:
        if isinstance(self.implementation, CommunicationImplementation):
            object.__setattr__(self, "implementation", self.implementation.value)
        object.__setattr__(self, "compression", _check_compression(self.compression))
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive or None, got {self.timeout_seconds}")
        if self.implementation.lower() not in ("auto", "ring", "gloo", "nccl"):
            raise ValueError(f"implementation must be 'auto', 'ring', 'gloo' or 'nccl', got {self.implementation!r}")
        # one spelling whatever the case given ("NCCL", TF's enum): code that compares it reads what it asked for
        object.__setattr__(self, "implementation", self.implementation.lower())

    @property
    def timeout(self) -> float:
        """The timeout in seconds that applies (the default when ``timeout_seconds`` is None)."""
        return float(self.timeout_seconds) if self.timeout_seconds is not None else DEFAULT_TIMEOUT_SECONDS

    @property
    def bucket_bytes(self) -> int:
        """The gradient bucket size in bytes that applies."""
        return self.bytes_per_pack or DEFAULT_BYTES_PER_PACK

    def comm_hook(self) -> CommHook:
        """A new comm hook for ``compression`` (with its own state): what the strategy reduces gradients with.

        Returns:
            ``allreduce_hook`` (exact sums) without compression, a ``CastHook`` for ``"bf16"`` / ``"fp16"``, or
            a new ``PowerSGDHook`` with empty state for a ``PowerSGD``.
        """
        from distrib.comm.compression import CastHook
        from distrib.comm.hooks import allreduce_hook

        if self.compression is None:
            return allreduce_hook
        if isinstance(self.compression, PowerSGD):
            return self.compression.hook()
        return CastHook(self.compression)

    def backend(self, uses_cuda: bool) -> str:
        """The ``torch.distributed`` backend for these options: ``"nccl"`` or ``"gloo"``.

        Args:
            uses_cuda: whether the workers' tensors are on CUDA devices (``"auto"`` picks NCCL for them).

        Returns:
            ``"nccl"`` for ``implementation="nccl"``, or ``"auto"`` with ``uses_cuda``; else ``"gloo"``.
        """
        impl = self.implementation.lower()
        if impl == "nccl" or (impl == "auto" and uses_cuda):
            return "nccl"
        return "gloo"


def _check_compression(value: object) -> None | str | PowerSGD:
    """``compression`` as stored (``"fp16"``/``"bf16"`` in lower case), or a ValueError that says what is accepted."""
    accepted = "None, 'fp16', 'bf16' or ds.PowerSGD(rank=..., start_iter=...)"
    if value is None or isinstance(value, PowerSGD):
        return value
    if value is PowerSGD:
        raise ValueError(
            f"CommunicationOptions(compression=PowerSGD): pass an instance, e.g. "
            f"compression=ds.PowerSGD(rank=2, start_iter=10); accepted: {accepted}"
        )
    if isinstance(value, str) and value.lower() in ("fp16", "bf16"):
        return value.lower()
    hint = ""
    if isinstance(value, str) and value.lower() in ("float16", "half", "bfloat16"):
        hint = f" (for {value!r} write {'bf16' if value.lower() == 'bfloat16' else 'fp16'!r})"
    raise ValueError(f"CommunicationOptions(compression={value!r}) is not a compression{hint}; accepted: {accepted}")
