"""A small GPT-style decoder trained with FSDP x tensor parallelism over a 2 x 2 mesh of workers.

Run it::

    distrib launch --workers 4 examples/mesh_decoder.py                 # FSDP x TP, mesh (batch 2, model 2)
    distrib launch --workers 4 examples/mesh_decoder.py --mesh hybrid   # sharded within pairs, replicated across
    distrib launch --workers 4 examples/mesh_decoder.py --mesh tp       # tensor parallelism over all 4
    python examples/mesh_decoder.py                                      # one process: the same losses

It learns to continue a repeating text, character by character. What makes it a mesh program is
the first lines of ``main``: a ``DeviceMesh`` naming the axes (``"batch"`` splits the global batch
and shards every parameter, FSDP2; ``"model"`` splits the layers the ``LayoutMap`` names, torch's
``ColwiseParallel`` / ``RowwiseParallel``), and ``ds.experimental.MeshStrategy``. The rest is the
loop of every distrib program: build in ``strategy.scope()``, ``ds.compute_average_loss`` over the
global batch, ``strategy.run``, ``strategy.reduce``, ``ds.Checkpoint``.

Two things a model must do for tensor parallelism (torch's rules, not distrib's):

* attention reshapes with ``-1`` heads (``view(b, t, -1, head_dim)``): a worker of a model axis of
  size ``tp`` holds ``n_heads / tp`` of them, ColwiseParallel's local output;
* a ``Colwise`` layer's output feeds a ``Rowwise`` one (q, k, v then o; up then down), with only
  elementwise work between: the activation in between stays split, and ``Rowwise`` sums it.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.nn import functional as F

import distrib as ds
from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 8
CHARS = sorted(set(TEXT))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def layouts(mesh: DeviceMesh) -> LayoutMap:
    """Which weights the model axis splits: a layout per dimension, torch's (out, in) for a Linear."""
    layout_map = LayoutMap(mesh)
    layout_map[r"attn\.[qkv]\.weight"] = ("model", None)  # heads split: ColwiseParallel
    layout_map[r"attn\.o\.weight"] = (None, "model")  # RowwiseParallel: the heads' outputs summed
    layout_map[r"\.up\.weight"] = ("model", None)
    layout_map[r"\.down\.weight"] = (None, "model")
    return layout_map


MESHES = {
    "fsdp_tp": lambda: DeviceMesh((2, 2), ("batch", "model")),
    "hybrid": lambda: DeviceMesh((-1, 2), ("replicate", "batch")),
    "tp": lambda: DeviceMesh((1, -1), ("batch", "model")),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", choices=sorted(MESHES), default="fsdp_tp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="the global batch, in sequences")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint", default=None, help="a prefix to save the final state at (ds.Checkpoint)")
    args = p.parse_args()

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        mesh = MESHES[args.mesh]()
        strategy: ds.Strategy = MeshStrategy(mesh, layouts(mesh) if "model" in mesh.axis_names else None)
    else:
        strategy = ds.OneDeviceStrategy("cpu")
    context = 32
    with strategy.scope():
        torch.manual_seed(0)
        model = Decoder(len(CHARS), context=context)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    ids = torch.tensor([CHARS.index(c) for c in TEXT])
    g = torch.Generator().manual_seed(1)

    def batches():  # the same global batches on every worker; each keeps its data-parallel part
        for _ in range(args.steps):
            start = torch.randint(0, len(ids) - context - 1, (args.batch,), generator=g)
            window = torch.stack([ids[s : s + context + 1] for s in start.tolist()])
            yield window[:, :-1], window[:, 1:]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        per_sequence = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        loss = ds.compute_average_loss(per_sequence, global_batch_size=args.batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches())):
        loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        if strategy.is_chief:
            print(f"step {i} loss {loss.item():.6f}", flush=True)
    if args.checkpoint:
        path = ds.Checkpoint(model=model, optimizer=optimizer).save(args.checkpoint)
        if strategy.is_chief:
            print(f"saved {path}")


if __name__ == "__main__":
    main()
