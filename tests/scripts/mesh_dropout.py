"""Dropout and a random DataLoader under ds.experimental.MeshStrategy: one random stream per tensor-parallel group.

Run by ``distrib launch --workers 2`` (a 1 x 2 mesh, batch x model) or ``--workers 4`` (2 x 2). A small MLP
whose dropout follows a RowwiseParallel layer (``down``: its output is whole, and must be the same, on both
workers of a tensor-parallel group) under each way users seed: ``rank`` (``torch.manual_seed(100 + rank)``
before building the strategy, and ``torch.manual_seed(200 + rank)`` after it) and ``none`` (no seed at all).

* masks: 3 steps of ``strategy.run``; every worker records its dropout output's sum and mask per step.
* loader: a sharded ``DataLoader`` whose dataset adds ``torch.rand`` noise and a ``random.random()`` draw to each
  example, loading in the main process and in 1 loader process (per-rank seeds), and shuffled without a
  generator under one seed on every worker (its global batches must still agree).
* train (``--train``): 40 Adam steps of the same MLP with dropout on a 4-class problem, then the evaluation loss
  (dropout off), beside one process trained on the same global batches under ``--ref-seeds`` dropout seeds; and
  the whole parameters of every worker, to check that the tensor-parallel peers hold the same ones.

The chief writes every worker's figures to ``--out`` (JSON).
"""

import argparse
import json
import os
import random

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--train", action="store_true")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--ref-seeds", type=int, default=8)
args = p.parse_args()

DIM, HIDDEN, CLASSES, GLOBAL, P_DROP = 16, 64, 4, 16, 0.5
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
CHIEF = RANK == 0
MESH = DeviceMesh((WORLD // 2, 2), ("batch", "model"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.drop = nn.Dropout(P_DROP)
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.drop(self.down(F.gelu(self.up(x))))  # dropout on the RowwiseParallel layer's whole output
        return self.head(self.norm(h))


def layouts() -> LayoutMap:
    layout_map = LayoutMap(MESH)
    layout_map[r"^up\.weight$"] = ("model", None)  # ColwiseParallel
    layout_map[r"^down\.weight$"] = (None, "model")  # RowwiseParallel: its output all-reduced, whole
    return layout_map


def seeded_strategy(seeding: str) -> MeshStrategy:
    """The strategy and the user's seeds, as ``seeding`` says; the model is built in its scope."""
    if seeding == "rank":
        torch.manual_seed(100 + RANK)
        random.seed(100 + RANK)
    strategy = MeshStrategy(MESH, layouts(), devices=["cpu"])
    if seeding == "rank":  # again after the strategy: the usual per-rank seed, set late
        torch.manual_seed(200 + RANK)
        random.seed(200 + RANK)
    return strategy


def where(strategy: MeshStrategy) -> dict:
    coords = MESH.coordinate(RANK)
    return {"rank": RANK, "dp": coords["batch"], "tp": coords["model"]}


data_gen = torch.Generator().manual_seed(1)
TEACHER = torch.randn(DIM, CLASSES, generator=data_gen)
X_TRAIN = torch.randn(args.steps * GLOBAL, DIM, generator=data_gen)
Y_TRAIN = (X_TRAIN @ TEACHER + 0.5 * torch.randn(len(X_TRAIN), CLASSES, generator=data_gen)).argmax(1)
X_EVAL = torch.randn(256, DIM, generator=data_gen)
Y_EVAL = (X_EVAL @ TEACHER).argmax(1)
BATCHES = [(X_TRAIN[i : i + GLOBAL], Y_TRAIN[i : i + GLOBAL]) for i in range(0, len(X_TRAIN), GLOBAL)]


# ----------------------------------------------------------------------------- the dropout masks
def masks(seeding: str) -> dict:
    strategy = seeded_strategy(seeding)
    with strategy.scope():
        model = Net()
    drawn: list[torch.Tensor] = []
    model.drop.register_forward_hook(lambda _m, _i, out: drawn.append(out.detach().clone()))

    def step(x: torch.Tensor) -> None:
        model(x)

    for x, _ in strategy.experimental_distribute_dataset(BATCHES[:3]):
        strategy.run(step, args=(x,))
    mine = {
        **where(strategy),
        "sums": [round(float(out.sum()), 4) for out in drawn],
        "kept": [int((out != 0).sum()) for out in drawn],
        "masks": [(out != 0).flatten().tolist() for out in drawn],
        "seed": getattr(getattr(strategy, "model_stream", None), "seed", None),  # the group's agreed seed
    }
    return {"workers": strategy.communicator.all_gather_object(mine)}


# ----------------------------------------------------------------------------- the sharded DataLoader
class Noisy(Dataset):
    """Examples with a random augmentation: torch's generator and Python's ``random``."""

    def __len__(self) -> int:
        return 4 * GLOBAL

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i)) + torch.rand(3) + random.random()


def loader(seeding: str, num_workers: int, shuffle: bool) -> dict:
    strategy = seeded_strategy(seeding)
    if seeding == "same":
        torch.manual_seed(7)
        random.seed(7)
    data = DataLoader(Noisy(), batch_size=GLOBAL, shuffle=shuffle, num_workers=num_workers)
    shares = [share.tolist() for share in strategy.experimental_distribute_dataset(data)]
    return {"workers": strategy.communicator.all_gather_object({**where(strategy), "shares": shares})}


# ----------------------------------------------------------------------------- training against one process
def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def eval_loss(model: nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(per_example_loss(model, X_EVAL, Y_EVAL).mean())
    model.train()
    return loss


def reference(dropout_seed: int) -> dict:
    """One process, plain PyTorch: the model the strategy builds (the chief's init), another dropout seed."""
    torch.manual_seed(100)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(dropout_seed)
    losses = []
    for x, y in BATCHES:
        loss = per_example_loss(model, x, y).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "eval": eval_loss(model)}


def train() -> dict:
    import distrib as ds

    strategy = seeded_strategy("rank")
    with strategy.scope():
        torch.manual_seed(100 + RANK)  # each worker's own seed: the build takes the chief's values
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(per_example_loss(model, x, y), global_batch_size=GLOBAL)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def evaluate() -> torch.Tensor:
        return torch.tensor(eval_loss(model))

    losses = []
    for x, y in strategy.experimental_distribute_dataset(BATCHES):
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)))
    evaluated = float(strategy.run(evaluate))
    state = {k: v.tolist() for k, v in strategy.checkpoint_state(model).items()}
    workers = strategy.communicator.all_gather_object({**where(strategy), "eval": evaluated, "state": state})
    refs = [reference(1000 + s) for s in range(args.ref_seeds)] if CHIEF else []
    return {"losses": losses, "workers": workers, "refs": refs}


results: dict = {}
for seeding in ("none", "rank"):
    results[f"masks_{seeding}"] = masks(seeding)
results["loader_main"] = loader("rank", 0, shuffle=False)
results["loader_process"] = loader("rank", 1, shuffle=False)
results["loader_shuffled"] = loader("same", 0, shuffle=True)
if args.train:
    results["train"] = train()

if CHIEF:
    for name in ("masks_none", "masks_rank"):
        for w in results[name]["workers"]:
            print(
                f"{name} {MESH.shape} rank {w['rank']} (dp {w['dp']}, tp {w['tp']}): dropout output sums "
                f"{w['sums']}, kept {w['kept']} of {len(w['masks'][0])}",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump({"mesh": list(MESH.shape), "results": results}, f)
