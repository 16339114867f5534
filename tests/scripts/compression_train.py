"""Two workers train the same small model with each compression; the chief writes what each one did.

    distrib launch --workers 2 tests/scripts/compression_train.py --out OUT.json

For each path (``bucketed``: one replica per worker, the reducer overlapped with backward;
``replicas``: two local replicas per worker, summed locally then reduced) and each
compression (none, bf16, fp16, PowerSGD rank 2 from step CHECK_STEP), a fresh
MultiWorkerMirroredStrategy trains a 2-layer MLP for STEPS steps of SGD on seeded data
(each worker its own half of every global batch, each replica its half of that).

Everything is read through public behaviour: the model's parameters and, after
``strategy.run`` returns, ``param.grad`` (the step's gradient summed over every replica
of every worker, as on one device). Per run the chief writes:

* ``loss``, ``start_loss``: the loss on all the data at the end and at the start;
* ``max_diff_vs_reference`` / ``max_diff_vs_none``: the largest parameter difference to
  plain one-process training on whole global batches, and to the uncompressed run;
* ``step``: at step CHECK_STEP (PowerSGD's first compressed one), ``param.grad`` against
  sums computed here by hand from every replica's own gradient (a plain copy of the model
  on that replica's slice): ``vs_exact`` (the fp32 sum), ``vs_hand`` (the sum as the
  compression should make it: each worker's local fp32 sum cast to bf16 and summed in bf16;
  for fp16 halved in fp16, summed in fp16, doubled in fp32; for PowerSGD, the exact sum
  projected onto the column space of what arrived, relative to the sum's largest value),
  ``ranks`` (of each weight matrix that arrived), ``within_rounding`` (every value within one
  unit of the cast type's last place, 2**-7 for bf16 and 2**-10 for fp16, of the summed
  magnitudes of the exact sum).
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=15)
args = p.parse_args()

GLOBAL_BATCH = 32
CHECK_STEP = 3
g = torch.Generator().manual_seed(0)
X = torch.randn(GLOBAL_BATCH * args.steps, 20, generator=g)
Y = (X[:, :5] * 3 + torch.randn(len(X), 5, generator=g)).argmax(1)
COMPRESSIONS = {"none": None, "bf16": "bf16", "fp16": "fp16", "powersgd": ds.PowerSGD(rank=2, start_iter=CHECK_STEP)}
WORKERS = 2


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))


def full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(X), Y))


def slices(step: int, worker: int, replicas: int) -> list[slice]:
    per_worker = GLOBAL_BATCH // WORKERS
    per_replica = per_worker // replicas
    lo = step * GLOBAL_BATCH + worker * per_worker
    return [slice(lo + r * per_replica, lo + (r + 1) * per_replica) for r in range(replicas)]


def hand_sums(state: dict, step: int, replicas: int) -> dict:
    """Every worker's local gradient sum (its replicas' fp32 gradients, added as the strategy documents) by hand."""
    local = []
    for w in range(WORKERS):
        total = None
        for s in slices(step, w, replicas):
            model = build()
            model.load_state_dict(state)
            ds.compute_average_loss(
                F.cross_entropy(model(X[s]), Y[s], reduction="none"), global_batch_size=GLOBAL_BATCH
            ).backward()
            grads = [q.grad for q in model.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        local.append(total)
    return {
        "exact": [a + b for a, b in zip(*local)],
        "magnitude": [a.abs() + b.abs() for a, b in zip(*local)],
        "bf16": [(a.bfloat16() + b.bfloat16()).float() for a, b in zip(*local)],
        "fp16": [((a.half() / WORKERS) + (b.half() / WORKERS)).float() * WORKERS for a, b in zip(*local)],
    }


def check_step(name: str, got: list, sums: dict) -> dict:
    exact = sums["exact"]
    out = {"vs_exact": max(float((a - e).abs().max()) for a, e in zip(got, exact)), "ranks": []}
    if name in ("none", "bf16", "fp16"):
        ref = exact if name == "none" else sums[name]
        out["vs_hand"] = max(float((a - r).abs().max()) for a, r in zip(got, ref))
        ulp = {"none": 2.0**-23, "bf16": 2.0**-7, "fp16": 2.0**-10}[name]
        out["within_rounding"] = all(
            bool(((a - e).abs() <= ulp * m).all()) for a, e, m in zip(got, exact, sums["magnitude"])
        )
        return out
    vs_hand = 0.0
    for a, e in zip(got, exact):
        if a.dim() < 2:  # biases are summed exactly
            vs_hand = max(vs_hand, float((a - e).abs().max()))
            continue
        rank = int(torch.linalg.matrix_rank(a))
        out["ranks"].append(rank)
        u = torch.linalg.svd(a.double(), full_matrices=False)[0][:, :2]  # the column space of what arrived
        projected = (u @ (u.t() @ e.double())).float()
        vs_hand = max(vs_hand, float((a - projected).abs().max() / e.abs().max()))
    out["vs_hand"] = vs_hand
    return out


def train(name: str, compression, devices):  # type: ignore[no-untyped-def]
    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.CommunicationOptions(timeout_seconds=60, compression=compression), devices=devices
    )
    assert strategy.num_workers == WORKERS
    with strategy.scope():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replicas = strategy.num_local_replicas

    def step(x, y):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()  # after run returns, param.grad holds this step's summed gradient

    checked: dict = {}
    for s in range(args.steps):
        parts = [(X[sl], Y[sl]) for sl in slices(s, strategy.worker_index, replicas)]
        sums = (
            hand_sums({k: v.detach().clone() for k, v in model.state_dict().items()}, s, replicas)
            if s == CHECK_STEP
            else None
        )
        if len(parts) == 1:
            strategy.run(step, args=parts[0])
        else:
            strategy.run(step, args=(ds.PerReplica([x for x, _ in parts]), ds.PerReplica([y for _, y in parts])))
        if sums is not None:
            checked = check_step(name, [q.grad.detach().clone() for q in model.parameters()], sums)
    return strategy, [t.detach().clone() for t in model.parameters()], full_loss(model), checked


def reference() -> list[torch.Tensor]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(args.steps):
        x, y = X[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH], Y[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
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
        strategy, params[name], loss, checked = train(name, compression, devices)
        chief = strategy.is_chief
        runs[name] = {
            "loss": loss,
            "start_loss": start_loss,
            "max_diff_vs_reference": max_diff(params[name], expected),
            "max_diff_vs_none": max_diff(params[name], params["none"] if "none" in params else params[name]),
            "step": checked,
        }
        print(
            f"{path} {name}: loss {start_loss:.4f} -> {loss:.4f}, "
            f"max |param - uncompressed| {runs[name]['max_diff_vs_none']:.2e}, step {CHECK_STEP}: {checked}",
            flush=True,
        )
    results[path] = runs
if chief:
    with open(args.out, "w") as f:
        json.dump(results, f)
