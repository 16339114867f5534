"""A sharded step whose peer dies or hangs.

distrib launch --workers 2 tests/scripts/sharded_peer.py hang|dead TIMEOUT_SECONDS
    worker 1 stops answering (SIGSTOP) or exits after 2 steps; worker 0's next step (FSDP's all-gather and
    reduce-scatter run inside forward and backward) must be a CollectiveError within the timeout. The first
    of the 2 steps uses a mean loss (not scaled by the global batch): one UnscaledLossWarning per worker
"""

import os
import signal
import sys
import time
import warnings

import torch

import distrib as ds
from distrib.comm import CollectiveError

mode, arg = sys.argv[1], sys.argv[2]
timeout = float(arg)
strategy = ds.ShardedStrategy(
    devices=["cpu"],  # the same on a GPU machine
    communication_options=ds.CommunicationOptions(timeout_seconds=timeout),
    sharding_policy=ds.ShardingPolicy(min_params=200),
)
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(10)]


def step(x, y):
    ds.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=16).backward()
    optimizer.step()
    optimizer.zero_grad()


def mean_loss_step(x, y):  # a loss averaged over this worker's examples only: the gradients would be N times off
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


data = iter(strategy.experimental_distribute_dataset(batches))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    strategy.run(mean_loss_step, args=next(data))
    strategy.run(step, args=next(data))
unscaled = [w for w in seen if issubclass(w.category, ds.UnscaledLossWarning)]
print(f"UNSCALED LOSS WARNINGS {len(unscaled)}: {str(unscaled[0].message)[:120] if unscaled else ''}", flush=True)
if strategy.worker_index == 1:
    if mode == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)
start = time.monotonic()
x, y = batches[2]
try:  # this worker's half of the batch, given directly: the first collective is FSDP's all-gather in forward
    strategy.run(step, args=(x[:8], y[:8]))
except CollectiveError as e:
    print(f"COLLECTIVE ERROR after {time.monotonic() - start:.2f}s: {str(e)[:300]}", flush=True)
    os._exit(3)  # the group is broken: leave without tearing it down
print("no error", flush=True)
sys.exit(0)
