"""The raw bytes of a CPU tensor without numpy.

``tensor.numpy().data`` is the usual way to see a tensor's memory as bytes, but it makes
numpy (73 MB installed) a dependency of every user for a few checksums and messages. A
ctypes array over the tensor's storage gives the same zero-copy ``memoryview``; the array
holds a reference to the tensor, so the view stays valid as long as it is alive.

>>> import torch
>>> bytes(byte_view(torch.tensor([1, 2], dtype=torch.int16)))
b'\\x01\\x00\\x02\\x00'
>>> len(byte_view(torch.zeros(0)))
0
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["byte_view"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A read-write ``memoryview`` (format ``"B"``) of ``tensor``'s values in row-major order.

    The tensor is detached, moved to the CPU and made contiguous first when it is not already
    (then the view is of that copy). Native byte order, as ``tensor.numpy().tobytes()``.
    """
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    array._owner = flat  # type: ignore[attr-defined]  # keeps the storage alive while the view is
    return memoryview(array).cast("B")
