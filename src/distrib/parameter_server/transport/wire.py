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
from typing import Any, Callable, Optional

import numpy as np
import torch

__all__ = ["encode", "decode", "WireError", "DTYPES"]

_MAGIC = b"DSW1"
_ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}
_NAMES = {d: name for name, d in DTYPES.items()}

EncodeRef = Callable[[Any], Any]
DecodeRef = Callable[[Any], Any]


class WireError(TypeError):
    """A value cannot be sent (unsupported type) or a message is malformed."""


class _Encoder:
    def __init__(self, encode_ref: Optional[EncodeRef]) -> None:
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
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")
        return [_NAMES[t.dtype], list(t.shape), self.buffer(raw)]

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
        if isinstance(x, np.ndarray):
            return {"A": self.tensor(torch.from_numpy(np.ascontiguousarray(x)))}
        if isinstance(x, np.generic):
            return self.node(x.item())
        if self.encode_ref is not None:
            ref = self.encode_ref(x)
            if ref is not None:
                return {"R": ref}
        raise WireError(
            f"cannot send a value of type {type(x).__qualname__}: arguments and results of scheduled functions "
            "must be tensors, numpy arrays, numbers, strings, bytes, None, or lists/tuples/dicts of them"
        )


def encode(obj: Any, encode_ref: Optional[EncodeRef] = None) -> bytes:
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
    out[8:8 + len(header)] = header
    base = 8 + len(header)
    for off, b in zip(offsets, enc.buffers):
        out[base + off: base + off + b.nbytes] = b
    return bytes(out)


class _Decoder:
    def __init__(self, data: bytearray, base: int, offsets: list, sizes: list, decode_ref: Optional[DecodeRef]) -> None:
        self.data, self.base, self.offsets, self.sizes = data, base, offsets, sizes
        self.decode_ref = decode_ref

    def tensor(self, spec: list) -> torch.Tensor:
        name, shape, index = spec
        dtype = DTYPES.get(name)
        if dtype is None:
            raise WireError(f"message holds a tensor of unknown dtype {name!r}")
        count = 1
        for s in shape:
            count *= int(s)
        size = self.sizes[index]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if size != count * itemsize:
            raise WireError(f"tensor buffer holds {size} bytes; shape {shape} of {name} needs {count * itemsize}")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.data, dtype=dtype, count=count, offset=self.base + self.offsets[index]).reshape(shape)

    def node(self, x: Any) -> Any:
        if not isinstance(x, (dict, list)):
            return x
        if isinstance(x, list):
            return [self.node(v) for v in x]
        (tag, v), = x.items()
        if tag == "X":
            return self.tensor(v)
        if tag == "T":
            return tuple(self.node(e) for e in v)
        if tag == "D":
            return {k: self.node(e) for k, e in v.items()}
        if tag == "M":
            return {self.node(k): self.node(e) for k, e in v}
        if tag == "Y":
            off = self.base + self.offsets[v]
            return bytes(self.data[off: off + self.sizes[v]])
        if tag == "S":
            indices, values = self.tensor(v[0]), self.tensor(v[1])
            return torch.sparse_coo_tensor(indices, values, v[2], check_invariants=False, is_coalesced=True)
        if tag == "A":
            return self.tensor(v).numpy()
        if tag == "F":
            return float(v)
        if tag == "R":
            if self.decode_ref is None:
                raise WireError("message holds a reference but the receiver accepts none")
            return self.decode_ref(v)
        raise WireError(f"message holds an unknown node tag {tag!r}")


def decode(data: bytes, decode_ref: Optional[DecodeRef] = None) -> Any:
    """The structure held by a message made by :func:`encode`."""
    if len(data) < 8 or data[:4] != _MAGIC:
        raise WireError("not a distrib wire message (bad magic)")
    (length,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(bytes(data[8:8 + length]))
    except ValueError as e:
        raise WireError(f"malformed message header: {e}") from None
    buf = bytearray(data)
    return _Decoder(buf, 8 + length, header["o"], header["n"], decode_ref).node(header["v"])
