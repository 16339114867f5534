"""Two workers train one model with PowerSGD on both gradient paths; the chief writes what each bucket held.

    distrib launch --workers 2 tests/scripts/powersgd_buckets.py --out OUT.json

For each path (``bucketed``: one replica per worker, the reducer overlapped with backward;
``replicas``: two local replicas per worker, summed locally then reduced), a fresh
MultiWorkerMirroredStrategy with ``CommunicationOptions(bytes_per_pack=BYTES,
compression=PowerSGD(rank=2, start_iter=START))`` trains a 2-layer MLP for STEPS steps
of SGD on seeded data (each worker its half of every global batch, each replica its
half of that). The strategy's hook is the one ``comm_hook()`` makes from those options
(what the strategy installs), wrapped to record each bucket it is handed:
``strategy.register_comm_hook`` is the public way in.

Per path the chief writes ``buckets`` (for each reduction, its bucket index and the
names of its parameters), ``steps`` (PowerSGD's reductions per bucket index, from
``PowerSGDHook.steps``), ``start_loss`` / ``loss`` on all the data, and ``params`` (the
trained parameters, as lists).
"""

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.comm import GradBucket

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

GLOBAL_BATCH = 32
WORKERS = 2
BYTES = 512  # [2.bias, 2.weight] is 660 bytes: a second bucket starts there (the default would make one)
START = 3
g = torch.Generator().manual_seed(0)
X = torch.randn(GLOBAL_BATCH * args.steps, 20, generator=g)
Y = (X[:, :5] * 3 + torch.randn(len(X), 5, generator=g)).argmax(1)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))


def full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(X), Y))


class Recording:
    """A comm hook that notes each bucket (index, parameter names) and hands it to ``inner``."""

    def __init__(self, inner: Any, names: dict[int, str]) -> None:
        self.inner, self.names, self.seen = inner, names, []

    def __call__(self, communicator: Any, bucket: GradBucket) -> Any:
        self.seen.append([bucket.index, [self.names[id(q)] for q in bucket.parameters]])
        return self.inner(communicator, bucket)


def train(devices: Any) -> dict:
    options = ds.CommunicationOptions(
        timeout_seconds=60, bytes_per_pack=BYTES, compression=ds.PowerSGD(rank=2, start_iter=START)
    )
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=options, devices=devices)
    assert strategy.num_workers == WORKERS
    with strategy.scope():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    powersgd = options.comm_hook()
    hook = Recording(powersgd, {id(q): name for name, q in model.named_parameters()})
    strategy.register_comm_hook(hook)
    replicas = strategy.num_local_replicas
    start_loss = full_loss(model)

    def step(x, y):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()

    per_worker = GLOBAL_BATCH // WORKERS
    per_replica = per_worker // replicas
    for s in range(args.steps):
        lo = s * GLOBAL_BATCH + strategy.worker_index * per_worker
        parts = [
            (X[lo + r * per_replica : lo + (r + 1) * per_replica], Y[lo + r * per_replica : lo + (r + 1) * per_replica])
            for r in range(replicas)
        ]
        if replicas == 1:
            strategy.run(step, args=parts[0])
        else:
            strategy.run(step, args=(ds.PerReplica([x for x, _ in parts]), ds.PerReplica([y for _, y in parts])))
    indices = sorted({index for index, _ in hook.seen})
    return {
        "chief": strategy.is_chief,
        "buckets": hook.seen,
        "steps": {i: powersgd.steps(i) for i in indices},
        "start_loss": start_loss,
        "loss": full_loss(model),
        "params": [q.detach().flatten().tolist() for q in model.parameters()],
    }


results = {"bucketed": train(None), "replicas": train(["cpu:0", "cpu:1"])}
for path, run in results.items():
    print(
        f"{path}: loss {run['start_loss']:.4f} -> {run['loss']:.4f}, buckets {run['buckets'][:2]}, "
        f"steps {run['steps']}",
        flush=True,
    )
if results["bucketed"]["chief"]:
    with open(args.out, "w") as f:
        json.dump(results, f)
