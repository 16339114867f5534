"""Parameter-server training under any launcher: every task runs this script and takes its role.

    srun -n4 python tests/scripts/hosts_ps.py --slurm-jobs chief=1,ps=1,worker=2
    TF_CONFIG=... python tests/scripts/hosts_ps.py          # one process per task, on any host

``ps`` and ``worker`` tasks serve (``ds.Server``: on the spec's address, or where
``DISTRIB_BIND_ADDRESS`` says) until SIGTERM, then exit 0. The ``chief`` is the coordinator: it
schedules --steps training steps of a linear regression whose parameters live on the ps tasks;
under Slurm it then ends the job step (``scancel --signal=TERM``, which it ignores itself). It prints

    SERVING job=<ps|worker> task=<i> address=<spec address> listening=<bind address>[,<also>] hostname=<name>
    COORDINATOR steps=<n> workers_used=<hostname/pid,...> first_loss=<x> min_loss=<y> cluster=<spec>
"""

import argparse
import os
import signal
import socket
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--slurm-jobs", default=None, help="e.g. chief=1,ps=1,worker=2: SlurmClusterResolver(jobs=...)")
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

if args.slurm_jobs:
    jobs = {name: int(count) for name, count in (part.split("=") for part in args.slurm_jobs.split(","))}
    resolver = ds.cluster_resolver.SlurmClusterResolver(jobs=jobs)
else:
    resolver = ds.cluster_resolver.TFConfigClusterResolver()
spec = resolver.cluster_spec()

if resolver.task_type in ("ps", "worker"):
    server = ds.Server(spec, resolver.task_type, resolver.task_id)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=0))
    print(
        f"SERVING job={server.job_name} task={server.task_index} address={server.address} "
        f"listening={','.join([server.bind_address, *server.also_listening])} hostname={socket.gethostname()}",
        flush=True,
    )
    while not server.join(timeout=1.0):
        pass
    sys.exit(0)

strategy = ds.ParameterServerStrategy(resolver, connect_timeout=60)
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
coordinator = ds.coordinator.ClusterCoordinator(strategy)

g = torch.Generator().manual_seed(1)
features = torch.randn(64, 4, generator=g)
targets = features @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def train_step():
    loss = F.mse_loss(model(features), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), f"{socket.gethostname()}/{os.getpid()}"


results = [coordinator.schedule(train_step) for _ in range(args.steps)]
coordinator.join(timeout=120)
values = [r.fetch() for r in results]
losses = [float(loss) for loss, _ in values]
workers = sorted({where for _, where in values})
if args.slurm_jobs:  # end the step: the servers exit 0 on SIGTERM, the chief ignores it (docs/multi-node.md)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.run(
        ["scancel", "--signal=TERM", f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"],
        check=True,
        timeout=30,
    )
print(
    f"COORDINATOR steps={len(values)} workers_used={','.join(workers)} first_loss={losses[0]:.4f} "
    f"min_loss={min(losses):.4f} cluster={spec.as_dict()}",
    flush=True,
)
