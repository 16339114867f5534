"""Custom training with distrib strategies: TF's tutorial (seed 000) translated section by section.

Run it (after `bash scripts/setup.sh`, which installs Debian's dataset-fashion-mnist):

    python examples/custom_training.py                       # MirroredStrategy over local devices
    python examples/custom_training.py --replicas 2 --epochs 2   # two logical CPU replicas
    python examples/custom_training.py --data-dir DIR        # IDX files somewhere else

Sections follow the tutorial: set up the strategy and input pipeline, create the
model, define the loss and metrics, the training loop, restore the latest
checkpoint without a strategy, iterate with iter/next for a fixed number of steps,
and run a whole epoch in one call.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import distrib as ds
from distrib.app.datasets import load_fashion_mnist
from distrib.app.models import fashion_mnist_cnn
from distrib.app.train import TensorBatches

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--replicas", type=int, default=None)
parser.add_argument("--data-dir", default=None)
parser.add_argument("--checkpoint-dir", default="./training_checkpoints")
parser.add_argument("--seed", type=int, default=None, help="seed the model's initial weights (runs to compare)")
parser.add_argument(
    "--no-function",
    action="store_true",
    help="drop the @ds.function decorators (the seed's @tf.function): the eager run, to compare",
)
args = parser.parse_args()
# the seed decorates its steps with @tf.function; here @ds.function captures each step once as a CUDA graph and
# replays it (on a CPU it runs the step as it is, and says so once). --no-function: the decorators do nothing
function = (lambda f: f) if args.no_function else ds.function
if args.seed is not None:
    torch.manual_seed(args.seed)

# --- Download the Fashion-MNIST dataset (here: read the IDX files) -------------------------
(train_images, train_labels), (test_images, test_labels) = load_fashion_mnist(args.data_dir)
# images are already (N, 1, 28, 28) floats in [0, 1]: PyTorch puts channels first

# --- Create a strategy to distribute the variables and the graph ---------------------------
# If the list of devices is not specified, every local GPU (or the CPU) is used.
devices = None if args.replicas is None else [f"cpu:{i}" for i in range(args.replicas)]
strategy = ds.MirroredStrategy(devices)
print(f"Number of devices: {strategy.num_replicas_in_sync}")

# --- Setup input pipeline ------------------------------------------------------------------
BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
EPOCHS = args.epochs

train_dataset = TensorBatches(train_images, train_labels, batch_size=GLOBAL_BATCH_SIZE, shuffle=True)
test_dataset = TensorBatches(test_images, test_labels, batch_size=GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

# --- Create the model ----------------------------------------------------------------------
create_model = fashion_mnist_cnn  # Conv32-Pool-Conv64-Pool-Dense64-Dense10, Keras initialisers

checkpoint_dir = args.checkpoint_dir
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

# --- Define the loss function --------------------------------------------------------------
# Sum the per-example losses and divide by the GLOBAL batch size: optimizer.step() sums
# gradients over replicas, so that sum is the gradient of the mean over the global batch.
with strategy.scope():

    def compute_loss(labels, predictions):
        per_example_loss = F.cross_entropy(predictions, labels, reduction="none")
        return ds.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


# --- Define the metrics to track loss and accuracy -----------------------------------------
with strategy.scope():
    test_loss = ds.metrics.Mean(name="test_loss")
    train_accuracy = ds.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = ds.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# --- Training loop -------------------------------------------------------------------------
# model, optimizer, and checkpoint must be created under `strategy.scope`.
with strategy.scope():
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), eps=1e-7)
    checkpoint = ds.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs
    predictions = model(images)
    loss = compute_loss(labels, predictions)
    loss.backward()
    optimizer.step()  # sums the gradients over all replicas, then one identical update everywhere
    optimizer.zero_grad()
    train_accuracy.update_state(labels, predictions)
    return loss


@torch.no_grad()
def test_step(inputs):
    images, labels = inputs
    predictions = model(images)
    t_loss = F.cross_entropy(predictions, labels, reduction="none")
    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it with the distributed input.
@function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)


@function
def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(EPOCHS):
    train_dataset.set_epoch(epoch)
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    print(
        template.format(
            epoch + 1,
            float(train_loss),
            float(train_accuracy.result() * 100),
            float(test_loss.result()),
            float(test_accuracy.result() * 100),
        )
    )

    test_loss.reset_states()
    train_accuracy.reset_states()
    test_accuracy.reset_states()

# --- Restore the latest checkpoint and test ------------------------------------------------
# A model checkpointed with a strategy can be restored with or without one.
eval_accuracy = ds.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

new_model = create_model()
new_optimizer = torch.optim.Adam(new_model.parameters())

test_dataset = TensorBatches(test_images, test_labels, batch_size=GLOBAL_BATCH_SIZE)


@function
@torch.no_grad()
def eval_step(images, labels):
    predictions = new_model(images)
    eval_accuracy(labels, predictions)


checkpoint = ds.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(ds.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print(f"Accuracy after restoring the saved model without strategy: {float(eval_accuracy.result() * 100)}")

# --- Alternate ways of iterating over a dataset: using iterators ---------------------------
# To iterate over a given number of steps rather than the whole dataset, create an
# iterator with `iter` and call `next` on it explicitly.
for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)

    for _ in range(10):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, float(average_train_loss), float(train_accuracy.result() * 100)))
    train_accuracy.reset_states()


# --- Iterating inside a function: a whole epoch in one call -------------------------------
# TF wraps the epoch in tf.function, whose `for x in dataset` becomes a loop inside the graph. A CUDA graph
# cannot read new batches, so @ds.function runs a function that takes a dataset as it is (and says why, once);
# its steps are still ordinary calls of the same replica function.
@function
def distributed_train_epoch(dataset):
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / num_batches


for epoch in range(EPOCHS):
    train_dataset.set_epoch(EPOCHS + epoch)
    train_loss = distributed_train_epoch(train_dist_dataset)

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, float(train_loss), float(train_accuracy.result() * 100)))

    train_accuracy.reset_states()

# --- Tracking training loss across replicas ------------------------------------------------
# Do not track the *scaled* training loss with ds.metrics.Mean: with 2 replicas, 2 examples
# each, losses [2, 3] and [4, 5] and a global batch of 4, the scaled losses are 1.25 and
# 2.25; Mean gives (1.25 + 2.25) / 2 = 1.75, while the true loss is their SUM, 3.5, which
# is what strategy.reduce(SUM, ...) returns above.
