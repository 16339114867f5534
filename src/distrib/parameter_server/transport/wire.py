"""The bytes that travel between the coordinator, the workers and the parameter servers.

Every RPC payload is one *message*: a small JSON header describing a structure
(None, bool, int, float, str, bytes, lists, tuples, dicts, dense and sparse
tensors, numpy arrays), followed by the raw bytes of every tensor. A tensor is
sent as its dtype, its shape and its bytes, never pickled, so decoding a message
cannot run code. Layout::

    b"DSW1" | u32 header length | header (UTF-8 JSON) | buffer 0 | buffer 1 | ...

Buffers start at 64-byte offsets so decoded tensors are aligned. Decoding copies
the message once into a ``bytearray`` and every tensor is a view into it.

Structures may also carry *references* (a dataset iterator, a remote value): the
encoder turns objects it does not know into ``{"R": ...}`` through an ``encode_ref``
hook, and the decoder hands them to a ``decode_ref`` hook.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from typing import Any

import torch

from distrib.tensor_bytes import byte_view

__all__ = ["encode", "decode", "WireError", "DTYPES"]

_MAGIC = b"DSW1"
_ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_NAMES = {d: name for name, d in DTYPES.items()}

EncodeRef = Callable[[Any], Any]
DecodeRef = Callable[[Any], Any]


class WireError(TypeError):
    """A value cannot be sent (unsupported type) or a message is malformed."""


class _Encoder:
    def __init__(self, encode_ref: EncodeRef | None) -> None:
        self.buffers: list[memoryview] = []
        self.encode_ref = encode_ref

    def buffer(self, data: memoryview) -> int:
        self.buffers.append(data)
        return len(self.buffers) - 1

    def tensor(self, t: torch.Tensor) -> list:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _NAMES:
            raise WireError(f"cannot send a tensor of dtype {t.dtype}; supported: {', '.join(DTYPES)}")
        return [_NAMES[t.dtype], list(t.shape), self.buffer(byte_view(t))]

    def node(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x if x == x and x not in (float("inf"), float("-inf")) else {"F": repr(x)}
        if isinstance(x, torch.Tensor):
            if x.layout == torch.sparse_coo:
                x = x.coalesce()
                return {"S": [self.tensor(x.indices()), self.tensor(x.values()), list(x.shape)]}
            if x.layout != torch.strided:
                raise WireError(f"cannot send a tensor with layout {x.layout}")
            return {"X": self.tensor(x)}
        if isinstance(x, list):
            return [self.node(v) for v in x]
        if isinstance(x, tuple):
            return {"T": [self.node(v) for v in x]}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                return {"D": {k: self.node(v) for k, v in x.items()}}
            return {"M": [[self.node(k), self.node(v)] for k, v in x.items()]}
        if isinstance(x, (bytes, bytearray, memoryview)):
            return {"Y": self.buffer(memoryview(x).cast("B"))}
        np = sys.modules.get("numpy")  # a numpy value exists only if the sender imported numpy
        if np is not None and isinstance(x, np.ndarray):
            return {"A": self.tensor(torch.from_numpy(np.ascontiguousarray(x)))}
        if np is not None and isinstance(x, np.generic):
            return self.node(x.item())
        if self.encode_ref is not None:
            ref = self.encode_ref(x)
            if ref is not None:
                return {"R": ref}
        raise WireError(
            f"cannot send a value of type {type(x).__qualname__}: arguments and results of scheduled functions "
            "must be tensors, numpy arrays, numbers, strings, bytes, None, or lists/tuples/dicts of them"
        )


def encode(obj: Any, encode_ref: EncodeRef | None = None) -> bytes:
    """One message holding ``obj``; tensors travel as raw bytes plus dtype and shape."""
    enc = _Encoder(encode_ref)
    root = enc.node(obj)
    offsets, sizes, position = [], [], 0
    for b in enc.buffers:
        position = -(-position // _ALIGN) * _ALIGN
        offsets.append(position)
        sizes.append(b.nbytes)
        position += b.nbytes
    header = json.dumps({"v": root, "o": offsets, "n": sizes}, separators=(",", ":")).encode()
    start = len(_MAGIC) + 4 + len(header)
    pad = -start % _ALIGN
    header += b" " * pad  # JSON ignores trailing spaces; keeps buffer 0 aligned
    out = bytearray(start + pad + position)
    out[:4] = _MAGIC
    out[4:8] = struct.pack("<I", len(header))
    out[8 : 8 + len(header)] = header
    base = 8 + len(header)
    for off, b in zip(offsets, enc.buffers):
        out[base + off : base + off + b.nbytes] = b
    return bytes(out)


_MAX_DEPTH = 64
_FLOATS = {"nan", "inf", "-inf"}


def _int(x: Any, what: str, low: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise WireError(f"malformed message: {what} must be an int >= {low}, got {x!r}")
    return x


class _Decoder:
    """Rebuilds a structure from a header, checking every field before it is used.

    Every tensor is checked against its buffer (dtype known, shape of non-negative ints
    whose product times the item size is exactly the buffer's length, buffer inside the
    message); sparse tensors are built with torch's invariant checks on (indices inside
    the shape, ``int64``, consistent with the values) and then coalesced. Anything else
    is a :class:`WireError`, never a crash or an out-of-bounds read.
    """

    def __init__(self, data: bytearray, base: int, offsets: list, sizes: list, decode_ref: DecodeRef | None) -> None:
        self.data, self.base, self.offsets, self.sizes = data, base, offsets, sizes
        self.decode_ref = decode_ref

    def _buffer(self, index: Any) -> tuple[int, int]:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.sizes):
            raise WireError(f"malformed message: buffer index {index!r} (the message has {len(self.sizes)})")
        return self.base + self.offsets[index], self.sizes[index]

    def tensor(self, spec: Any) -> torch.Tensor:
        if not isinstance(spec, list) or len(spec) != 3:
            raise WireError(f"malformed message: a tensor is [dtype, shape, buffer], got {spec!r:.100}")
        name, shape, index = spec
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise WireError(f"message holds a tensor of unknown dtype {name!r:.40}; supported: {', '.join(DTYPES)}")
        if not isinstance(shape, list) or len(shape) > 32:
            raise WireError(f"malformed message: a tensor shape must be a list of at most 32 ints, got {shape!r:.100}")
        count = 1
        for s in shape:
            count *= _int(s, "a tensor dimension")
        offset, size = self._buffer(index)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if size != count * itemsize:
            raise WireError(f"tensor buffer holds {size} bytes; shape {shape} of {name} needs {count * itemsize}")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.data, dtype=dtype, count=count, offset=offset).reshape(shape)

    def sparse(self, v: Any) -> torch.Tensor:
        if not isinstance(v, list) or len(v) != 3 or not isinstance(v[2], list):
            raise WireError("malformed message: a sparse tensor is [indices, values, size]")
        indices, values = self.tensor(v[0]), self.tensor(v[1])
        size = [_int(s, "a sparse tensor dimension") for s in v[2]]
        if indices.dtype != torch.int64 or indices.dim() != 2 or not 1 <= indices.shape[0] <= len(size):
            raise WireError(
                f"malformed sparse tensor: indices must be int64 of shape (sparse dims, nnz), got "
                f"{indices.dtype} {tuple(indices.shape)} for size {size}"
            )
        if (
            values.dim() < 1
            or values.shape[0] != indices.shape[1]
            or list(values.shape[1:]) != size[indices.shape[0] :]
        ):
            raise WireError(
                f"malformed sparse tensor: values of shape {tuple(values.shape)} do not match "
                f"{indices.shape[1]} indices into size {size}"
            )
        try:
            with torch.sparse.check_sparse_tensor_invariants(enable=True):
                t = torch.sparse_coo_tensor(indices, values, size, check_invariants=True)
        except RuntimeError as e:
            raise WireError(f"malformed sparse tensor: {e}") from None
        return t.coalesce()

    def node(self, x: Any, depth: int = 0) -> Any:
        if not isinstance(x, (dict, list)):
            return x
        if depth > _MAX_DEPTH:
            raise WireError(f"malformed message: nested deeper than {_MAX_DEPTH} levels")
        if isinstance(x, list):
            return [self.node(v, depth + 1) for v in x]
        if len(x) != 1:
            raise WireError(f"malformed message: a tagged node has one key, got {sorted(x)[:5]}")
        ((tag, v),) = x.items()
        if tag == "X":
            return self.tensor(v)
        if tag in ("T", "M") and not isinstance(v, list):
            raise WireError(f"malformed message: node {tag!r} needs a list")
        if tag == "T":
            return tuple(self.node(e, depth + 1) for e in v)
        if tag == "D":
            if not isinstance(v, dict):
                raise WireError("malformed message: node 'D' needs an object")
            return {k: self.node(e, depth + 1) for k, e in v.items()}
        if tag == "M":
            if not all(isinstance(kv, list) and len(kv) == 2 for kv in v):
                raise WireError("malformed message: node 'M' needs [key, value] pairs")
            out = {}
            for k, e in v:
                key = self.node(k, depth + 1)
                try:
                    out[key] = self.node(e, depth + 1)
                except TypeError:  # an unhashable key
                    raise WireError(f"malformed message: unhashable dict key of type {type(key).__name__}") from None
            return out
        if tag == "Y":
            off, size = self._buffer(v)
            return bytes(self.data[off : off + size])
        if tag == "S":
            return self.sparse(v)
        if tag == "A":
            try:
                return self.tensor(v).numpy()
            except RuntimeError as e:  # torch without numpy: "Numpy is not available"
                raise WireError(
                    f"message holds a numpy array but numpy cannot be used here ({e}); "
                    "pip install numpy on this task, or send torch tensors"
                ) from None
        if tag == "F":
            if v not in _FLOATS:
                raise WireError(f"malformed message: special float {v!r:.20}")
            return float(v)
        if tag == "R":
            if self.decode_ref is None:
                raise WireError("message holds a reference but the receiver accepts none")
            return self.decode_ref(v)
        raise WireError(f"message holds an unknown node tag {tag!r:.20}")


def decode(data: bytes, decode_ref: DecodeRef | None = None) -> Any:
    """The structure held by a message made by :func:`encode`; :class:`WireError` if it is malformed.

    Example::

        >>> decode(encode({"x": torch.arange(3)}))
        {'x': tensor([0, 1, 2])}
        >>> decode(b"DSW1" + bytes(8))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        distrib.parameter_server.transport.wire.WireError: malformed message header: ...
    """
    if len(data) < 8 or data[:4] != _MAGIC:
        raise WireError("not a distrib wire message (bad magic)")
    (length,) = struct.unpack("<I", data[4:8])
    if length > len(data) - 8:
        raise WireError(f"malformed message: header of {length} bytes in a message of {len(data)}")
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
    except (ValueError, RecursionError) as e:
        raise WireError(f"malformed message header: {str(e)[:200]}") from None
    if not isinstance(header, dict) or not {"v", "o", "n"} <= set(header):
        raise WireError("malformed message header: it must hold 'v', 'o' and 'n'")
    offsets, sizes = header["o"], header["n"]
    if not isinstance(offsets, list) or not isinstance(sizes, list) or len(offsets) != len(sizes):
        raise WireError("malformed message header: 'o' and 'n' must be lists of the same length")
    base = 8 + length
    for off, size in zip(offsets, sizes):
        if base + _int(off, "a buffer offset") + _int(size, "a buffer size") > len(data):
            raise WireError(
                f"malformed message: buffer [{off}, {off}+{size}) lies outside the "
                f"{len(data) - base} bytes after the header"
            )
    buf = bytearray(data)
    try:
        return _Decoder(buf, base, offsets, sizes, decode_ref).node(header["v"])
    except RecursionError:
        raise WireError("malformed message: nested too deeply") from None
