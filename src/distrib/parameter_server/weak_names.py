"""Names for coordinator objects that scheduled functions capture by reference (metrics, GradScalers).

A captured metric or scaler travels to a worker as a name; the worker's results come back under
that name and are merged into the object here. The name must stay the same for the same object
(it is part of the function's digest), never be reused for another, and must not keep the object
alive: an object the user dropped is simply skipped.

    >>> class Thing: pass
    >>> names = WeakNames("session/m")
    >>> a, b = Thing(), Thing()
    >>> names.name(a), names.name(b), names.name(a)
    ('session/m0', 'session/m1', 'session/m0')
    >>> names.get("session/m1") is b
    True
    >>> del b
    >>> names.get("session/m1"), [key for key, _ in names.live()]
    (None, ['session/m0'])
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["WeakNames"]


class WeakNames:
    """``prefix`` + a counter for each object named (thread-safe), held by weak reference."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._by_id: dict[int, tuple[weakref.ref, str]] = {}
        self._by_name: dict[str, weakref.ref] = {}
        self._count = 0

    def name(self, obj: Any) -> str:
        """``obj``'s name: the one it was given before, else a new one."""
        with self._lock:
            entry = self._by_id.get(id(obj))
            if entry is not None and entry[0]() is obj:
                return entry[1]
            key = f"{self._prefix}{self._count}"
            self._count += 1
            self._by_id[id(obj)] = (weakref.ref(obj), key)
            self._by_name[key] = weakref.ref(obj)
            return key

    def get(self, key: str) -> Any | None:
        """The object named ``key``; None if there is none, or it was garbage-collected."""
        with self._lock:
            ref = self._by_name.get(key)
        return ref() if ref is not None else None

    def live(self) -> list[tuple[str, Any]]:
        """(name, object) of every object still alive, oldest first; the dead are forgotten."""
        with self._lock:
            pairs = [(key, ref()) for key, ref in self._by_name.items()]
            dead = {key for key, obj in pairs if obj is None}
            if dead:
                self._by_name = {k: r for k, r in self._by_name.items() if k not in dead}
                self._by_id = {i: e for i, e in self._by_id.items() if e[1] not in dead}
            return [(key, obj) for key, obj in pairs if obj is not None]
