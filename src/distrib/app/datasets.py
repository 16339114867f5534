"""Reading Fashion-MNIST (and MNIST) from the original IDX files; no network access.

The default directory is where Debian's package ``dataset-fashion-mnist`` puts the
files. Files may be gzipped (``*.gz``) or not.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import sys
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["DEFAULT_FASHION_MNIST_DIR", "DatasetNotFoundError", "Split", "load_fashion_mnist", "read_idx"]

DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# IDX type codes; every multi-byte type is stored big-endian
_DTYPES: dict[int, torch.dtype] = {
    0x08: torch.uint8,
    0x09: torch.int8,
    0x0B: torch.int16,
    0x0C: torch.int32,
    0x0D: torch.float32,
    0x0E: torch.float64,
}


class DatasetNotFoundError(FileNotFoundError):
    """The IDX files are not where they were looked for."""


class Split(NamedTuple):
    """Images as float32 in [0, 1] with shape (N, 1, 28, 28); labels as int64 (N,)."""

    images: torch.Tensor
    labels: torch.Tensor


def read_idx(path: str | Path) -> torch.Tensor:
    """Read one IDX file (gzipped or not) into a tensor; ValueError if it is malformed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    dtype, ndim = _DTYPES[data[2]], data[3]
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path} is truncated: its header names {ndim} dimensions but ends before their sizes")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = bytearray(data[4 + 4 * ndim :])
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if len(body) != expected:
        raise ValueError(f"{path} is truncated: expected {expected} bytes of data for shape {shape}, found {len(body)}")
    if not body:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(body, dtype=torch.uint8)
    if itemsize > 1 and sys.byteorder == "little":  # big-endian on disk
        raw = raw.view(-1, itemsize).flip(-1).contiguous().view(-1)
    return raw.view(dtype).reshape(shape)


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def load_fashion_mnist(data_dir: str | Path | None = None) -> tuple[Split, Split]:
    """``(train, test)`` splits of Fashion-MNIST (or of MNIST, given its IDX directory).

    Raises :class:`DatasetNotFoundError` naming the directory, the missing files and
    how to get them.
    """
    directory = Path(data_dir or os.environ.get("DISTRIB_DATA_DIR") or DEFAULT_FASHION_MNIST_DIR)
    found = {key: _find(directory, stem) for key, stem in _FILES.items()}
    missing = [stem for key, stem in _FILES.items() if found[key] is None]
    if missing:
        raise DatasetNotFoundError(
            f"Fashion-MNIST IDX files not found in {directory} (missing: {', '.join(m + '[.gz]' for m in missing)}). "
            f"Install Debian's package 'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist, "
            f"which puts them in {DEFAULT_FASHION_MNIST_DIR}), or pass --data-dir DIR naming a directory "
            "that holds the four IDX files."
        )
    arrays = {key: read_idx(path) for key, path in found.items()}  # type: ignore[arg-type]

    def split(prefix: str) -> Split:
        images = arrays[f"{prefix}_images"].to(torch.float32) / 255
        labels = arrays[f"{prefix}_labels"].to(torch.int64)
        if len(images) != len(labels):
            raise ValueError(f"{directory}: {len(images)} {prefix} images but {len(labels)} labels")
        return Split(images.unsqueeze(1), labels)

    return split("train"), split("test")
