"""Two workers train the same small model with each compression; the chief writes how far each ended up.

    distrib launch --workers 2 tests/scripts/compression_train.py --out OUT.json

For each path (``bucketed``: one replica per worker, the reducer overlapped with backward;
``replicas``: two local replicas per worker, summed locally then reduced) and each
compression (none, bf16, fp16, PowerSGD rank 2 from step 3), a fresh
MultiWorkerMirroredStrategy trains a 2-layer MLP for STEPS steps of SGD on seeded data
(each worker its own half of every global batch). The chief also trains the same model
in one plain process on the whole global batches (the reference) and writes, per run:
the final loss on all the data, the loss at the start, the largest parameter difference
to the uncompressed run and to the reference.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=30)
args = p.parse_args()

GLOBAL_BATCH = 32
g = torch.Generator().manual_seed(0)
X = torch.randn(GLOBAL_BATCH * args.steps, 20, generator=g)
Y = (X[:, :5] * 3 + torch.randn(len(X), 5, generator=g)).argmax(1)
COMPRESSIONS = {"none": None, "bf16": "bf16", "fp16": "fp16", "powersgd": ds.PowerSGD(rank=2, start_iter=3)}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))


def full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(X), Y))


def train(compression, devices):  # type: ignore[no-untyped-def]
    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.CommunicationOptions(timeout_seconds=60, compression=compression), devices=devices)
    with strategy.scope():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_worker = GLOBAL_BATCH // strategy.num_workers
    per_replica = per_worker // strategy.num_local_replicas

    def step(x, y):  # type: ignore[no-untyped-def]
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for s in range(args.steps):
        lo = s * GLOBAL_BATCH + strategy.worker_index * per_worker
        parts = [(X[lo + r * per_replica:lo + (r + 1) * per_replica], Y[lo + r * per_replica:lo + (r + 1) * per_replica])
                 for r in range(strategy.num_local_replicas)]
        if len(parts) == 1:
            strategy.run(step, args=parts[0])
        else:
            strategy.run(step, args=(ds.PerReplica([x for x, _ in parts]), ds.PerReplica([y for _, y in parts])))
    return strategy, [t.detach().clone() for t in model.parameters()], full_loss(model)


def reference() -> list[torch.Tensor]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(args.steps):
        x, y = X[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], Y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [t.detach() for t in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


results: dict = {}
start_loss = full_loss(build())
expected = reference()
chief = True
for path, devices in (("bucketed", None), ("replicas", ["cpu:0", "cpu:1"])):
    runs: dict = {}
    params: dict = {}
    for name, compression in COMPRESSIONS.items():
        strategy, params[name], loss = train(compression, devices)
        chief = strategy.is_chief
        runs[name] = {"loss": loss, "start_loss": start_loss, "max_diff_vs_reference": max_diff(params[name], expected),
                      "max_diff_vs_none": max_diff(params[name], params["none"] if "none" in params else params[name])}
        print(f"{path} {name}: loss {start_loss:.4f} -> {loss:.4f}, "
              f"max |param - uncompressed| {runs[name]['max_diff_vs_none']:.2e}", flush=True)
    results[path] = runs
if chief:
    with open(args.out, "w") as f:
        json.dump(results, f)
