"""Training whose math does not depend on the number of workers: for the resize and torchrun tests.

    distrib launch --workers 2 tests/scripts/resize_train.py --out OUT --checkpoint-dir DIR [--stop-at S]
    torchrun ... tests/scripts/resize_train.py --out OUT --checkpoint-dir DIR [--die-at S --die-rank R --die-once F]

Global batches of GLOBAL_BATCH examples (any number of workers splits each one), a global data
position (epoch, step_in_epoch) in the checkpoint, gradients summed over every worker: a job
stopped on N workers and resumed on M ends as if it had never stopped. Every step is
checkpointed (the chief writes). Options:

--stop-at S     every worker exits 0 once global step S is trained and checkpointed
--die-at S      worker --die-rank (a global rank) is killed with SIGKILL before global step S, once: the
                file --die-once is made first, so a restarted job does not die again; with --with-agent
                its parent (torchrun's agent) is killed first: the worker's host is lost for good
--step-delay T  sleep T seconds after each step (to let a test act while the job runs)
--hold-at S     a job running on ONE worker waits before global step S (at most 120 s) for the job to grow:
                torchrun's elastic agent restarts its worker when a second agent joins
--all-ranks     every worker also writes its final parameters to OUT.<worker index>

The chief prints ``step G on N workers`` for every step and writes the final parameters to --out.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds


class TensorBatches:
    """Global batches sliced from in-memory tensors, reshuffled each epoch as a function of (seed, epoch)."""

    def __init__(self, *tensors, batch_size, shuffle=False, seed=0):
        self.tensors, self.batch_size, self.shuffle, self.seed, self.epoch = tensors, batch_size, shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return -(-len(self.tensors[0]) // self.batch_size)

    def __iter__(self):
        n = len(self.tensors[0])
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        data = tuple(t[order] for t in self.tensors) if self.shuffle else self.tensors
        for start in range(0, n, self.batch_size):
            yield tuple(t[start : start + self.batch_size] for t in data)


p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--checkpoint-dir", default=None)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--global-batch", type=int, default=12)
p.add_argument("--examples", type=int, default=96)
p.add_argument("--stop-at", type=int, default=-1)
p.add_argument("--die-at", type=int, default=-1)
p.add_argument("--die-rank", type=int, default=-1)
p.add_argument("--die-once", default=None)
p.add_argument("--with-agent", action="store_true")
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--timeout", type=float, default=60.0)
p.add_argument("--all-ranks", action="store_true")
p.add_argument("--hold-at", type=int, default=-1)
args = p.parse_args()

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=args.timeout))

g = torch.Generator().manual_seed(0)
images = torch.randn(args.examples, 1, 8, 8, generator=g)
labels = torch.randint(0, 10, (args.examples,), generator=g)
data = TensorBatches(images, labels, batch_size=args.global_batch, shuffle=True, seed=5)
dist_data = strategy.experimental_distribute_dataset(data)

with strategy.scope():
    torch.manual_seed(1 + strategy.worker_index)  # differs per worker: the chief's values are broadcast
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
epoch = torch.tensor(0)
step_in_epoch = torch.tensor(0)
checkpoint = ds.Checkpoint(model=model, optimizer=optimizer, epoch=epoch, step_in_epoch=step_in_epoch)
manager = ds.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
steps_per_epoch = len(data)
if manager and manager.latest_checkpoint:
    checkpoint.restore(manager.latest_checkpoint)
    if strategy.is_chief:
        print(
            f"resumed at step {int(epoch) * steps_per_epoch + int(step_in_epoch)} on {strategy.num_workers} workers",
            flush=True,
        )


def step(inputs):
    x, y = inputs
    loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=args.global_batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def die() -> None:
    with open(args.die_once, "w") as f:
        f.write(str(os.getpid()))
    print(f"rank {strategy.worker_index} dies before step {args.die_at}", flush=True)
    if args.with_agent:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


while int(epoch) < args.epochs:
    data.set_epoch(int(epoch))
    iterator = iter(dist_data)
    for _ in range(int(step_in_epoch)):
        next(iterator)
    end_of_epoch = False
    while not end_of_epoch:
        global_step = int(epoch) * steps_per_epoch + int(step_in_epoch)
        if (
            global_step == args.die_at
            and strategy.worker_index == args.die_rank
            and args.die_once
            and not os.path.exists(args.die_once)
        ):
            die()
        if global_step == args.hold_at and strategy.num_workers == 1:
            print(f"holding before step {global_step} on 1 worker, for the job to grow", flush=True)
            time.sleep(120)
        strategy.run(step, args=(next(iterator),))
        end_of_epoch = int(step_in_epoch) + 1 == steps_per_epoch
        if end_of_epoch:  # the checkpoint holds the position of the next step
            epoch += 1
            step_in_epoch.zero_()
        else:
            step_in_epoch += 1
        if manager:
            manager.save()
        if strategy.is_chief:
            print(f"step {global_step} on {strategy.num_workers} workers", flush=True)
        if global_step == args.stop_at:
            print(f"stopped after step {global_step}", flush=True)
            raise SystemExit(0)
        time.sleep(args.step_delay)
if strategy.is_chief:
    torch.save([p.detach() for p in model.parameters()], args.out)
if args.all_ranks:
    torch.save([p.detach() for p in model.parameters()], f"{args.out}.{strategy.worker_index}")
print(f"done: worker {strategy.worker_index} of {strategy.num_workers}", flush=True)
