"""``ds.experimental.MeshStrategy`` on one GPU: the meshes that fit one device, against plain PyTorch there.

One worker given a mesh lays the model out all the same (every axis of size 1), over a process group of
its own rank (NCCL for the GPU's tensors, gloo for the CPU's; gloo alone in the CPU dry run): the layout
map is applied by ``parallelize_module``, FSDP2's ``fully_shard`` runs over the data axes, and every
parameter is a ``DTensor`` on the device. Each mesh trains a small decoder (embedding, causal attention,
MLP, LayerNorms) for 10 Adam steps (lr 1e-3, fp32) beside the same model in plain PyTorch on the same
device; every parameter and the loss ``strategy.reduce`` returns must agree to 1e-5 (the figures measured
are recorded as junit properties). FSDP x TP 1x1 also trains with ``ds.experimental.clip_grad_norm_``
(its parameters on two meshes, where torch's own raises) against torch's clipping in plain PyTorch. The meshes of several workers (hybrid 2x2, FSDP x TP 2x2, TP 4, the
checkpoint matrix) need 4 GPUs: NCCL refuses two ranks on one GPU (tests/strategies/test_mesh*.py run them
on 4 CPU workers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import distrib as ds
from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS, LR = 32, 16, 4, 8, 8, 10, 1e-3
MAX_NORM = 0.6  # the gradients' norm is 0.56-0.64 over the 10 steps: most are clipped
TOLERANCE = 1e-5  # the mesh tests' bar; measured: 0 on the CPU dry run (the same kernels on each worker's whole)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=n != "k") for n in "qkvo")  # no key bias
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))  # -1: TP heads
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.block = nn.Embedding(VOCAB, DIM), Block()
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.block(self.tok(idx))))


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="none").view(x.shape).mean(1)


def layouts(mesh: DeviceMesh) -> LayoutMap:
    layout_map = LayoutMap(mesh)
    layout_map[r"tok\.weight"] = ("model", None)  # the vocabulary split: RowwiseParallel
    layout_map[r"\.[qkv]\.weight"] = ("model", None)  # ColwiseParallel
    layout_map[r"\.o\.weight"] = (None, "model")  # RowwiseParallel
    layout_map[r"\.up\.weight"] = ("model", None)
    layout_map[r"\.down\.weight"] = (None, "model")
    return layout_map


#: the parameters the layout map splits, and the dimension: Colwise splits a Linear's outputs (0), Rowwise its inputs
SPLIT = {"tok.weight": 0, **{f"block.{n}.weight": 0 for n in ("q", "k", "v", "up")}, "block.o.weight": 1}
SPLIT |= {"block.down.weight": 1, **{f"block.{n}.bias": 0 for n in ("q", "v", "up")}}
#: the modules parallelize_module lays out: all their parameters on the whole mesh (a Rowwise bias replicated)
TP_MODULES = {"tok", *(f"block.{n}" for n in ("q", "k", "v", "o", "up", "down"))}

MESHES: dict[str, Callable[[], tuple[DeviceMesh, bool]]] = {
    "fsdp_tp_1x1": lambda: (DeviceMesh((1, 1), ("batch", "model")), True),
    "hybrid_1x1": lambda: (DeviceMesh((1, 1), ("replicate", "batch")), False),
    "hybrid_tp_1x1x1": lambda: (DeviceMesh((1, 1, 1), ("replicate", "batch", "model")), True),
}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    """The strategies' one-rank process group ends with this module, so the next tests find none."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def reference(
    device: torch.device, data: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float | None = None
) -> tuple[dict, list[float]]:
    """The same model in plain PyTorch on the same device (clipped by torch with ``max_norm``): its parameters and
    loss per step."""
    torch.manual_seed(0)
    model = Decoder().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        loss = per_example_loss(model, x, y).sum() / BATCH
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def build(
    mesh: DeviceMesh, tp: bool, device: torch.device, max_norm: float | None = None
) -> tuple[MeshStrategy, nn.Module, Callable[..., Any]]:
    """The mesh's strategy, the model and a training step returning the reduced loss (clipped with ``max_norm``)."""
    strategy = MeshStrategy(mesh, layouts(mesh) if tp else None, devices=[str(device)])
    with strategy.scope():
        torch.manual_seed(0)
        model = Decoder()
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(per_example_loss(model, x, y), global_batch_size=BATCH)
        loss.backward()
        if max_norm is not None:
            ds.experimental.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return strategy, model, lambda x, y: strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)


