"""The one error type of checkpoints, and the timeout of the barrier that follows a save."""

from __future__ import annotations

import math
import os

__all__ = ["CheckpointError", "DEFAULT_CHECKPOINT_TIMEOUT", "TIMEOUT_ENV", "checkpoint_timeout"]

#: Seconds every worker waits at the barrier while the chief alone writes a checkpoint.
DEFAULT_CHECKPOINT_TIMEOUT = 1800.0
#: Environment variable that overrides :data:`DEFAULT_CHECKPOINT_TIMEOUT`.
TIMEOUT_ENV = "DISTRIB_CHECKPOINT_TIMEOUT"


class CheckpointError(ValueError):
    """A checkpoint could not be written or read, is damaged or unsafe, or does not match the tracked objects.

    The message names the file and the cause (the tensor whose checksum fails, the
    missing name, the operating-system error such as "No space left on device").
    """


def checkpoint_timeout(timeout: float | None = None) -> float:
    """Seconds the workers wait for the chief to write a checkpoint.

    ``timeout`` if given, else ``$DISTRIB_CHECKPOINT_TIMEOUT``, else 1800. It is separate
    from ``CommunicationOptions(timeout_seconds=...)``, which bounds collectives: a save
    of a large model may take longer than any collective should.

    Example::

        >>> checkpoint_timeout(60)
        60.0
    """
    source, raw = ("timeout", timeout) if timeout is not None else (TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV))
    if raw is None or raw == "":
        return DEFAULT_CHECKPOINT_TIMEOUT
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{source}={raw!r} must be a positive number of seconds to wait for the chief to write "
            f"a checkpoint (default {DEFAULT_CHECKPOINT_TIMEOUT:.0f})"
        )
    return value
