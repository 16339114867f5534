"""Two backward passes per step (gradient accumulation) and clipping, on 2 workers; the chief saves the parameters.

    distrib launch --workers 2 tests/scripts/mw_accumulate.py OUT
Each worker takes its half of every batch; after loss.backward() the gradients are the global sums,
so clip_grad_norm_ sees what one device would see.
"""

import sys

import torch

import distrib as ds

s = ds.MultiWorkerMirroredStrategy()
with s.scope():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
xs = [torch.randn(8, 4, generator=g) for _ in range(4)]


def step(a, b, clip):
    for x in (a, b):
        part = x[s.worker_index * 4 : (s.worker_index + 1) * 4]
        (m(part).pow(2).sum() / 16).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


s.run(step, args=(xs[0], xs[1], True))
s.run(step, args=(xs[2], xs[3], False))
if s.is_chief:
    torch.save([p.detach() for p in m.parameters()], sys.argv[1])
