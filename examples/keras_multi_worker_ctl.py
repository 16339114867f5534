"""Custom training loop with Keras and MultiWorkerMirroredStrategy, keeping the tutorial's Keras code (Keras 3 on
PyTorch).

The tutorial's code line for line (its ``mnist.py`` first, then the notebook's cells, which are its ``main.py``), with
``tf.keras`` -> ``keras`` and ``tf.distribute`` -> ``ds``. What differs: the gradient lines (as Keras' guide "Writing
a training loop from scratch in PyTorch" writes them), the data (Fashion-MNIST from the local IDX files, or MNIST
with ``--data-dir``; batched by ``TensorBatches``: there is no ``tf.data``), ``tf.Variable`` counters as 0-d torch
tensors, ``tf.io.gfile`` as ``os``/``shutil``, and TF_CONFIG read from the environment.

    distrib launch --workers 2 examples/keras_multi_worker_ctl.py
    distrib launch --workers 2 examples/keras_multi_worker_ctl.py --data-dir /path/to/mnist-idx   # MNIST instead

Without TF_CONFIG it trains as a single worker.
"""

import argparse
import json
import os
import shutil
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported: Keras 3 on PyTorch

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import distrib as ds  # noqa: E402
from distrib.app.datasets import load_fashion_mnist  # noqa: E402
from distrib.app.train import TensorBatches  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--data-dir", default=None, help="IDX files (default: Debian's Fashion-MNIST)")
parser.add_argument("--checkpoint-dir", default=None, help="default: the tutorial's util.get_temp_dir()/ckpt")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=70)
args = parser.parse_args()

if "." not in sys.path:
    sys.path.insert(0, ".")


# --- mnist.py ------------------------------------------------------------------------------
def mnist_dataset(batch_size):
    (x_train, y_train), _ = load_fashion_mnist(args.data_dir)  # keras.datasets.mnist.load_data() downloads
    x_train = (x_train.squeeze(1) * 255).round().numpy()
    # The `x` arrays are in uint8 and have values in the range [0, 255].
    # You need to convert them to float32 with values in the range [0, 1]
    x_train = x_train / np.float32(255)
    y_train = y_train.numpy().astype(np.int64)
    return torch.from_numpy(x_train), torch.from_numpy(y_train)


datasets = []  # this worker's pipeline, to reshuffle it every epoch as tf.data's shuffle does


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x, y = mnist_dataset(batch_size)
    x = x[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    y = y[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    dataset = TensorBatches(x, y, batch_size=batch_size, shuffle=True, seed=input_context.input_pipeline_id)
    datasets.append(dataset)
    return dataset


def build_cnn_model():
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28)),
            keras.layers.Reshape(target_shape=(28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


# --- the notebook (main.py) ----------------------------------------------------------------
tf_config = json.loads(
    os.environ.get("TF_CONFIG", '{"cluster": {"worker": ["localhost:12345"]}, "task": {"type": "worker", "index": 0}}')
)

strategy = ds.MultiWorkerMirroredStrategy()

with strategy.scope():
    # Model building needs to be within `strategy.scope()`.
    multi_worker_model = build_cnn_model()

per_worker_batch_size = 64
num_workers = len(tf_config["cluster"]["worker"])
global_batch_size = per_worker_batch_size * num_workers

with strategy.scope():
    multi_worker_dataset = strategy.distribute_datasets_from_function(
        lambda input_context: dataset_fn(global_batch_size, input_context)
    )

with strategy.scope():
    # The creation of optimizer and train_accuracy will need to be in
    # `strategy.scope()` as well, since they create variables.
    optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
    train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")


@ds.function
def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
        """Per-Replica step function."""
        x, y = inputs
        predictions = multi_worker_model(x, training=True)
        per_batch_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(y, predictions)
        loss = ds.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
        multi_worker_model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in multi_worker_model.trainable_variables]
        with torch.no_grad():
            optimizer.apply(grads, multi_worker_model.trainable_variables)
        train_accuracy.update_state(y, predictions)
        return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)


from multiprocessing import util  # noqa: E402

checkpoint_dir = args.checkpoint_dir or os.path.join(util.get_temp_dir(), "ckpt")


def _is_chief(task_type, task_id, cluster_spec):
    return (
        task_type is None
        or task_type == "chief"
        or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
    )


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


epoch = torch.tensor(0, dtype=torch.int64)
step_in_epoch = torch.tensor(0, dtype=torch.int64)
task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
# We normally don't need to manually instantiate a ClusterSpec, but in this
# illustrative example we did not set TF_CONFIG before initializing the
# strategy. See the next section for "real-world" usage.
cluster_spec = ds.ClusterSpec(tf_config["cluster"])

checkpoint = ds.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
checkpoint_manager = ds.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

latest_checkpoint = ds.latest_checkpoint(checkpoint_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)

num_epochs = args.epochs
num_steps_per_epoch = args.steps_per_epoch

while epoch.numpy() < num_epochs:
    datasets[0].set_epoch(int(epoch))
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0

    while step_in_epoch.numpy() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch += 1

    train_loss = total_loss / num_batches
    print("Epoch: %d, accuracy: %f, train_loss: %f." % (epoch.numpy(), train_accuracy.result(), train_loss))

    train_accuracy.reset_state()

    # Once the `CheckpointManager` is set up, you're now ready to save, and remove
    # the checkpoints non-chief workers saved.
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)

    epoch += 1
    step_in_epoch.zero_()
