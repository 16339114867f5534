"""MultiWorkerMirroredStrategy under any launcher (Slurm's srun/sbatch, TF_CONFIG, torchrun), checked in place.

    srun -n2 python tests/scripts/hosts_mw.py [--steps 3] [--mark DIR/a --wait-for DIR/b]

The strategy finds the cluster itself (`ds.MultiWorkerMirroredStrategy()`: TF_CONFIG, torchrun's
variables or Slurm's). Every worker trains a linear model with SGD on its share of seeded global
batches, then compares its parameters with the same steps computed here on whole batches without
any strategy (summed per-example gradients / global batch = the full batch's mean). It prints

    RESOLVED <resolver> task=<type>:<id> rank=<r> world=<n> rendezvous=<host:port> hostname=<name> ifname=<gloo's>
    RESULT rank=<r> world=<n> hostname=<name> digest=<hex of the parameters> max_diff=<vs the reference>

--mark/--wait-for make two jobs overlap in time: once its strategy exists (its rendezvous port is
bound) each worker creates ``<mark>.<rank>`` and waits (at most 60 s) for ``<wait-for>.<rank>``.
"""

import argparse
import hashlib
import os
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--timeout", type=float, default=60)
p.add_argument("--mark", default=None)
p.add_argument("--wait-for", default=None)
args = p.parse_args()

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=args.timeout))
resolver = strategy.cluster_resolver
rank, world = strategy.worker_index, strategy.num_workers
print(
    f"RESOLVED {type(resolver).__name__} task={resolver.task_type}:{resolver.task_id} rank={rank} world={world} "
    f"rendezvous={resolver.rendezvous_address()} hostname={socket.gethostname()} "
    f"ifname={os.environ.get('GLOO_SOCKET_IFNAME') or '-'}",
    flush=True,
)  # the interface distrib chose, or the user

if args.mark:
    open(f"{args.mark}.{rank}", "w").close()
if args.wait_for:
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{args.wait_for}.{rank}"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.wait_for}.{rank} did not appear within 60 s: the other job never ran alongside")
        time.sleep(0.05)

g = torch.Generator().manual_seed(0)
n = args.global_batch * args.steps
features = torch.randn(n, 4, generator=g)
targets = features @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
batches = [
    (features[i : i + args.global_batch], targets[i : i + args.global_batch]) for i in range(0, n, args.global_batch)
]


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(4, 1)


with strategy.scope():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(inputs):
    x, y = inputs
    loss = ds.compute_average_loss(
        F.mse_loss(model(x), y, reduction="none").mean(1), global_batch_size=args.global_batch
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


for batch in strategy.experimental_distribute_dataset(batches):
    strategy.run(step, args=(batch,))

reference = make_model()
ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for x, y in batches:
    F.mse_loss(reference(x), y).backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()

params = [p.detach().clone() for p in model.parameters()]
diff = max((a - b).abs().max().item() for a, b in zip(params, reference.parameters()))
digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()[:16]
print(
    f"RESULT rank={rank} world={world} hostname={socket.gethostname()} digest={digest} max_diff={diff:.3g}", flush=True
)
