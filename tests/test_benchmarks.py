"""The figures docs/performance.md derives from benchmarks/flop_ceiling.py rest on a FLOP count that is checked here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_main_job_step_has_the_flops_its_layers_imply():
    from flop_ceiling import step_flops

    flops = step_flops()
    conv1 = 2 * 64 * 32 * 26 * 26 * 9  # batch 64, 1 -> 32 channels, 3x3, 26x26 outputs
    conv2 = 2 * 64 * 64 * 11 * 11 * 32 * 9  # 32 -> 64 channels, 11x11 outputs
    dense1, dense2 = 2 * 64 * 1600 * 64, 2 * 64 * 64 * 10
    assert flops["convolution"] == conv1 + conv2
    # backward: conv 2's input and weight gradients, conv 1's weight gradient only (its input needs none)
    assert flops["convolution_backward"] == 2 * conv2 + conv1
    assert flops["addmm"] == dense1 + dense2
    assert flops["mm"] == 2 * (dense1 + dense2)
    assert sum(flops.values()) == pytest.approx(945.8e6, rel=1e-4)
