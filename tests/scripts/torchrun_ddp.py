"""A DDP-style script with no distrib import, as users write it for torchrun: it must run unchanged under
``distrib launch --workers N`` (which exports torchrun's variables).

    distrib launch --workers 2 tests/scripts/torchrun_ddp.py --out OUT

Each rank prints its torchrun variables, trains a linear model with DistributedDataParallel on its
slice of every global batch, and writes its final parameters to ``OUT.<rank>``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--global-batch", type=int, default=8)
args = p.parse_args()

dist.init_process_group("gloo")  # env:// : RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
print("variables " + " ".join(f"{n}={os.environ.get(n)}" for n in names), flush=True)

torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(6, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(1)
per = args.global_batch // world
for _ in range(args.steps):
    x, y = torch.randn(args.global_batch, 6, generator=g), torch.randn(args.global_batch, 3, generator=g)
    loss = F.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
    loss.backward()  # DDP averages the gradients: the global batch's mean loss
    optimizer.step()
    optimizer.zero_grad()
torch.save([t.detach() for t in model.module.parameters()], f"{args.out}.{rank}")
print(f"done: rank {rank} of {world}", flush=True)
dist.destroy_process_group()
