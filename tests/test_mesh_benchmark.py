"""benchmarks/mesh_memory_speed.py's formulas, checked in one process (fast: no workers are launched).

The activation formula that docs/mesh.md sets beside the measured activations must be what autograd really
saves in a forward pass of the benchmark's decoder (counted by ``saved_tensors_hooks``, each storage once,
parameters left out), to the byte, at sizes where every term shows; and the parameter counts the expected
memory rests on must be the model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _config(dim: int, layers: int, heads: int, vocab: int, seq: int) -> argparse.Namespace:
    return argparse.Namespace(dim=dim, layers=layers, heads=heads, vocab=vocab, long_seq=seq, batch=1, seq=seq)


@pytest.mark.parametrize(
    ("dim", "layers", "heads", "vocab", "batch", "seq"), [(64, 2, 4, 64, 2, 32), (48, 3, 4, 40, 3, 16)]
)
def test_the_activation_formula_is_what_autograd_saves(
    dim: int, layers: int, heads: int, vocab: int, batch: int, seq: int
) -> None:
    from mesh_memory_speed import activation_bytes, build, forward_activations

    args = _config(dim, layers, heads, vocab, seq)
    model = build(args)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
    got = forward_activations(model, lambda fn, a, b: fn(a, b), x, y)
    assert got["saved_bytes"] == activation_bytes(args, batch, seq, tp=1)


def test_the_parameter_counts_are_the_models() -> None:
    from mesh_memory_speed import TP_LINEARS, build, count_params, layout_map

    from distrib.experimental import DeviceMesh

    args = _config(64, 2, 4, 64, 32)
    counts = count_params(args)
    model = build(args)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["block"] == sum(p.numel() for p in model.blocks[0].parameters())
    # the split parameters of a block: what the layout map names, with the Colwise layers' biases
    layouts = layout_map(DeviceMesh((2, 2), ("batch", "model")))
    named = dict(model.blocks[0].named_parameters())
    split = sum(p.numel() for n, p in named.items() if layouts.key_for(f"blocks.0.{n}") is not None)
    split += sum(named[f"{n}.bias"].numel() for n, s in TP_LINEARS.items() if s == "colwise" and f"{n}.bias" in named)
    assert counts["block_split"] == split
    assert layouts.key_for("tok.weight") is not None and layouts.key_for("head.weight") is None
