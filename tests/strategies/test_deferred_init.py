"""Deferred initialisation under ``ds.ShardedStrategy`` (strategies/deferred_record.py, deferred_materialise.py).

* One process: the recorder against a plain build with the same seed, bit for bit, for torch.nn layers
  and user modules with custom init, weight tying, buffers, a data-dependent init (``trunc_normal_``'s
  rejection loop), ``orthogonal_`` (QR, in-place transposes), ``nn.TransformerEncoder``'s deep copies;
  and torch's generator left where a plain build leaves it.
* Real worker processes (``distrib launch``, gloo over loopback): at N = 2 and 4 every parameter's
  ``full_tensor()`` equals a plain build's, bit for bit, one SGD step after agrees, and workers seeded
  differently end with the chief's values; the build's peak RSS per worker is about 1/N of the model
  plus one tensor, against the whole model when built whole (tests/scripts/deferred_init_build.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from helpers import SCRIPTS, launch
from torch import nn

import distrib as ds
from distrib.strategies.deferred_materialise import plan_materialisation
from distrib.strategies.deferred_record import BuildRecorder, DeferredTensor


class Block(nn.Module):
    """A user module initialising itself in __init__."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        nn.init.normal_(self.fc.weight, std=0.02)
        self.w = nn.Parameter(torch.randn(d, 3) * 0.02)  # built with values: stays real
        self.gain = nn.Parameter(torch.empty(d).uniform_(0.5, 1.5) * 2)
        self.register_buffer("positions", torch.arange(d).float())
        pe = torch.empty(d, 4)
        pe.fill_(1.0)
        pe[:, 0::2] = torch.sin(torch.arange(d * 2.0).view(d, 2))
        self.register_buffer("pe", pe)
        self.norm_at_init = float(self.fc.weight.norm())  # a value read during the build
        self.table = torch.empty(3).fill_(2.0)  # a plain attribute, not a buffer


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    return model


def _redrawn() -> nn.Module:  # model.apply(init_weights): the first draws are overwritten
    return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)).apply(
        lambda m: nn.init.normal_(m.weight, std=0.1) if isinstance(m, nn.Linear) else None
    )


def _initialised(init: Callable[[torch.Tensor], object]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layer = nn.Linear(40, 30)
        init(layer.weight)
        return layer

    return build


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: nn.Linear(5, 7),
    "Conv2d": lambda: nn.Conv2d(3, 4, 3),
    "LayerNorm": lambda: nn.LayerNorm(6),
    "Embedding": lambda: nn.Embedding(10, 4, padding_idx=0),
    "BatchNorm1d": lambda: nn.BatchNorm1d(5),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
    "TransformerEncoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False
    ),
    "Block": lambda: Block(6),
    "tied": _tied,
    "redrawn": _redrawn,
    "trunc_normal_": _initialised(lambda w: nn.init.trunc_normal_(w, std=0.02)),
    "orthogonal_": _initialised(nn.init.orthogonal_),
    "xavier_uniform_": _initialised(nn.init.xavier_uniform_),
}


def _materialise_whole(root: nn.Module) -> None:
    """The sharded path's replay with one worker and no sharding: ``root``'s deferred parameters and buffers get
    their values, whole, on the CPU (what a plain build gives them), to check the recorder against a plain build."""
    plan = plan_materialisation(root)
    assert plan is not None, "nothing was deferred"
    plan.to_meta()
    plan.materialise(torch.device("cpu"), SimpleNamespace(world_size=1))


def _deferred(build: Callable[[], nn.Module]) -> tuple[nn.Module, int]:
    recorder = BuildRecorder()
    recorder.open()
    try:
        model = build()
    finally:
        recorder.close()
    deferred = sum(isinstance(t, DeferredTensor) for t in [*model.parameters(), *model.buffers()])
    return model, deferred


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_deferred_build_replays_to_the_plain_build_bit_for_bit(name: str) -> None:
    torch.manual_seed(0)
    plain = BUILDS[name]()
    plain_next = torch.rand(5)
    torch.manual_seed(0)
    model, deferred = _deferred(BUILDS[name])
    assert torch.equal(torch.rand(5), plain_next)  # the generator moved on exactly as in the plain build
    assert deferred > 0  # the build did hold no data
    _materialise_whole(model)
    assert not any(isinstance(t, DeferredTensor) for t in [*model.parameters(), *model.buffers()])
    want, got = plain.state_dict(), model.state_dict()
    assert list(want) == list(got)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert [k for k, _ in plain.named_parameters()] == [k for k, _ in model.named_parameters()]  # ties kept
    if name == "Block":
        assert model.norm_at_init == plain.norm_at_init
        assert type(model.table) is torch.Tensor and torch.equal(model.table, plain.table)


def test_a_draw_overwritten_before_it_is_read_is_never_replayed() -> None:
    """``model.apply(init_weights)`` redraws every weight: materialising runs only the draws that count."""
    from distrib.torch_patches import TorchDispatchMode

    ran: list[object] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ran.append(func)
            return func(*args, **(kwargs or {}))

    model, _ = _deferred(_redrawn)
    with Count():
        _materialise_whole(model)
    # Linear's reset_parameters drew 4 uniforms (weights and biases); the weights' were redrawn by normal_
    assert ran.count(torch.ops.aten.uniform_.default) == 2 and ran.count(torch.ops.aten.normal_.default) == 2


