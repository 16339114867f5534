"""Custom training loop with MultiWorkerMirroredStrategy: TF's tutorial (seed 001) translated.

Run two workers on this machine (distrib launch gives each its TF_CONFIG):

    distrib launch --workers 2 examples/multi_worker_ctl.py
    distrib launch --workers 2 examples/multi_worker_ctl.py --data-dir /path/to/mnist-idx   # MNIST instead
    distrib launch --workers 2 --max-restarts 1 examples/multi_worker_ctl.py   # resumes after a failure

or start them by hand, one TF_CONFIG each, as the tutorial does:

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}' \
        python examples/multi_worker_ctl.py &
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}' \
        python examples/multi_worker_ctl.py

Without TF_CONFIG it trains as a single worker. The tutorial's chief/temp-directory
checkpoint logic (`_is_chief`, `_get_temp_dir`, `write_filepath`, deleting the
non-chief's copy) is not needed: every worker calls `save` with the same directory, and
distrib writes on the chief only. Kept as written it runs too (the other workers write
their copies into their temporary directories, which the tutorial then deletes; see
tests/scripts/keras_tutorial_worker.py).
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds
from distrib.app.datasets import load_fashion_mnist
from distrib.app.train import TensorBatches

parser = argparse.ArgumentParser()
parser.add_argument("--data-dir", default=None, help="IDX files (default: Debian's Fashion-MNIST)")
parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "distrib-ckpt"))
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=70)
args = parser.parse_args()


# --- mnist.py: the dataset and the model ---------------------------------------------------
def mnist_dataset():
    (x_train, y_train), _ = load_fashion_mnist(args.data_dir)  # floats in [0, 1], int64 labels
    return x_train.squeeze(1), y_train


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x, y = mnist_dataset()
    # shard: this worker keeps every num_input_pipelines-th example
    x = x[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    y = y[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    # shuffled by (seed, epoch), so a restarted worker can find its place again
    return TensorBatches(x, y, batch_size=batch_size, shuffle=True, seed=input_context.input_pipeline_id)


def build_cnn_model():
    return nn.Sequential(
        nn.Unflatten(1, (1, 28)),  # Reshape(target_shape=(28, 28, 1)), channels first
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 26 * 26, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


# --- MultiWorkerMirroredStrategy -----------------------------------------------------------
strategy = ds.MultiWorkerMirroredStrategy()  # reads TF_CONFIG

with strategy.scope():
    # Model building needs to be within `strategy.scope()`.
    multi_worker_model = build_cnn_model()

# --- Shard the data between workers --------------------------------------------------------
per_worker_batch_size = 64
num_workers = strategy.num_replicas_in_sync // strategy.num_local_replicas
global_batch_size = per_worker_batch_size * num_workers

datasets = []  # keep this worker's pipeline to set its epoch


def make_dataset(input_context):
    datasets.append(dataset_fn(global_batch_size, input_context))
    return datasets[-1]


with strategy.scope():
    multi_worker_dataset = strategy.distribute_datasets_from_function(make_dataset)

# --- Define the custom training loop and train the model ----------------------------------
with strategy.scope():
    # The optimizer and train_accuracy must be created in `strategy.scope()` as well.
    optimizer = torch.optim.RMSprop(multi_worker_model.parameters(), lr=0.001, alpha=0.9, eps=1e-7)  # Keras' RMSprop
    train_accuracy = ds.metrics.SparseCategoricalAccuracy(name="train_accuracy")


def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
        """Per-Replica step function."""
        x, y = inputs
        predictions = multi_worker_model(x)
        per_batch_loss = F.cross_entropy(predictions, y, reduction="none")
        loss = ds.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train_accuracy.update_state(y, predictions)
        return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)


# --- Checkpoint saving and restoring -------------------------------------------------------
epoch = torch.tensor(0)
step_in_epoch = torch.tensor(0)
task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id

checkpoint = ds.Checkpoint(model=multi_worker_model, optimizer=optimizer, epoch=epoch, step_in_epoch=step_in_epoch)
# Every worker uses the same directory: only the chief writes to it.
checkpoint_manager = ds.CheckpointManager(checkpoint, directory=args.checkpoint_dir, max_to_keep=1)

latest_checkpoint = ds.latest_checkpoint(args.checkpoint_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)

num_epochs = args.epochs
num_steps_per_epoch = args.steps_per_epoch

while int(epoch) < num_epochs:
    datasets[0].set_epoch(int(epoch))
    iterator = iter(multi_worker_dataset)
    for _ in range(int(step_in_epoch)):  # exact resume: skip what this epoch already trained on
        next(iterator)
    total_loss = 0.0
    num_batches = 0

    while int(step_in_epoch) < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch += 1
        if int(step_in_epoch) % 10 == 0:
            checkpoint_manager.save()  # every worker calls it; the chief alone writes

    train_loss = total_loss / max(num_batches, 1)
    print("Epoch: %d, accuracy: %f, train_loss: %f." % (int(epoch), float(train_accuracy.result()), float(train_loss)))

    train_accuracy.reset_states()

    epoch += 1
    step_in_epoch.zero_()
    checkpoint_manager.save()