def largest_difference(strategy: MeshStrategy, model: nn.Module, ref: dict) -> float:
    state = strategy.checkpoint_state(model)
    return max(float((state[k].to(v.device) - v).abs().max()) for k, v in ref.items())


@pytest.mark.parametrize("name", list(MESHES))
def test_a_one_worker_mesh_trains_as_plain_pytorch_on_the_device(
    device: torch.device, name: str, record_testsuite_property: Callable[[str, object], None]
) -> None:
    from torch.distributed.tensor import DTensor, Shard

    mesh, tp = MESHES[name]()
    data = batches(device)
    ref, ref_losses = reference(device, data)
    strategy, model, train_step = build(mesh, tp, device)
    for pname, param in model.named_parameters():  # laid out: DTensors on the device, on a mesh of the axes
        assert isinstance(param, DTensor), pname
        assert param.device_mesh.device_type == device.type and param.to_local().device.type == device.type, pname
        axes = param.device_mesh.mesh_dim_names  # the layout map's on the whole mesh, the rest on the data axes
        laid_out = tp and pname.rpartition(".")[0] in TP_MODULES
        assert axes == (mesh.axis_names if laid_out else mesh.data_axes), (pname, axes)
    if tp:  # the layout map applied on the model axis (last): torch's Colwise / Rowwise shards
        for pname, param in model.named_parameters():
            if pname in SPLIT:
                assert param.placements[-1] == Shard(SPLIT[pname]), (pname, param.placements)
    losses = [float(train_step(x, y)) for x, y in strategy.experimental_distribute_dataset(data)]
    diff = largest_difference(strategy, model, ref)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    record_testsuite_property(f"mesh {name}: largest parameter difference", diff)  # in cuda-tests.xml
    record_testsuite_property(f"mesh {name}: largest loss difference", loss_diff)
    assert diff <= TOLERANCE, f"{name}: largest difference {diff:.3g}"
    assert loss_diff <= TOLERANCE, (losses, ref_losses)


def test_a_mesh_step_under_ds_function_runs_eagerly_and_says_why(
    device: torch.device, record_testsuite_property: Callable[[str, object], None]
) -> None:
    """FSDP2's and DTensor's host-side hooks cannot be replayed by a CUDA graph: the step runs eagerly, as trained."""
    mesh, _ = MESHES["fsdp_tp_1x1"]()
    data = batches(device)[:4]
    ref, ref_losses = reference(device, data)
    strategy, model, train_step = build(mesh, True, device)
    function = ds.function(train_step)
    losses = [float(function(x, y)) for x, y in strategy.experimental_distribute_dataset(data)]
    paths = list(function.paths().values())
    assert paths and all(p.startswith("eager: MeshStrategy lays the model out") for p in paths), paths
    diff = largest_difference(strategy, model, ref)
    record_testsuite_property("mesh fsdp_tp_1x1 under ds.function: largest parameter difference", diff)
    assert diff <= TOLERANCE and max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE


def test_clip_grad_norm_across_the_meshes_of_a_one_worker_mesh(
    device: torch.device, record_testsuite_property: Callable[[str, object], None]
) -> None:
    """FSDP x TP 1x1: the layout map's parameters on the 2-D mesh, the rest on the data axis. torch's own
    clip_grad_norm_ refuses two meshes (recorded); ds.experimental.clip_grad_norm_ clips as torch does one process."""
    mesh, _ = MESHES["fsdp_tp_1x1"]()
    data = batches(device)
    ref, ref_losses = reference(device, data, max_norm=MAX_NORM)
    strategy, model, train_step = build(mesh, True, device, max_norm=MAX_NORM)
    x, y = data[0]
    per_example_loss(model, x, y).mean().backward()  # torch's clip on these gradients (max_norm=inf scales by 1)
    try:
        torch_says = f"norm {float(torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf')).full_tensor()):.6g}"
    except RuntimeError as e:
        torch_says = f"raised RuntimeError: {str(e).strip().splitlines()[0]}"
    record_testsuite_property("mesh fsdp_tp_1x1: torch's clip_grad_norm_", torch_says)
    model.zero_grad()
    losses = [float(train_step(x, y)) for x, y in strategy.experimental_distribute_dataset(data)]
    diff = largest_difference(strategy, model, ref)
    record_testsuite_property("mesh fsdp_tp_1x1 clipped: largest parameter difference", diff)
    assert diff <= TOLERANCE and max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE, diff
