"""20 Adam steps of a small decoder under ds.experimental.MeshStrategy, per mesh, against one process.

Run by ``distrib launch --workers 4``. For each mesh named by --meshes (hybrid 2x2, FSDP x TP 2x2,
TP 4, FSDP x TP 2x2 with sequence parallelism, FSDP 4), one strategy trains the model (built in the
scope under deferred init, the optimizer built over its parameters in the same scope) on the global
batches; the chief also trains the same model in plain PyTorch on the whole global batch (fp32, the
same seed) and writes the largest difference of any parameter, the losses, and the local parameter
count of every worker to --out (JSON). --lr sets Adam's learning rate.

FSDP x TP and TP 4 clip the gradients' norm to MAX_NORM every step with ds.experimental.clip_grad_norm_
(their parameters are on two meshes, or DTensors beside plain tensors), against one process clipping
with torch's; every mesh first records what torch's own clip_grad_norm_ does with its gradients (the
norm, or the error), with max_norm=inf, which scales by exactly 1.
"""

import argparse
import json
import os

import torch
from torch import nn
from torch.nn import functional as F

import distrib as ds
from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy, clip_grad_norm_

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--meshes", default="hybrid,fsdp_tp,tp,fsdp_tp_sp")
args = p.parse_args()

VOCAB, DIM, HEADS, SEQ, GLOBAL = 32, 16, 4, 8, 8
MAX_NORM = 0.65  # the gradients' norm is 0.6-0.77 over the 20 steps: about half of them are clipped


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no key bias: its true gradient is 0 (softmax ignores a constant added to every score), so Adam would
        # turn rounding noise (different in every reduction order) into steps of lr
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=name != "k") for name in "qkvo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism this worker holds HEADS / tp of them (ColwiseParallel's local output)
        q, k, v = (f(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def per_example_loss(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(idx.shape).mean(1)


def layouts(mesh: DeviceMesh) -> LayoutMap:
    layout_map = LayoutMap(mesh)
    layout_map[r"tok\.weight"] = ("model", None)  # the vocabulary split: RowwiseParallel
    layout_map[r"attn\.[qkv]\.weight"] = ("model", None)  # heads split: ColwiseParallel
    layout_map[r"attn\.o\.weight"] = (None, "model")  # RowwiseParallel
    layout_map[r"up\.weight"] = ("model", None)
    layout_map[r"down\.weight"] = (None, "model")
    return layout_map


def sequence_parallel_layouts(mesh: DeviceMesh) -> LayoutMap:
    """FSDP x TP with sequence parallelism, torchtitan's plan: the LayerNorms (and the residual stream between
    blocks) split along the sequence, gathered before attention and the MLP, reduce-scattered after."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    layout_map = LayoutMap(mesh)
    layout_map[r"^tok$"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))  # tokens split
    layout_map[r"(^|\.)ln[12]?$"] = SequenceParallel()  # every LayerNorm, on its part of the sequence
    layout_map[r"attn$"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    layout_map[r"attn\.[qkv]\.weight"] = ("model", None)  # ColwiseParallel, its input whole (gathered above)
    layout_map[r"attn\.o$"] = RowwiseParallel(output_layouts=Shard(1))  # reduce-scattered along the sequence
    layout_map[r"\.up$"] = ColwiseParallel(input_layouts=Shard(1))  # gathers the sequence
    layout_map[r"\.down$"] = RowwiseParallel(output_layouts=Shard(1))
    layout_map[r"^head$"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return layout_map


MESHES = {  # name: the mesh, its layout map (or None), whether the gradients' norm is clipped
    "hybrid": lambda: (DeviceMesh((2, 2), ("replicate", "batch")), None, False),
    "fsdp_tp": lambda: (DeviceMesh((2, 2), ("batch", "model")), layouts, True),
    "tp": lambda: (DeviceMesh((1, 4), ("batch", "model")), layouts, True),
    "fsdp_tp_sp": lambda: (DeviceMesh((2, 2), ("batch", "model")), sequence_parallel_layouts, False),
    "fsdp": lambda: (DeviceMesh((4,), ("batch",)), None, False),
}

g = torch.Generator().manual_seed(1)
batches = []
for _ in range(args.steps):
    idx = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    batches.append((idx[:, :-1], idx[:, 1:]))


def reference(clip: bool) -> dict:
    """One process on each whole global batch: the parameters, the losses, and the gradients' norm per step."""
    torch.manual_seed(0)
    model = Decoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, norms = [], []
    for x, y in batches:
        loss = per_example_loss(model, x, y).sum() / GLOBAL
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM if clip else float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "losses": losses, "norms": norms}


def torch_clip(model: nn.Module) -> str:
    """What torch's own clip_grad_norm_ does with these gradients (max_norm=inf scales them by exactly 1)."""
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    except RuntimeError as e:
        return f"raised RuntimeError: {str(e).strip().splitlines()[0]}"
    return f"norm {float(norm.full_tensor() if hasattr(norm, 'full_tensor') else norm):.8g}"


results: dict[str, dict] = {}
chief = int(os.environ.get("RANK", "0")) == 0
refs = {clip: reference(clip) for clip in (False, True)} if chief else {}
for name in args.meshes.split(","):
    mesh, layout_fn, clip = MESHES[name]()
    strategy = MeshStrategy(mesh, layout_fn(mesh) if layout_fn else None, devices=["cpu"])
    with strategy.scope():
        torch.manual_seed(0)
        model = Decoder()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    norms: list[float] = []
    torch_says: list[str] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(per_example_loss(model, x, y), global_batch_size=GLOBAL)
        loss.backward()
        if not torch_says:
            torch_says.append(torch_clip(model))
        if clip:
            norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches):
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)))
    state = strategy.checkpoint_state(model)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    counts = strategy.communicator.all_gather_object(local)
    every_norm = strategy.communicator.all_gather_object(norms)
    meshes = {
        n: list(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else [] for n, p in model.named_parameters()
    }
    if chief:
        ref = refs[clip]
        worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items())
        results[name] = {
            "max_diff": worst,
            "losses": losses,
            "ref_losses": ref["losses"],
            "local_params": counts,
            "mesh": repr(mesh),
            "clip": clip,
            "norms": every_norm,  # distrib's, per worker
            "ref_norms": ref["norms"],
            "torch_clip_grad_norm": torch_says[0],
            "param_meshes": meshes,
        }
        print(f"{name}: largest difference {worst:.3g}, local parameters {counts}; torch's clip: {torch_says[0]}")
        if os.environ.get("MESH_DEBUG"):
            print({k: f"{(state[k] - v).abs().max().item():.2g}" for k, v in ref["state"].items()}, flush=True)

if chief:
    total = sum(v.numel() for v in refs[False]["state"].values())
    with open(args.out, "w") as f:
        json.dump({"results": results, "total": total, "true_norm": refs[False]["norms"][0], "max_norm": MAX_NORM}, f)
