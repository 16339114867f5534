"""Progress display as Keras users know it.

On a terminal, a bar redrawn in place::

    7/10 [====================>.........] - ETA: 1s - loss: 0.2154 - accuracy: 0.9312

Otherwise (a log file, CI), one line when the epoch ends, as in seed 003::

    10/10 - 3s - loss: 7.4912 - 3s/epoch - 259ms/step
"""

from __future__ import annotations

import sys
import time
from typing import IO, Mapping, Optional

__all__ = ["Progbar", "format_logs"]


def format_logs(logs: Mapping[str, float]) -> str:
    return " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
    if seconds >= 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{seconds:.0f}s"


def _per_step(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.0f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


class Progbar:
    """A progress bar over ``target`` steps (None: unknown). ``verbose``: 0 silent, 1 bar, 2 one line."""

    def __init__(self, target: Optional[int], verbose: int = 1, width: int = 30,
                 stream: Optional[IO[str]] = None, interval: float = 0.05) -> None:
        self.target, self.width, self.interval = target, width, interval
        self.stream = stream or sys.stdout
        if verbose == 1 and not getattr(self.stream, "isatty", lambda: False)():
            verbose = 2
        self.verbose = verbose
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_len = 0

    def update(self, current: int, logs: Optional[Mapping[str, float]] = None, finalize: bool = False) -> None:
        """Show ``current`` steps done; ``finalize`` ends the line."""
        logs = logs or {}
        now = time.monotonic()
        elapsed = now - self._start
        if self.verbose == 1:
            if not finalize and now - self._last_draw < self.interval:
                return
            self._last_draw = now
            line = self._bar(current)
            if finalize:
                line += f" - {_duration(elapsed)} {_per_step(elapsed / max(current, 1))}"
            elif self.target and current:
                line += f" - ETA: {_duration(elapsed / current * (self.target - current))}"
            if logs:
                line += " - " + format_logs(logs)
            pad = max(self._last_len - len(line), 0)
            self.stream.write("\r" + line + " " * pad + ("\n" if finalize else ""))
            self._last_len = len(line)
            self.stream.flush()
        elif self.verbose == 2 and finalize:
            count = f"{current}/{self.target}" if self.target else f"{current}"
            parts = [count, _duration(elapsed)]
            if logs:
                parts.append(format_logs(logs))
            parts += [f"{_duration(elapsed)}/epoch", _per_step(elapsed / max(current, 1))]
            self.stream.write(" - ".join(parts) + "\n")
            self.stream.flush()

    def _bar(self, current: int) -> str:
        if not self.target:
            return f"{current}/Unknown"
        digits = len(str(self.target))
        done = int(self.width * min(current / self.target, 1.0))
        bar = "=" * max(done - 1, 0) + (">" if current < self.target else "=") + "." * (self.width - done)
        return f"{current:>{digits}}/{self.target} [{bar[:self.width]}]"
