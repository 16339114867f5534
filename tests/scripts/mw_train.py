"""A worker script for the multi-worker tests: seeded training, exact resume, optional self-kill.

    distrib launch --workers 2 [--max-restarts 1] tests/scripts/mw_train.py --out OUT [--kill-at STEP]

Trains EPOCHS x STEPS of a small CNN with Adam on seeded data under the strategy named by
--strategy (multi-worker: from TF_CONFIG). Every step it checkpoints model, optimizer, epoch and
step_in_epoch; on start it resumes from the latest checkpoint, skipping the batches of the
current epoch that were already trained (the shuffle order is a function of seed and epoch).
With --kill-at S, worker 1 kills itself with SIGKILL at global step S on the first attempt.
The chief writes the final parameters to --out.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.app.train import TensorBatches

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--strategy", default="multi-worker")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=16)
p.add_argument("--examples", type=int, default=96)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--checkpoint-dir", default=None)
args = p.parse_args()

if args.strategy == "multi-worker":
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
elif args.strategy == "multi-worker2":  # two logical replicas on every worker: merged locally, then reduced
    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.CommunicationOptions(timeout_seconds=60), devices=["cpu:0", "cpu:1"]
    )
elif args.strategy == "mirrored2":
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
else:
    strategy = ds.get_strategy()

g = torch.Generator().manual_seed(0)
images = torch.randn(args.examples, 1, 8, 8, generator=g)
labels = torch.randint(0, 10, (args.examples,), generator=g)
data = TensorBatches(images, labels, batch_size=args.global_batch, shuffle=True, seed=5)
dist_data = strategy.experimental_distribute_dataset(data)

with strategy.scope():
    torch.manual_seed(int(os.environ.get("SEED_OFFSET", "0")) + strategy.worker_index * 1000)  # differs per worker
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
epoch = torch.tensor(0)
step_in_epoch = torch.tensor(0)
checkpoint = ds.Checkpoint(model=model, optimizer=optimizer, epoch=epoch, step_in_epoch=step_in_epoch)
manager = ds.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
if manager and manager.latest_checkpoint:
    checkpoint.restore(manager.latest_checkpoint)
    print(f"resumed at epoch {int(epoch)} step {int(step_in_epoch)}", flush=True)


def step(inputs):
    x, y = inputs
    loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=args.global_batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


steps_per_epoch = len(data)
while int(epoch) < args.epochs:
    data.set_epoch(int(epoch))
    iterator = iter(dist_data)
    for _ in range(int(step_in_epoch)):
        next(iterator)
    while int(step_in_epoch) < steps_per_epoch:
        global_step = int(epoch) * steps_per_epoch + int(step_in_epoch)
        if global_step == args.kill_at and os.environ.get("DISTRIB_RESTART") == "0" and strategy.worker_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        strategy.run(step, args=(next(iterator),))
        step_in_epoch += 1
        if manager:
            manager.save()
    epoch += 1
    step_in_epoch.zero_()
if strategy.is_chief:
    torch.save([p.detach() for p in model.parameters()], args.out)
print(
    f"done: worker {strategy.worker_index} of {strategy.num_workers}, {strategy.num_replicas_in_sync} replicas in sync",
    flush=True,
)
