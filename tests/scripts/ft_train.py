"""A worker script for the fault-tolerance tests: seeded training that a lost worker must not change.

    distrib launch --workers 3 --fault-tolerant tests/scripts/ft_train.py --out DIR [--fault KIND --at STEP]

Trains --steps steps of a small MLP with SGD and momentum on seeded global batches, the loss summed over
the global batch (compute_average_loss with global_batch_size), fed by experimental_distribute_dataset.
Worker --victim (default 2) makes the fault at step --at:

* ``kill``: SIGKILL itself before its step;
* ``kill-in-allreduce``: SIGKILL itself inside the gradient all-reduce, after its first bucket was sent;
* ``wait``: print ``victim waiting`` and sleep 30 s before its step, while the others wait in the all-reduce
  (the test kills it from outside);
* ``stop``: SIGSTOP itself; a helper continues it (SIGCONT) --resume-after seconds later;
* ``kill-before-reduce``: SIGKILL itself after its step, before the step's ``strategy.reduce`` (--reduce-loss).

``--then W:S``: worker W SIGKILLs itself before step S too (a second fault). ``--reduce-loss``: every step's loss
is summed with ``strategy.reduce`` between steps and printed (``loss STEP VALUE``).

Every survivor prints one line per applied step (``applied STEP at TIME``, wall clock) and at the end
``done: worker ID pid PID members [...] generation G`` and writes its parameters to DIR/worker-ID.pt.
Without --fault-tolerant the plain strategy runs (the fault-free reference).
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import torch
from torch import nn

import distrib as ds
from distrib.comm import allreduce_hook

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--global-batch", type=int, default=24)
p.add_argument("--timeout", type=float, default=1.0)
p.add_argument(
    "--fault", choices=("none", "kill", "kill-in-allreduce", "wait", "stop", "kill-before-reduce"), default="none"
)
p.add_argument("--then", default=None, metavar="WORKER:STEP")
p.add_argument("--reduce-loss", action="store_true")
p.add_argument("--bucket-bytes", type=int, default=256, help="gradient bucket size (256: several buckets)")
p.add_argument("--skew-data", action="store_true", help="worker 1 reads other global batches (a mistake)")
p.add_argument("--width", type=int, default=32, help="the hidden layers' width")
p.add_argument("--at", type=int, default=4)
p.add_argument("--victim", type=int, default=2)
p.add_argument("--resume-after", type=float, default=4.0)
p.add_argument("--plain", action="store_true", help="the strategy without fault tolerance (the reference)")
args = p.parse_args()

options = ds.CommunicationOptions(timeout_seconds=args.timeout, bytes_per_pack=args.bucket_bytes)
strategy = ds.MultiWorkerMirroredStrategy(communication_options=options, fault_tolerant=not args.plain)
me = strategy.worker_index
victim = me == args.victim
print(f"start: worker {me} pid {os.getpid()} restart {os.environ.get('DISTRIB_RESTART')}", flush=True)

g = torch.Generator().manual_seed(1 if args.skew_data and me == 1 else 0)
xs = torch.randn(args.steps * args.global_batch, 16, generator=g)
ys = torch.randn(args.steps * args.global_batch, 4, generator=g)
batches = [(xs[i : i + args.global_batch], ys[i : i + args.global_batch]) for i in range(0, len(xs), args.global_batch)]
dist_data = strategy.experimental_distribute_dataset(batches)

with strategy.scope():
    torch.manual_seed(1)
    w = args.width
    model = nn.Sequential(nn.Linear(16, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

step = 0


def kill_in_allreduce(communicator, bucket):
    """allreduce_hook; on the victim at the fault's step, SIGKILL once the first bucket is on its way."""
    future = allreduce_hook(communicator, bucket)
    if step == args.at and bucket.index == (1 if args.bucket_bytes else 0):  # the second bucket where several
        print(f"fault at {time.time():.6f}", flush=True)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return future


if victim and args.fault == "kill-in-allreduce":
    strategy.register_comm_hook(kill_in_allreduce)


def train_step(batch):
    x, y = batch
    if victim and step == args.at and args.fault == "wait":
        print("victim waiting", flush=True)
        time.sleep(30)
    per_example = ((model(x) - y) ** 2).sum(dim=1)
    loss = ds.compute_average_loss(per_example, global_batch_size=args.global_batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


for batch in dist_data:
    if victim and step == args.at:
        if args.fault == "kill":
            print(f"fault at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == "stop":
            print(f"fault at {time.time():.6f}", flush=True)
            subprocess.Popen(["sh", "-c", f"sleep {args.resume_after}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            print("victim continued", flush=True)
    if args.then and [me, step] == [int(v) for v in args.then.split(":")]:
        print(f"second fault at {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    losses = strategy.run(train_step, args=(batch,))
    print(f"applied {step} at {time.time():.6f}", flush=True)
    if victim and step == args.at and args.fault == "kill-before-reduce":
        print(f"fault at {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.reduce_loss:
        print(f"loss {step} {float(strategy.reduce('SUM', losses, axis=None)):.6f}", flush=True)
    step += 1

comm = strategy.communicator
members = list(getattr(comm, "members", range(strategy.num_workers)))
generation = getattr(comm, "generation", 0)
os.makedirs(args.out, exist_ok=True)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(args.out, f"worker-{me}.pt"))
print(f"done: worker {me} pid {os.getpid()} members {members} generation {generation}", flush=True)
sys.exit(0)
