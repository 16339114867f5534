"""The device of the CUDA checks (``pytest -m cuda tests/cuda``; ``bash scripts/gpu_check.sh`` runs them).

``DISTRIB_CHECK_DEVICE`` names the device type: ``cuda`` (the default; every test skips, saying
why, where CUDA is not available, so the CPU suite stays green and fast) or ``cpu``, which runs the
same tests and code paths on the CPU: ``gpu_check.sh --dry-run`` proves them that way without a GPU.
Every test of this folder is marked ``cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE_ENV = "DISTRIB_CHECK_DEVICE"


def check_device_type() -> str:
    """``cuda`` or ``cpu``, from ``DISTRIB_CHECK_DEVICE``."""
    kind = os.environ.get(DEVICE_ENV, "cuda").strip().lower() or "cuda"
    if kind not in ("cuda", "cpu"):
        raise pytest.UsageError(f"{DEVICE_ENV}={kind!r}: use 'cuda' (the default) or 'cpu' (the dry run)")
    return kind


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The checked device: ``cuda:0``, or ``cpu:0`` under ``DISTRIB_CHECK_DEVICE=cpu``; skips without CUDA."""
    kind = check_device_type()
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"CUDA is not available (torch {torch.__version__}); {DEVICE_ENV}=cpu runs these on the CPU")
    return torch.device(kind, 0)


@pytest.fixture(scope="session")
def other_device(device: torch.device) -> str:
    """A second replica's device beside ``device``: the CPU beside a GPU, a logical ``cpu:1`` on the CPU."""
    return "cpu" if device.type == "cuda" else "cpu:1"


@pytest.fixture(scope="session")
def cuda_only(device: torch.device) -> None:
    """Skips a check that only means something on a GPU (NCCL, pinned memory) in the CPU dry run."""
    if device.type != "cuda":
        pytest.skip("needs a real GPU (NCCL / pinned memory); the CPU dry run cannot run it")
