"""Progress display: one component, :class:`Progbar`, for ``fit`` and for ``distrib train``'s custom loop.

On a terminal, a bar redrawn in place::

    7/10 [====================>.........] - ETA: 1s - loss: 0.2154 - accuracy: 0.9312

Otherwise (a pipe: a log file, CI, the workers of ``distrib launch``), a bar *line* every
``line_interval`` seconds (10 s by default, or ``DISTRIB_PROGRESS_INTERVAL``), so a long epoch is
never silent, and one line when the epoch ends, as in TF's multi-worker migration guide::

    10/10 - 3s - loss: 7.4912 - 3s/epoch - 259ms/step

Keras writes a new line every 0.05 s on a pipe; one line every 10 s keeps logs readable.

``style="tqdm"`` draws the same progress as TF's custom-training tutorial shows it, a tqdm bar
(``epoch 1/10:  40%|####      | 375/938 [00:12<00:18, ..., loss=0.5082, accuracy=81.54]``),
on the same terms: redrawn in place on a terminal, a line every ``line_interval`` seconds
on a pipe, nothing when ``verbose`` is 0.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

__all__ = ["Progbar", "format_logs", "LINE_INTERVAL", "line_interval", "data_length"]

#: seconds between two progress lines when the output is not a terminal (``DISTRIB_PROGRESS_INTERVAL`` overrides it)
LINE_INTERVAL = 10.0


def line_interval() -> float:
    """Seconds between two progress lines on a pipe: ``DISTRIB_PROGRESS_INTERVAL``, else :data:`LINE_INTERVAL`."""
    text = os.environ.get("DISTRIB_PROGRESS_INTERVAL", "")
    if not text:
        return LINE_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"DISTRIB_PROGRESS_INTERVAL={text!r}: give the seconds between two progress lines "
            f"(a number, 0 or more; unset: {LINE_INTERVAL:g})"
        )
    return value


def data_length(data: Any) -> int | None:
    """``len(data)``, the steps of a progress bar, or None when ``data`` has no length (an iterator, a function)."""
    try:
        return len(data)
    except TypeError:
        return None


_env_interval = line_interval  # Progbar's argument of the same name hides the function


def format_logs(logs: Mapping[str, float]) -> str:
    """``loss: 0.2154 - accuracy: 0.9312``: four decimals, as Keras prints them."""
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


class _NullStream:
    """Where tqdm draws on a pipe: nowhere (:class:`Progbar` writes its lines itself, every ``line_interval``)."""

    def write(self, text: str) -> None: ...

    def flush(self) -> None: ...


class Progbar:
    """A progress bar over ``target`` steps (None: unknown). ``verbose``: 0 silent, 1 bar, 2 one line per epoch.

    ``verbose=1`` redraws the bar in place on a terminal; on anything else it writes the bar
    as a new line every ``line_interval`` seconds, then the one-line summary of ``verbose=2``.
    ``style="tqdm"`` (``verbose`` 0 or 1) draws tqdm's bar instead, titled ``desc``, with the
    logs beside it as ``postfix(logs)`` gives them (four decimals by default); on a terminal it
    is cleared when the epoch ends (``finalize``), where the loop prints its own epoch line.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = Progbar(4, verbose=2, stream=out)
    >>> for step in range(1, 5):
    ...     bar.update(step, {"loss": 1.0 / step}, finalize=step == 4)
    >>> out.getvalue().startswith("4/4 - 0s - loss: 0.2500 - ")
    True
    """

    def __init__(
        self,
        target: int | None,
        verbose: int = 1,
        width: int = 30,
        stream: IO[str] | None = None,
        interval: float = 0.05,
        line_interval: float | None = None,
        style: str = "keras",
        desc: str = "",
        postfix: Callable[[Mapping[str, float]], Mapping[str, str]] | None = None,
    ) -> None:
        if style not in ("keras", "tqdm"):
            raise ValueError(f"Progbar(style={style!r}): expected 'keras' or 'tqdm'")
        self.target, self.width, self.interval = target, width, interval
        self.line_interval = _env_interval() if line_interval is None else line_interval
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.dynamic = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_line = self._start
        self._last_len = 0
        self._postfix = postfix or (lambda logs: {k: f"{v:.4f}" for k, v in logs.items()})
        self._tqdm: Any = None
        if style == "tqdm" and verbose:
            from tqdm import tqdm

            if self.dynamic:  # on stderr, as tqdm's own bars; cleared at the end (leave=False)
                self._tqdm = tqdm(total=target, desc=desc, leave=False, unit="batch", dynamic_ncols=True)
            else:
                self._tqdm = tqdm(
                    total=target,
                    desc=desc,
                    unit="batch",
                    file=_NullStream(),
                    ascii=True,
                    ncols=100,
                    mininterval=self.line_interval,
                )

    def update(self, current: int, logs: Mapping[str, float] | None = None, finalize: bool = False) -> None:
        """Show ``current`` steps done; ``finalize`` ends the line."""
        logs = logs or {}
        now = time.monotonic()
        elapsed = now - self._start
        if self._tqdm is not None:
            self._update_tqdm(current, logs, finalize, now)
            return
        if self.verbose == 1 and self.dynamic:
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
            excess = len(line) - (_columns(self.stream) - 1)
            if excess > 0 and self.target:  # a narrower bar rather than a line the terminal wraps
                narrow = self._bar(current, max(self.width - excess, 10))
                line = narrow + line[len(self._bar(current)) :]
            pad = max(self._last_len - len(line), 0)
            self.stream.write("\r" + line + " " * pad + ("\n" if finalize else ""))
            self._last_len = len(line)
            self.stream.flush()
        elif self.verbose == 1 and not finalize:  # a pipe: a bar line now and then
            if now - self._last_line < self.line_interval:
                return
            self._last_line = now
            line = self._bar(current)
            if self.target and current:
                line += f" - ETA: {_duration(elapsed / current * (self.target - current))}"
            if logs:
                line += " - " + format_logs(logs)
            self.stream.write(line + "\n")
            self.stream.flush()
        elif self.verbose in (1, 2) and finalize:
            count = f"{current}/{self.target}" if self.target else f"{current}"
            parts = [count, _duration(elapsed)]
            if logs:
                parts.append(format_logs(logs))
            parts += [f"{_duration(elapsed)}/epoch", _per_step(elapsed / max(current, 1))]
            self.stream.write(" - ".join(parts) + "\n")
            self.stream.flush()

    def _update_tqdm(self, current: int, logs: Mapping[str, float], finalize: bool, now: float) -> None:
        if logs:
            self._tqdm.set_postfix(self._postfix(logs), refresh=False)
        if current > self._tqdm.n:
            self._tqdm.update(current - self._tqdm.n)
        if not self.dynamic and not finalize and now - self._last_line >= self.line_interval:
            self._last_line = now
            self.stream.write(str(self._tqdm) + "\n")
            self.stream.flush()
        if finalize:
            self._tqdm.close()

    def _bar(self, current: int, width: int | None = None) -> str:
        width = width or self.width
        if not self.target:
            return f"{current}/Unknown"
        digits = len(str(self.target))
        done = int(width * min(current / self.target, 1.0))
        bar = "=" * max(done - 1, 0) + (">" if current < self.target else "=") + "." * (width - done)
        return f"{current:>{digits}}/{self.target} [{bar[:width]}]"


def _columns(stream: IO[str]) -> int:
    """The terminal's width: the stream's own, else ``COLUMNS`` or stdout's (80 when nothing says)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size().columns
