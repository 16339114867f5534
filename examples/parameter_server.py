"""Parameter-server training: TF's migration tutorial (seed 003) as a custom training loop.

Run it:

    python examples/parameter_server.py                                  # in-process cluster (threads), like the seed's notebook
    distrib launch --workers 3 --ps 2 examples/parameter_server.py       # one process per task; the chief runs this script
    distrib launch --workers 2 --ps 1 --max-restarts 1 examples/parameter_server.py --checkpoint-dir /tmp/ps_ckpt

The seed fits ``Dense(1)`` with ``Adagrad(0.05)`` and MSE on three examples,
``fit(epochs=5, steps_per_epoch=10)``, then ``evaluate(steps=10)``. Keras' ``fit`` drives
a ``ClusterCoordinator`` underneath; here the loop is written out: each step is a
function scheduled on some worker, and ``join()`` ends an epoch. Parameters live on
the ps tasks; the model on this process (the coordinator) reads them when called.
A checkpoint is written after every epoch, and a restarted run resumes from it.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import distrib as ds

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--steps-per-epoch", type=int, default=10)
parser.add_argument("--checkpoint-dir", default=None, help="resume from / save to this directory")
args = parser.parse_args()

# --- Set up: the seed's data --------------------------------------------------------------
features = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
labels = torch.tensor([[0.3], [0.5], [0.7]])
eval_features = torch.tensor([[4.0, 4.5], [5.0, 5.5], [6.0, 6.5]])
eval_labels = torch.tensor([[0.8], [0.9], [1.0]])

# --- The cluster: TF_CONFIG when launched, else an in-process one (threads), as the notebook ---
if ds.cluster_resolver.TFConfigClusterResolver.detect():
    cluster_resolver = ds.cluster_resolver.TFConfigClusterResolver()
else:
    # 3 workers and 2 parameter servers, each a ds.Server on a thread of this process
    cluster_resolver = ds.testing.create_in_process_cluster(num_workers=3, num_ps=2)

# --- The strategy; a partitioner would shard large parameters over the ps tasks -------------
strategy = ds.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=ds.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
)
print(f"ParameterServerStrategy with cluster_spec: {cluster_resolver.cluster_spec()}")

# --- Model, optimizer and loss built under the scope: their variables live on the ps tasks ----
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)

epoch = torch.tensor(0)
manager = None
if args.checkpoint_dir:
    manager = ds.CheckpointManager(
        ds.Checkpoint(model=model, optimizer=optimizer, epoch=epoch), args.checkpoint_dir, max_to_keep=2
    )
    if manager.restore_or_initialize():
        print(f"Restored from {manager.latest_checkpoint} (epoch {int(epoch)})")

coordinator = ds.coordinator.ClusterCoordinator(strategy)


# --- Input: from_tensor_slices((features, labels)).shuffle(10).repeat().batch(64), per worker ---
def dataset_fn(input_context):
    generator = torch.Generator().manual_seed(input_context.input_pipeline_id)
    while True:
        order = torch.randperm(len(features), generator=generator)
        yield features[order], labels[order]


def eval_dataset_fn():
    while True:  # from_tensor_slices((eval_features, eval_labels)).repeat().batch(1)
        for i in range(len(eval_features)):
            yield eval_features[i : i + 1], eval_labels[i : i + 1]


per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
per_worker_eval_iterator = iter(coordinator.create_per_worker_dataset(eval_dataset_fn))


# --- One step, as Keras' train_function: strategy.run inside a scheduled function ------------
def replica_fn(x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()  # gradients go to the ps tasks, which apply Adagrad there
    optimizer.zero_grad()
    return loss


def train_step(iterator):
    x, y = next(iterator)
    return strategy.reduce(ds.ReduceOp.SUM, strategy.run(replica_fn, args=(x, y)), axis=None)


def eval_step(iterator):
    x, y = next(iterator)
    with torch.no_grad():
        return F.mse_loss(model(x), y)


# --- model.fit(dataset, epochs=5, steps_per_epoch=10) ---------------------------------------
while int(epoch) < args.epochs:
    losses = [coordinator.schedule(train_step, args=(per_worker_iterator,)) for _ in range(args.steps_per_epoch)]
    coordinator.join()
    epoch += 1
    loss = sum(v.fetch().item() for v in losses) / len(losses)
    print(f"Epoch {int(epoch)}/{args.epochs}\n{args.steps_per_epoch}/{args.steps_per_epoch} - loss: {loss:.4f}")
    if manager is not None:
        manager.save()

# --- model.evaluate(eval_dataset, steps=10, return_dict=True) --------------------------------
eval_losses = coordinator.fetch([coordinator.schedule(eval_step, args=(per_worker_eval_iterator,)) for _ in range(10)])
print({"loss": round(sum(v.item() for v in eval_losses) / len(eval_losses), 6)})
print(f"Parameters (read from the ps tasks): {dict((k, v.tolist()) for k, v in model.state_dict().items())}")
if not os.environ.get("TF_CONFIG"):
    ds.testing.stop_in_process_cluster(cluster_resolver)