def test_values_asked_for_during_the_build_are_the_plain_builds() -> None:
    def build() -> tuple[nn.Module, list[float]]:
        layer = nn.Linear(30, 20)
        seen = [layer.weight.sum().item(), float(layer.bias[3]), layer.weight.abs().max().tolist()]
        return layer, seen

    torch.manual_seed(3)
    _, want = build()
    recorder = BuildRecorder()
    recorder.open()
    torch.manual_seed(3)
    try:
        layer, got = build()
    finally:
        recorder.close()
    assert isinstance(layer.weight, DeferredTensor) and got == want


def test_a_deferred_tensor_read_after_the_build_has_its_value_and_a_write_is_an_error_naming_the_fix() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(3, 2).weight.detach().sum().item()
    torch.manual_seed(0)
    layer, _ = _deferred(lambda: nn.Linear(3, 2))
    weight = layer.weight
    assert weight.detach().sum().item() == plain  # still evaluates (a reference kept past the sharding)
    with pytest.raises(RuntimeError, match="tolist"):
        weight.numpy()  # would share memory in a plain build: refused, not a silent copy
    with pytest.raises(RuntimeError, match="deferred_init=False"):
        with torch.no_grad():
            weight.add_(1.0)


def test_only_building_defers_not_a_forward_or_a_plain_strategys_scope() -> None:
    class Scratch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.empty(3).fill_(2.0) + x

    recorder = BuildRecorder()
    recorder.open()
    try:
        out = Scratch()(torch.ones(3))  # inside a module's forward: real
        built = torch.empty(2)
        with recorder.paused():
            real = torch.empty(2)
    finally:
        recorder.close()
    assert type(out) is torch.Tensor and torch.equal(out, torch.full((3,), 3.0))
    assert isinstance(built, DeferredTensor) and type(real) is torch.Tensor
    assert type(torch.empty(2)) is torch.Tensor  # closed: nothing intercepted
    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        layer = nn.Linear(2, 2)
    with ds.ShardedStrategy(devices=["cpu"]).scope():  # one worker: nothing to shard, nothing deferred
        other = nn.Linear(2, 2)
    assert type(layer.weight) is nn.Parameter and type(other.weight) is nn.Parameter


def test_a_meta_tensor_beside_deferred_ones_is_an_error_naming_the_fix() -> None:
    model, _ = _deferred(lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta")))
    with pytest.raises(ValueError, match=r"1.weight was built on the meta device.*drop the torch.device\('meta'\)"):
        plan_materialisation(model)


def _results(log: str) -> list[dict]:
    return sorted(
        (json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line),
        key=lambda r: r["worker"],
    )


@pytest.mark.parametrize(
    "workers,options", [(2, []), (4, []), (2, ["--seed-by-rank"])], ids=["N2", "N4", "N2-seeded-by-rank"]
)
def test_the_sharded_build_equals_a_plain_build_bit_for_bit(workers: int, options: list[str]) -> None:
    code, log, _ = launch(
        "--workers", str(workers), str(SCRIPTS / "deferred_init_build.py"), "equal", *options, timeout=240
    )
    assert code == 0, log
    rows = _results(log)
    assert len(rows) == workers, log
    for row in rows:
        assert row["differ"] == [] and row["tensors"] == 30, row  # every parameter's full_tensor() and buffer
        assert row["tied"] and row["step_diff"] < 1e-4, row
        assert row["rng"] in (True, None), row  # the generator where a plain build leaves it
        assert row["local"] <= row["total"] // workers + 200, row  # sharded
    if "--seed-by-rank" in options:
        assert "every worker takes the chief's" in log, log


def test_the_build_never_holds_the_whole_model() -> None:
    """12 blocks of Linear(2048, 2048): 50.4M parameters, 201 MB; N=2 keeps 101 MB of shards per worker."""
    peaks = {}
    for how in ("deferred", "whole"):
        code, log, _ = launch(
            "--workers", "2", str(SCRIPTS / "deferred_init_build.py"), "memory", "--how", how, timeout=300
        )
        assert code == 0, log
        rows = _results(log)
        assert len(rows) == 2 and all(r["local"] == 25_178_112 for r in rows), log
        peaks[how] = max(r["build_mb"] for r in rows)
    model_mb, tensor_mb = 201.4, 16.8
    assert peaks["whole"] >= model_mb, peaks  # built whole: the whole model once on every worker
    # deferred: the shards (half the model), the tensor being replayed, what building loads on first use, and
    # glibc's slack (RSS, default allocator): 135-152 MB measured, where a build that held the whole model once
    # is >= 201 MB. The bound is below the whole model with room for that noise, not a tight fit
    assert peaks["deferred"] < 0.85 * model_mb, peaks  # 171 MB
    assert peaks["deferred"] < peaks["whole"] - 2 * tensor_mb, peaks
