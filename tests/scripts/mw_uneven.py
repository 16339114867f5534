"""Uneven shards: worker 0 has 5 batches, worker 1 has 2; both must end the epoch at the same step.

    distrib launch --workers 2 tests/scripts/mw_uneven.py CHECKPOINT_BASE
Prints "steps=N examples=M" on every worker (M counted by a Sum metric over all workers), then every
worker saves a checkpoint to a path of its own, CHECKPOINT_BASE/w<index>/ckpt: each writes its own copy,
as TF's workers write where they are told, and prints whether the path save returned exists.
"""

import os
import sys

import torch

import distrib as ds

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=30))


def dataset_fn(ctx: ds.InputContext):
    n_batches = 5 if ctx.input_pipeline_id == 0 else 2
    return [torch.ones(ctx.get_per_replica_batch_size(8), 3) * (ctx.input_pipeline_id + 1) for _ in range(n_batches)]


with strategy.scope():
    examples = ds.metrics.Sum()
    weights = ds.metrics.Sum()

steps = 0
for x in strategy.distribute_datasets_from_function(dataset_fn):
    strategy.run(
        lambda b: (examples.update_state(torch.tensor(float(len(b)))), weights.update_state(b[:, 0])), args=(x,)
    )
    strategy.reduce("SUM", torch.tensor(1.0))  # a collective every step, as training would have
    steps += 1
print(f"steps={steps} examples={int(examples.result())} weight={int(weights.result())}", flush=True)
path = ds.Checkpoint(steps=torch.tensor(steps)).save(os.path.join(sys.argv[1], f"w{strategy.worker_index}", "ckpt"))
print(f"saved {path} exists={os.path.isfile(path + '.pt')}", flush=True)
