"""TF's guide "Distributed training with TensorFlow" (tensorflow/docs site/en/guide/distributed_training.ipynb) translated.

Run it:

    python examples/distributed_training_guide.py                 # 2 logical CPU replicas (every GPU if there are 2+)
    python examples/distributed_training_guide.py --replicas 1    # one replica: the same losses, step for step

Every code cell of the guide is here, in its order, under its heading (as comments). It runs in
one process; its ParameterServerStrategy cell starts an in-process cluster (threads), as TF's
parameter-server tutorial does in a notebook, unless TF_CONFIG names a real one. What changed:

* Keras layers → ``torch.nn`` with Keras' initialisers (``glorot_uniform`` kernel, zero bias);
  ``tf.GradientTape`` → ``loss.backward()``; ``apply_gradients`` → ``optimizer.step()``;
  ``tf.function`` → plain Python; ``tf.data`` → ``DataLoader``; ``model.compile/fit/evaluate``
  → ``ds.fit`` / ``ds.evaluate`` with the optimizer and loss given to them.
* ``kernel_regularizer=L2(1e-4)``: ``ds.fit`` adds no model regularization losses, so for
  ``fit`` it is SGD's ``weight_decay=2e-4`` on the kernel (the same gradient as
  ``1e-4 * sum(w**2)``; Keras' printed loss also includes that tiny term, distrib's does not).
  In the custom loop, the model returns its regularization losses and the loop scales them with
  ``ds.scale_regularization_loss``, as the guide does with ``model.losses``.
* ``TPUStrategy`` and ``CentralStorageStrategy``, ``HierarchicalCopyAllReduce``,
  ``CommunicationImplementation`` and ``make_experimental_numpy_dataset`` have no distrib
  counterpart: their cells say so (see docs/migration.md).
"""

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrib as ds

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--replicas",
    type=int,
    default=2,
    help="logical CPU replicas of the MirroredStrategy used to train (when there are < 2 GPUs)",
)
args = parser.parse_args()

# GPUs when there are 2 or more (the guide's case), else logical CPU replicas (the input tutorial's virtual CPUs).
GPUS = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
DEVICES = GPUS if len(GPUS) >= 2 else [f"cpu:{i}" for i in range(args.replicas)]


class Dense(nn.Linear):
    """``tf.keras.layers.Dense(units, input_shape=(in_features,), kernel_regularizer=L2(l2))``.

    Keras' initialisers (glorot_uniform kernel, zero bias). ``forward(x, return_losses=True)``
    also returns the layer's regularization losses (Keras' ``layer.losses``): computed by the copy
    that runs, so inside ``strategy.run`` each replica's losses come from its own copy.
    """

    def __init__(self, units, in_features, l2=0.0):
        super().__init__(in_features, units)
        self.l2 = l2
        nn.init.xavier_uniform_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x, return_losses=False):
        y = super().forward(x)
        if not return_losses:
            return y
        return y, [self.l2 * self.weight.pow(2).sum()] if self.l2 else []


def make_model():
    """``tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,), kernel_regularizer=L2(1e-4))])``."""
    torch.manual_seed(0)  # the same initial weights for every run
    return Dense(1, in_features=1, l2=1e-4)


def sgd(model, learning_rate=0.01):
    """``optimizer='sgd'`` (Keras' default learning rate 0.01), with the L2(1e-4) kernel regularizer as weight decay."""
    return torch.optim.SGD(
        [{"params": [model.weight], "weight_decay": 2 * model.l2}, {"params": [model.bias]}], lr=learning_rate
    )


def ones_dataset(n, batch_size):
    """``tf.data.Dataset.from_tensors(([1.], [1.])).repeat(n).batch(batch_size)``."""
    return DataLoader(TensorDataset(torch.ones(n, 1), torch.ones(n, 1)), batch_size=batch_size)


# # Distributed training with TensorFlow

# ## Overview

