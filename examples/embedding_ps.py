"""A click-through-rate model with a large embedding table split over parameter servers.

Run it:

    python examples/embedding_ps.py                                           # in-process cluster: 2 workers, 2 ps
    distrib launch --workers 2 --ps 2 examples/embedding_ps.py --rows 1000000 # one process per task
    python examples/embedding_ps.py --dense                                   # the same with dense gradients, to compare bytes

Each example has 6 categorical fields (ids in one shared vocabulary of ``--rows``
entries, skewed so that few ids are frequent, as in real click logs) and 4 dense
features; the label is drawn from a hidden logistic model, so there is something
to learn. The table is an ``nn.Embedding(rows, 16, sparse=True)``: built under the
strategy's scope, it is split along dim 0 into shards of at most 4 MB
(``MaxSizePartitioner``) placed round robin on the ps tasks. Each step sends to the
ps tasks only the rows the batch touched, and Adagrad's state lives beside each
shard. Batches are drawn on the workers (a per-worker dataset); the coordinator only
schedules steps and, at the end, evaluates the model it reads from the ps tasks.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=200_000, help="vocabulary size (embedding rows)")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--dense", action="store_true", help="dense embedding gradients (the whole table every step)")
args = parser.parse_args()

FIELDS, DENSE, DIM = 6, 4, 16


def draw_batch(generator: torch.Generator, batch: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, dense features and clicks from a fixed hidden model (the same on every worker)."""
    truth = torch.Generator().manual_seed(1234)
    row_weight = torch.randn(rows, generator=truth) * 1.5
    dense_weight = torch.randn(DENSE, generator=truth)
    ids = (torch.rand(batch, FIELDS, generator=generator) ** 3 * rows).long()
    dense = torch.randn(batch, DENSE, generator=generator)
    logit = row_weight[ids].sum(1) / math.sqrt(FIELDS) + dense @ dense_weight - 1.0
    clicks = (torch.rand(batch, generator=generator) < torch.sigmoid(logit)).float()
    return ids, dense, clicks


class ClickThroughModel(nn.Module):
    def __init__(self, rows: int, sparse: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(rows, DIM, sparse=sparse)
        nn.init.normal_(self.embedding.weight, std=0.01)
        self.mlp = nn.Sequential(nn.Linear(FIELDS * DIM + DENSE, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.embedding(ids).flatten(1), dense], 1)).squeeze(1)


if ds.cluster_resolver.TFConfigClusterResolver.detect():
    cluster_resolver = ds.cluster_resolver.TFConfigClusterResolver()
else:
    cluster_resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=2)

strategy = ds.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=ds.partitioners.MaxSizePartitioner(max_shard_bytes=4 << 20)
)
with strategy.scope():
    model = ClickThroughModel(args.rows, sparse=not args.dense)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
shards = strategy.variable_placement(model)["embedding.weight"]
print(
    f"embedding {args.rows} x {DIM} in {len(shards)} shard(s) on ps tasks {sorted({ps for ps, _, _ in shards})}: "
    + ", ".join(f"rows {lo}:{hi} -> ps {ps}" for ps, lo, hi in shards[:4])
    + (" ..." if len(shards) > 4 else "")
)

coordinator = ds.coordinator.ClusterCoordinator(strategy)


def dataset_fn(input_context):
    generator = torch.Generator().manual_seed(100 + input_context.input_pipeline_id)  # each worker its own stream
    while True:
        yield draw_batch(generator, args.batch_size, args.rows)


iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


def train_step(it):
    ids, dense, clicks = next(it)
    loss = F.binary_cross_entropy_with_logits(model(ids, dense), clicks)
    loss.backward()
    optimizer.step()  # only the touched rows of the table travel (sparse=True)
    optimizer.zero_grad()
    return loss.detach()


start = time.perf_counter()
report = max(1, args.steps // 5)
for first in range(0, args.steps, report):
    losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(min(report, args.steps - first))]
    coordinator.join()
    mean = sum(v.fetch().item() for v in losses) / len(losses)
    print(
        f"steps {first + len(losses):>5}: loss {mean:.4f}  ({(first + len(losses)) / (time.perf_counter() - start):.1f} steps/s)"
    )

stats = coordinator.worker_stats()
sent = sum(s.get("ps_bytes_sent", 0) for s in stats)
print(
    f"workers sent {sent / args.steps / 1e3:.1f} KB per step to the ps tasks "
    f"({'dense' if args.dense else 'sparse'} embedding gradients; the table is {args.rows * DIM * 4 / 1e6:.1f} MB)"
)

# Evaluate on the coordinator: calling the model reads the current parameters from the ps tasks.
ids, dense, clicks = draw_batch(torch.Generator().manual_seed(7), 4096, args.rows)
with torch.no_grad():
    log_loss = F.binary_cross_entropy_with_logits(model(ids, dense), clicks).item()
    rate = clicks.mean().clamp(1e-6, 1 - 1e-6)
    baseline = F.binary_cross_entropy(rate.expand_as(clicks), clicks).item()
print(f"held-out log loss {log_loss:.4f} (predicting the mean click rate: {baseline:.4f})")
if not ds.cluster_resolver.TFConfigClusterResolver.detect():
    ds.testing.stop_in_process_cluster(cluster_resolver)
