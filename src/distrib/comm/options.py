"""``CommunicationOptions``: how workers talk (``tf.distribute.experimental.CommunicationOptions``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

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

    ``bytes_per_pack``: gradient bucket size for the all-reduce overlapped with the
    backward pass (0: 25 MiB, DDP's default). ``timeout_seconds``: how long any
    collective may wait for a peer before it fails (None: 300 s); a dead or hung
    worker becomes an error on every survivor within this time. ``implementation``:
    ``"auto"`` (NCCL on GPU, gloo on CPU), ``"ring"``/``"gloo"``, or ``"nccl"`` (or TF's
    :class:`CommunicationImplementation`).

    Example::

        >>> CommunicationOptions(timeout_seconds=30).timeout
        30.0
    """

    bytes_per_pack: int = 0
    timeout_seconds: Optional[float] = None
    implementation: "str | CommunicationImplementation" = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.implementation, CommunicationImplementation):
            object.__setattr__(self, "implementation", self.implementation.value)
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive or None, got {self.timeout_seconds}")
        if self.implementation.lower() not in ("auto", "ring", "gloo", "nccl"):
            raise ValueError(f"implementation must be 'auto', 'ring', 'gloo' or 'nccl', got {self.implementation!r}")

    @property
    def timeout(self) -> float:
        """The timeout in seconds that applies (the default when ``timeout_seconds`` is None)."""
        return float(self.timeout_seconds) if self.timeout_seconds is not None else DEFAULT_TIMEOUT_SECONDS

    @property
    def bucket_bytes(self) -> int:
        """The gradient bucket size in bytes that applies."""
        return self.bytes_per_pack or DEFAULT_BYTES_PER_PACK

    def backend(self, uses_cuda: bool) -> str:
        """The ``torch.distributed`` backend for these options: ``"nccl"`` or ``"gloo"``."""
        impl = self.implementation.lower()
        if impl == "nccl" or (impl == "auto" and uses_cuda):
            return "nccl"
        return "gloo"
