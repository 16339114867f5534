"""Sending a scheduled function, with its closure, to the workers once.

The coordinator pickles the function with cloudpickle (by value when it is defined
in ``__main__`` or in a module registered with ``cloudpickle.register_pickle_by_value``,
by reference otherwise). Objects that must not be copied become *persistent ids*:

* a parameter placed on the ps tasks travels as its :class:`VariableSpec` (the worker
  binds it to its own local copy, kept fresh from the ps tasks);
* an optimizer built under the strategy's scope travels as its id and its groups;
  on the worker it becomes a proxy whose ``step()`` sends gradients to the ps tasks;
* the strategy becomes the worker's own strategy object;
* any other tensor travels as raw bytes beside the pickle, never pickled.

The result, a :mod:`wire` message holding the pickle and the tensors, is identified
by its SHA-256 digest; each worker keeps the functions it has seen by digest, so a
function is sent to a worker once, not with every call.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional

import cloudpickle
import torch

from distrib.parameter_server.transport import wire

__all__ = ["Payload", "dumps", "loads"]

Resolver = Callable[[Any], Optional[tuple]]


@dataclass(frozen=True)
class Payload:
    """A pickled function (or dataset function) ready to send, and its digest."""

    data: bytes
    digest: str


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, resolve: Resolver) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._resolve = resolve
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Optional[tuple]:  # noqa: D401 - pickle protocol
        if isinstance(obj, (type, int, float, str, bytes, tuple, list, dict)) or obj is None:
            return None
        pid = self._resolve(obj)
        if pid is not None:
            return pid
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj.detach())
            return ("t", len(self.tensors) - 1, isinstance(obj, torch.nn.Parameter), bool(obj.requires_grad))
        return None


def dumps(obj: Any, resolve: Resolver) -> Payload:
    """Pickle ``obj`` for a worker; ``resolve(x)`` gives the persistent id of shared objects (or None)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, resolve)
    pickler.dump(obj)
    data = wire.encode({"pickle": buf.getvalue(), "tensors": pickler.tensors})
    return Payload(data, hashlib.sha256(data).hexdigest()[:40])


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor], resolve: Callable[[tuple], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors
        self._resolve = resolve

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "t":
            _, index, is_param, requires_grad = pid
            t = self._tensors[index]
            if is_param:
                return torch.nn.Parameter(t, requires_grad=requires_grad)
            return t.requires_grad_(requires_grad) if requires_grad else t
        return self._resolve(pid)


def loads(data: bytes, resolve: Callable[[tuple], Any]) -> Any:
    """Unpickle a :class:`Payload`'s data on a worker (only ever for an authenticated peer)."""
    message = wire.decode(data)
    return _Unpickler(message["pickle"], message["tensors"], resolve).load()
