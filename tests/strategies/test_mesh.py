"""``ds.experimental.MeshStrategy``, ``DeviceMesh`` and ``LayoutMap``: real workers against one process, and the errors.

tests/scripts/mesh_train.py trains a small decoder (embedding, attention, MLP, LayerNorms) for 20 Adam
steps (lr 1e-3, fp32) under four meshes of 4 gloo workers in one launch: hybrid 2x2 (replicate x
batch), FSDP x TP 2x2 (batch x model), TP 4 (model) and FSDP x TP 2x2 with sequence parallelism
(torchtitan's plan: the LayerNorms ``SequenceParallel``, the residual stream split along the sequence),
built under deferred init; the chief trains the same model in plain PyTorch on each global batch. Every
parameter must agree to 1e-5, and the loss that ``strategy.reduce`` gives (each tensor-parallel group
counted once) must equal one process's. FSDP x TP and TP 4 clip the gradients' norm every step with
``ds.experimental.clip_grad_norm_`` (their parameters are on two meshes, or DTensors beside plain
tensors, where torch's own raises), against one process clipping with torch's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, launch
from torch import nn

import distrib as ds
from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy
from distrib.strategies import tensor_parallel


def test_four_meshes_on_four_workers_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    out = tmp_path / "mesh.json"
    code, log, _ = launch("--workers", "4", str(SCRIPTS / "mesh_train.py"), "--out", str(out), timeout=240)
    assert code == 0, log
    got = json.loads(out.read_text())
    total, results = got["total"], got["results"]
    assert set(results) == {"hybrid", "fsdp_tp", "tp", "fsdp_tp_sp"}
    for name, r in results.items():
        assert r["max_diff"] <= 1e-5, f"{name}: largest difference {r['max_diff']:.3g}"
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), name  # reduce counts each TP group once
    assert results["hybrid"]["local_params"] == [total // 2] * 4  # sharded over 2, replicated over 2
    assert all(n < total // 2 for n in results["fsdp_tp"]["local_params"])  # 1/4 of the split ones, 1/2 of the rest
    assert all(n < total for n in results["tp"]["local_params"])  # the layouts' parameters split over 4
    # sequence parallelism: the LayerNorms are laid out on the model axis too (replicated there, sharded over batch)
    sp_meshes = results["fsdp_tp_sp"]["param_meshes"]
    assert sp_meshes["blocks.0.ln1.weight"] == sp_meshes["ln.bias"] == ["batch", "model"], sp_meshes
    assert results["fsdp_tp"]["param_meshes"]["blocks.0.ln1.weight"] == ["batch"]  # two meshes: the clip's case
    assert results["tp"]["param_meshes"]["blocks.0.ln1.weight"] == []  # a plain tensor beside DTensors
    for name in ("fsdp_tp", "tp"):  # the clipped norm: the true one, on every worker; clipping was active
        r = results[name]
        assert r["clip"] and len(r["norms"]) == 4, name
        for norms in r["norms"]:
            assert norms == pytest.approx(r["ref_norms"], rel=1e-5, abs=1e-6), name
        assert 0 < sum(n > got["max_norm"] for n in r["ref_norms"]) < len(r["ref_norms"]), r["ref_norms"]
    print({name: r["torch_clip_grad_norm"] for name, r in results.items()}, "the true norm:", got["true_norm"])


# ----------------------------------------------------------------------------- the mesh and the layouts, one process
class _Mlp(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.up, self.down, self.norm = nn.Linear(4, hidden), nn.Linear(hidden, 4), nn.LayerNorm(4)
        self.out = nn.Linear(4, 4)


def _map(**layouts: object) -> LayoutMap:
    layout_map = LayoutMap(DeviceMesh((2, 2), ("batch", "model")))
    for key, layout in layouts.items():
        layout_map[key.replace("__", ".")] = layout
    return layout_map


def test_device_mesh_roles_sizes_and_coordinates() -> None:
    mesh = DeviceMesh((2, -1), ("replicate", "batch"))
    assert mesh.data_axes == ("replicate", "batch") and mesh.model_axes == ()
    resolved = mesh.resolved(8)
    assert resolved.shape == (2, 4) and resolved.size("batch") == 4
    assert DeviceMesh((2, 2), ("batch", "model")).coordinate(3) == {"batch": 1, "model": 1}
    assert DeviceMesh((2, 2), ("batch", "model")).coordinate(1) == {"batch": 0, "model": 1}
    assert DeviceMesh.hybrid(shard_size=2, num_workers=8).shape == (4, 2)


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        ((2, 2), ("data", "model"), "no batch axis 'batch'"),
        ((2, 2), ("model", "batch"), "put the data axes first"),
        ((2, 2), ("batch", "replicate"), "put the data axes first"),
        ((2, 2, 2), ("batch", "tp", "ep"), "one model axis at most"),
        ((2,), ("batch", "model"), "one name per axis"),
    ],
)
def test_a_mesh_that_cannot_be_built_says_why(shape: tuple[int, ...], names: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeviceMesh(shape, names)


def test_a_mesh_of_another_size_than_the_workers_names_both() -> None:
    with pytest.raises(ValueError, match=r"holds 4 workers but 6 are running"):
        DeviceMesh((2, 2), ("batch", "model")).resolved(6)


def test_layout_map_lookup_is_keras_exact_then_one_regex() -> None:
    layout_map = _map(**{r"up__weight": ("model", None), "down": (None, "model")})
    assert layout_map.get("blocks.0.up.weight") == ("model", None)
    assert layout_map.get("down.weight") == (None, "model")
    assert layout_map.get("norm.weight") is None
    layout_map[r"\.weight"] = (None, None)
    with pytest.raises(ValueError, match="matches several keys"):
        layout_map.get("x.up.weight")
    with pytest.raises(ValueError, match="is a data axis"):
        layout_map["emb"] = ("batch", None)
    with pytest.raises(ValueError, match="not an axis"):
        layout_map["emb"] = ("tp", None)


def test_layouts_become_torchs_styles() -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layout_map = _map(up__weight=("model", None), down__weight=(None, "model"), emb__weight=("model", None))
    layout_map["norm"] = ColwiseParallel()  # a style keyed by module name goes through as given
    plan = tensor_parallel.plan_for(_Mlp(), layout_map, tp_size=2)
    assert type(plan["up"]) is ColwiseParallel and type(plan["down"]) is RowwiseParallel
    assert type(plan["emb"]) is RowwiseParallel and plan["emb"].input_layouts == (Replicate(),)  # token ids whole
    assert type(plan["norm"]) is ColwiseParallel


@pytest.mark.parametrize(
    ("layouts", "message"),  # _Mlp(hidden=6) over 4 workers: up's 6 outputs do not divide
    [
        (
            {"attn__q__weight": ("model", None)},
            r"\['attn\.q\.weight'\] match no parameter of _Mlp \(its parameters: emb",
        ),
        ({"up__weight": ("model", None)}, r"splits _Mlp\.up\.weight \(shape \[6, 4\]\) along dimension 0 over the 4"),
        ({"norm__weight": ("model",)}, r"_Mlp\.norm \(LayerNorm\).*ParallelStyle"),
        ({"emb__weight": ("model", "model")}, "splits both dimensions"),
        ({"out__weight": (None, "model"), "out__bias": ("model",)}, "disagrees"),
        ({"down__weight": ("model",)}, "has 1 entries but _Mlp.down.weight has 2 dimensions"),
    ],
)
def test_a_layout_map_that_does_not_fit_the_model_names_both(layouts: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tensor_parallel.plan_for(_Mlp(hidden=6), _map(**layouts), tp_size=4)


def test_one_worker_trains_as_one_device() -> None:
    strategy = MeshStrategy(devices=["cpu"])
    assert strategy.num_workers == 1 and strategy.num_replicas_in_sync == 1 and strategy.device_mesh.shape == (1,)
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step(x: torch.Tensor) -> None:
        ds.compute_average_loss(model(x).pow(2).sum(1), global_batch_size=4).backward()
        optimizer.step()

    strategy.run(step, args=(torch.ones(4, 3),))
    assert not torch.equal(before, model.weight)


def test_a_layout_map_on_another_mesh_or_without_a_model_axis_is_refused() -> None:
    with pytest.raises(ValueError, match="the layout map is on"):
        MeshStrategy(DeviceMesh((1,), ("batch",)), _map(up__weight=("model", None)), devices=["cpu"])
    with pytest.raises(ValueError, match="has no model axis"):
        layout_map = LayoutMap(DeviceMesh((1,), ("batch",)))
        layout_map["up"] = ColwiseLike()
        MeshStrategy(layout_map=layout_map, devices=["cpu"])


class ColwiseLike:
    """A stand-in ParallelStyle (anything with ``_apply``): the check runs before torch is asked."""

    def _apply(self, module: nn.Module, mesh: object) -> nn.Module:
        return module


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_on_plain_tensors_is_torchs(norm_type: float) -> None:
    """Without DTensors (one device, MirroredStrategy's replicas) the result and the gradients are torch's own."""
    torch.manual_seed(0)
    ours, theirs = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)], []
    for p in ours:
        p.grad = torch.randn_like(p)
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        theirs.append(q)
    ours.append(nn.Parameter(torch.ones(2)))  # no gradient: left out, as by torch
    norm = ds.experimental.clip_grad_norm_(ours, 0.5, norm_type=norm_type)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs)) and ours[-1].grad is None
    assert float(ds.experimental.clip_grad_norm_([nn.Parameter(torch.ones(1))], 1.0)) == 0.0  # no gradients


def test_clip_grad_norm_of_a_nonfinite_gradient_raises_when_asked() -> None:
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1.0, float("nan"), 0.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        ds.experimental.clip_grad_norm_(param, 1.0, error_if_nonfinite=True)
    assert torch.isnan(ds.experimental.clip_grad_norm_(param, 1.0))
