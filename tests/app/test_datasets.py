"""The IDX reader without numpy: every IDX type, byte order, and the real Fashion-MNIST."""

import gzip
import struct
from pathlib import Path

import pytest
import torch

from distrib.app.datasets import DEFAULT_FASHION_MNIST_DIR, load_fashion_mnist, read_idx


def _idx(path: Path, code: int, fmt: str, shape: tuple[int, ...], values: list) -> Path:
    header = bytes([0, 0, code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)
    path.write_bytes(header + struct.pack(f">{len(values)}{fmt}", *values))
    return path


@pytest.mark.parametrize(
    "code, fmt, dtype, values",
    [
        (0x08, "B", torch.uint8, [1, 2, 3, 200, 0, 255]),
        (0x09, "b", torch.int8, [1, -2, 3, 100, 0, -128]),
        (0x0B, "h", torch.int16, [1, -2, 3, 1000, 0, -32768]),
        (0x0C, "i", torch.int32, [1, -2, 3, 70000, 0, 2**31 - 1]),
        (0x0D, "f", torch.float32, [1.0, -2.5, 3.0, 0.125, 0.0, 2.0**100]),
        (0x0E, "d", torch.float64, [1.0, -2.5, 3.0, 0.1, 0.0, 1e300]),
    ],
)
def test_every_idx_type_reads_big_endian_values(tmp_path, code, fmt, dtype, values):
    got = read_idx(_idx(tmp_path / "x", code, fmt, (2, 3), values))
    assert got.dtype == dtype and got.shape == (2, 3)
    assert got.reshape(-1).tolist() == values


def test_a_header_cut_inside_the_dimensions_is_refused(tmp_path):
    path = tmp_path / "cut"
    path.write_bytes(bytes([0, 0, 0x08, 3]) + struct.pack(">I", 5))
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)


def test_gzipped_files_read_the_same(tmp_path):
    plain = _idx(tmp_path / "p", 0x0C, "i", (4,), [1, 2, 3, 4])
    zipped = tmp_path / "p.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert torch.equal(read_idx(plain), read_idx(zipped))


@pytest.mark.skipif(
    not Path(DEFAULT_FASHION_MNIST_DIR, "train-labels-idx1-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed (scripts/setup.sh installs it as root)",
)
def test_the_real_fashion_mnist_loads_with_its_known_first_labels():
    train, test = load_fashion_mnist()
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.images.dtype == torch.float32 and 0 <= train.images.min() and train.images.max() <= 1
    # the first training images are an ankle boot, a T-shirt, a T-shirt, a dress (Zalando's README)
    assert train.labels[:4].tolist() == [9, 0, 0, 3]
    assert torch.bincount(train.labels).tolist() == [6000] * 10