# ## Set up TensorFlow
print(torch.__version__, ds.__version__)

# ## Types of strategies

# ### MirroredStrategy
mirrored_strategy = ds.MirroredStrategy()
print(mirrored_strategy)

# Only some of the GPUs (here: two logical CPUs when there are fewer than 2 GPUs):
mirrored_strategy = ds.MirroredStrategy(devices=GPUS[:2] if len(GPUS) >= 2 else ["cpu:0", "cpu:1"])
print(mirrored_strategy)

# TF: MirroredStrategy(cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()). distrib has no
# CrossDeviceOps classes; `cross_device_ops` is accepted and ignored (local replicas are summed on the
# first device; workers reduce through torch.distributed, customisable with strategy.register_comm_hook).
mirrored_strategy = ds.MirroredStrategy(cross_device_ops=None)
print(mirrored_strategy)

# ### TPUStrategy
# TF: TPUClusterResolver(tpu=tpu_address); experimental_connect_to_cluster; initialize_tpu_system;
# tf.distribute.TPUStrategy(cluster_resolver). distrib has no TPU strategy.

# ### MultiWorkerMirroredStrategy
strategy = ds.MultiWorkerMirroredStrategy()  # no TF_CONFIG here: one worker
print(strategy)

# TF: implementation=tf.distribute.experimental.CommunicationImplementation.NCCL; distrib takes the
# name as a string ("auto", "ring"/"gloo", "nccl"). NCCL needs GPUs (TF's NCCL does not run on CPUs either).
communication_options = ds.CommunicationOptions(implementation="nccl" if GPUS else "ring")
strategy = ds.MultiWorkerMirroredStrategy(communication_options=communication_options)
print(strategy, strategy.communication_options)

# ### ParameterServerStrategy
IN_PROCESS_CLUSTER = not ds.cluster_resolver.TFConfigClusterResolver.detect()
if not IN_PROCESS_CLUSTER:
    cluster_resolver = ds.cluster_resolver.TFConfigClusterResolver()
else:  # a notebook's in-process cluster: 2 workers and 1 ps on threads of this process
    cluster_resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
variable_partitioner = ds.partitioners.MinSizePartitioner(
    min_shard_bytes=256 << 10, max_shards=cluster_resolver.cluster_spec().num_tasks("ps")
)
strategy = ds.ParameterServerStrategy(cluster_resolver, variable_partitioner=variable_partitioner)
coordinator = ds.coordinator.ClusterCoordinator(strategy)
print(
    type(strategy).__name__,
    "with",
    cluster_resolver.cluster_spec().num_tasks("worker"),
    "workers and",
    cluster_resolver.cluster_spec().num_tasks("ps"),
    "ps;",
    type(coordinator).__name__,
)

# ### CentralStorageStrategy
# TF: tf.distribute.experimental.CentralStorageStrategy() (variables on the CPU, computation on every GPU).
if hasattr(ds, "CentralStorageStrategy"):
    central_storage_strategy = ds.CentralStorageStrategy()
    print(central_storage_strategy)
else:
    print("distrib has no CentralStorageStrategy")

# ### Other strategies

# #### Default Strategy
default_strategy = ds.get_strategy()
print(default_strategy)

# In optimizer or other library code
# Get currently active strategy
strategy = ds.get_strategy()
print(strategy.reduce("SUM", 1.0, axis=None))  # reduce some values

if torch.cuda.is_available():
    strategy = ds.MirroredStrategy()
else:  # Use the Default Strategy
    strategy = ds.get_strategy()

with strategy.scope():
    # Do something interesting
    print(nn.Parameter(torch.tensor(1.0)))  # tf.Variable(1.)

# #### OneDeviceStrategy
strategy = ds.OneDeviceStrategy(device="/gpu:0" if GPUS else "/cpu:0")
print(strategy)

# ## Use tf.distribute.Strategy with Keras Model.fit
mirrored_strategy = ds.MirroredStrategy(DEVICES)

