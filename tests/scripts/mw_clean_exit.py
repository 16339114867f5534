"""Seed 001's model (11 MB of gradients a step) for a few steps on 2 workers, then a normal exit.

    distrib launch --workers 2 tests/scripts/mw_clean_exit.py
Used by the clean-exit fault scenario: a correct job must exit 0 every time.
"""

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

strategy = ds.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 26 * 26, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
data = [(torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(3)]


def step(inputs):  # type: ignore[no-untyped-def]
    x, y = inputs
    ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=16).backward()
    optimizer.step()
    optimizer.zero_grad()


for batch in strategy.experimental_distribute_dataset(data):
    strategy.run(step, args=(batch,))
print("trained", flush=True)
