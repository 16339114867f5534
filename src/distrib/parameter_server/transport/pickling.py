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

Every code object pickled by value keeps its own file name (``co_filename``), so that
a worker's traceback of a failed scheduled function names the user's file and source
line with any cloudpickle (see :func:`_reduce_code`).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import types
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch

from distrib.parameter_server.transport import wire

__all__ = ["Payload", "dumps", "loads"]

Resolver = Callable[[Any], tuple | None]


@dataclass(frozen=True)
class Payload:
    """A pickled function (or dataset function) ready to send, and its digest."""

    data: bytes
    digest: str


def _reduce_code(code: types.CodeType) -> tuple:
    """cloudpickle's reduction of a code object, plus the code's real ``co_filename``.

    Why: cloudpickle 3.1.3+ (cloudpipe/cloudpickle#560, for payloads that do not depend
    on where a function was defined) pickles every code object with ``co_filename`` set
    to ``"<dynamic-code>"``. A worker's traceback of a failed scheduled function then reads
    ``File "<dynamic-code>", line 96, in fn``: no user file, and ``linecache`` finds no
    source line. Restoring the name here, on the pickling side, is the robust place: it
    covers every code object that travels by value (the scheduled function, the helpers
    and lambdas it calls, methods of classes defined in ``__main__``, nested code in
    ``co_consts``, dataset functions), the worker's Python then formats its own traceback
    as usual (file, line, source line from ``linecache``, 3.11's position carets), and no
    formatted text is parsed back on the coordinator. It keeps cloudpickle's own reduction
    (whatever its constructor arguments are in a given version) and only replaces one
    field after construction, so it holds for older cloudpickles (which keep the name
    anyway) and newer ones alike. The price is what cloudpickle < 3.1.3 always paid: the
    payload, and so its digest, depends on the file name of the function.
    """
    reduced = cloudpickle.CloudPickler.dispatch_table[types.CodeType](code)
    return _code_in_file, (reduced[0], reduced[1], code.co_filename)


def _code_in_file(constructor: Callable[..., types.CodeType], args: tuple, filename: str) -> types.CodeType:
    """Rebuild a code object as cloudpickle does, then give it back its file name (see :func:`_reduce_code`)."""
    code = constructor(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


class _Pickler(cloudpickle.CloudPickler):
    # A class attribute: the C pickler reads ``dispatch_table`` once, in ``__init__``.
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.CloudPickler.dispatch_table)

    def __init__(self, file: io.BytesIO, resolve: Resolver) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._resolve = resolve
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> tuple | None:  # noqa: D401 - pickle protocol
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
    def __init__(
        self,
        data: bytes,
        tensors: list[torch.Tensor],
        resolve: Callable[[tuple], Any],
        device: torch.device | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors
        self._resolve = resolve
        self._device = device

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "t":
            _, index, is_param, requires_grad = pid
            t = self._tensors[index]
            if self._device is not None and self._device.type != "cpu":
                t = t.to(self._device)
            if is_param:
                return torch.nn.Parameter(t, requires_grad=requires_grad)
            return t.requires_grad_(requires_grad) if requires_grad else t
        return self._resolve(pid)


def loads(data: bytes, resolve: Callable[[tuple], Any], device: torch.device | None = None) -> Any:
    """Unpickle a :class:`Payload`'s data on a worker (only ever for an authenticated peer).

    Tensors that travelled by value (a module's buffers, captured constants) land on ``device``
    (the worker's, when it computes on a GPU); shared objects are what ``resolve`` gives.
    """
    message = wire.decode(data)
    return _Unpickler(message["pickle"], message["tensors"], resolve, device).load()
