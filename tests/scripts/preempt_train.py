"""A worker script for the preemption tests: TF's custom loop around PreemptionCheckpointHandler.run.

    distrib launch --workers 2 tests/scripts/preempt_train.py --out OUT --checkpoint-dir DIR
        [--notice-at STEP --notice-worker W --notice-to self|launcher] [--signal TERM|USR1] [--strategy sharded]

Trains EPOCHS x STEPS of a small CNN with Adam on seeded data under MultiWorkerMirroredStrategy (or
ShardedStrategy, whose checkpoints are then the sharded format: each worker writes its own shards),
every step through ``handler.run``; the data position is ``handler.total_run_calls`` (TF's guide).
On the first attempt (``DISTRIB_RESTART=0``), when the run count reaches --notice-at, worker
--notice-worker sends the signal to itself (``self``) or to its parent, the launcher
(``launcher``). Machine-readable lines, parsed by the tests:

    NOTICE worker=W run=N t=UNIX_TIME       the signal was sent
    START worker=W restart=R run=N          the handler restored run N (0: fresh)
    EXIT worker=W restart=R runs=N t=TIME   at interpreter exit: the runs this attempt's process completed
The chief writes the final parameters to --out.
"""

import argparse
import atexit
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.app.train import TensorBatches

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--checkpoint-dir", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=16)
p.add_argument("--examples", type=int, default=160)
p.add_argument("--notice-at", type=int, default=-1)
p.add_argument("--notice-worker", type=int, default=1)
p.add_argument("--notice-to", choices=("self", "launcher"), default="self")
p.add_argument("--signal", default="TERM")
p.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in every step (a slower step)")
p.add_argument("--strategy", choices=("mwms", "sharded"), default="mwms")
args = p.parse_args()

restart = int(os.environ.get("DISTRIB_RESTART", "0"))
options = ds.CommunicationOptions(timeout_seconds=60)
strategy = (
    ds.MultiWorkerMirroredStrategy(communication_options=options)
    if args.strategy == "mwms"
    else ds.ShardedStrategy(
        communication_options=options, devices=["cpu"], sharding_policy=ds.ShardingPolicy(min_params=40)
    )
)

g = torch.Generator().manual_seed(0)
images = torch.randn(args.examples, 1, 8, 8, generator=g)
labels = torch.randint(0, 10, (args.examples,), generator=g)
data = TensorBatches(images, labels, batch_size=args.global_batch, shuffle=True, seed=5)
dist_data = strategy.experimental_distribute_dataset(data)

with strategy.scope():
    torch.manual_seed(strategy.worker_index * 1000)  # differs per worker: the strategy must make them equal
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
checkpoint = ds.Checkpoint(model=model, optimizer=optimizer)
sig = getattr(signal, f"SIG{args.signal}")
handler = ds.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, checkpoint, args.checkpoint_dir, ds.experimental.TerminationConfig(signals=sig)
)
me = strategy.worker_index
print(f"START worker={me} restart={restart} run={handler.total_run_calls}", flush=True)
begun = handler.total_run_calls
atexit.register(
    lambda: print(f"EXIT worker={me} restart={restart} runs={handler.total_run_calls} t={time.time():.4f}", flush=True)
)


def step(inputs):
    x, y = inputs
    loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=args.global_batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if args.step_seconds:
        time.sleep(args.step_seconds)
    return loss


def train_step(iterator):
    return strategy.run(step, args=(next(iterator),))


steps_per_epoch = len(data)
for epoch in range(handler.total_run_calls // steps_per_epoch, args.epochs):
    data.set_epoch(epoch)
    iterator = iter(dist_data)
    for _ in range(handler.total_run_calls % steps_per_epoch):
        next(iterator)
    for _ in range(handler.total_run_calls % steps_per_epoch, steps_per_epoch):
        if handler.total_run_calls == args.notice_at and restart == 0 and me == args.notice_worker:
            print(f"NOTICE worker={me} run={handler.total_run_calls} t={time.time():.4f}", flush=True)
            os.kill(os.getpid() if args.notice_to == "self" else os.getppid(), sig)
        handler.run(train_step, iterator)
whole = strategy.checkpoint_state(model)  # the whole parameters (gathered from the shards under "sharded")
if strategy.is_chief:
    torch.save(list(whole.values()), args.out)
print(f"done: worker {me} of {strategy.num_workers}", flush=True)