with mirrored_strategy.scope():
    model = make_model()
    optimizer = sgd(model)  # model.compile(loss='mse', optimizer='sgd'): ds.fit takes both

dataset = ones_dataset(100, 10)
ds.fit(model, dataset, optimizer=optimizer, loss="mse", epochs=2)
print(ds.evaluate(model, dataset, loss="mse"))  # model.evaluate(dataset): the loss, a progress line first

# NumPy arrays: ds.fit takes batches, so the arrays go through a DataLoader (model.fit's batch_size=10).
inputs, targets = np.ones((100, 1)), np.ones((100, 1))
ds.fit(
    model,
    DataLoader(
        TensorDataset(torch.as_tensor(inputs, dtype=torch.float32), torch.as_tensor(targets, dtype=torch.float32)),
        batch_size=10,
    ),
    optimizer=optimizer,
    loss="mse",
    epochs=2,
)

print(mirrored_strategy.num_replicas_in_sync)

# Compute a global batch size using a number of replicas.
BATCH_SIZE_PER_REPLICA = 5
global_batch_size = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync
dataset = ones_dataset(100, global_batch_size)

LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15, 20: 0.175}
learning_rate = LEARNING_RATES_BY_BATCH_SIZE[global_batch_size]
print("global_batch_size:", global_batch_size, "learning_rate:", learning_rate)

# ### What's supported now?
# ds.fit/ds.evaluate: MirroredStrategy, MultiWorkerMirroredStrategy, ParameterServerStrategy
# (with steps_per_epoch; examples/ps_fit.py), OneDeviceStrategy, the default strategy.

# ### Examples and tutorials
# examples/custom_training.py, examples/multi_worker_ctl.py, examples/ps_fit.py, examples/parameter_server.py.

# ## Use tf.distribute.Strategy with custom training loops
with mirrored_strategy.scope():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # tf.keras.optimizers.SGD()

dataset = ones_dataset(1000, global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


# tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=NONE): one value per example
# (the mean over the last axis), leaving the reduction to ds.compute_average_loss below.
def loss_object(labels, predictions):
    return F.binary_cross_entropy_with_logits(predictions, labels, reduction="none").mean(-1)


def train_step(inputs):
    features, labels = inputs

    model.train()
    predictions, model_losses = model(features, return_losses=True)
    per_example_loss = loss_object(labels, predictions)
    loss = ds.compute_average_loss(per_example_loss)
    if model_losses:
        loss += ds.scale_regularization_loss(sum(model_losses))

    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def distributed_train_step(dist_inputs):
    per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
    return mirrored_strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)


for dist_inputs in dist_dataset:
    print(distributed_train_step(dist_inputs))

# TF's make_experimental_numpy_dataset has no distrib counterpart: wrap arrays in a DataLoader, as above.

iterator = iter(dist_dataset)
for _ in range(10):
    print(distributed_train_step(next(iterator)))

# ### What's supported now?
# ### Examples and tutorials

# ## Other topics

# ### Setting up the TF_CONFIG environment variable
saved_tf_config = os.environ.get("TF_CONFIG")
# (the guide writes "host1:port"; distrib checks every address when it reads TF_CONFIG, so real ports here)
os.environ["TF_CONFIG"] = json.dumps(
    {
        "cluster": {"worker": ["host1:2222", "host2:2222", "host3:2222"], "ps": ["host4:2222", "host5:2222"]},
        "task": {"type": "worker", "index": 1},
    }
)
resolver = ds.cluster_resolver.TFConfigClusterResolver()
print(resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id)
os.environ.pop("TF_CONFIG")
if saved_tf_config is not None:
    os.environ["TF_CONFIG"] = saved_tf_config

# ## What's next?
if IN_PROCESS_CLUSTER:
    ds.testing.stop_in_process_cluster(cluster_resolver)
