"""TF's "Distributed Input" tutorial (tensorflow/docs site/en/tutorials/distribute/input.ipynb) translated.

Run it:

    python examples/input_tutorial.py                                  # one process, 2 logical CPU replicas
    distrib launch --workers 2 examples/input_tutorial.py              # 2 workers, 1 replica each
    distrib launch --workers 2 examples/input_tutorial.py --replicas 2 # 2 workers x 2 local replicas

Every cell of the tutorial is here, in its order, under its heading (as comments), printing what
it prints. What changed, and why:

* ``tf.data.Dataset`` → a ``torch.utils.data.DataLoader`` (or any iterable) of batches. A
  DataLoader yields ``[features, labels]`` lists where tf.data yields tuples; nothing else differs.
* ``tf.function`` → plain Python (``strategy.run`` runs eagerly); ``tf.print`` → ``print``.
* ``N_VIRTUAL_DEVICES`` logical CPUs → ``ds.MirroredStrategy(["cpu:0", "cpu:1"])``. (TF's
  ``MirroredStrategy()`` takes GPUs only, so on a CPU-only Colab the tutorial's cells really
  ran on one replica; here they run on two, which is what the cell means to show.)
* Under ``distrib launch`` (``TF_CONFIG`` set) every ``MirroredStrategy`` cell uses
  ``MultiWorkerMirroredStrategy`` instead, so the sharding and partial-batch cells show each
  worker's share; each line is printed by every worker (``[worker k]`` prefixes them).
* ``experimental_distribute_dataset`` splits each global batch over all replicas as evenly as
  possible (``torch.tensor_split``): TF's rebatching may leave a replica empty where distrib
  gives it one example (see "Batching"). Every worker reads the same global batches and keeps its
  replicas' parts: TF's ``AutoShardPolicy.DATA``; distrib has no ``tf.data.Options`` /
  ``AutoShardPolicy``: FILE and OFF are written by hand with ``distribute_datasets_from_function``.
"""

import argparse
import itertools

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

import distrib as ds

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--replicas",
    type=int,
    default=None,
    help="logical CPU replicas per process (default: 2 alone, 1 per worker under distrib launch)",
)
args = parser.parse_args()

IN_CLUSTER = ds.cluster_resolver.resolve() is not None


def MirroredStrategy():
    """The tutorial's ``tf.distribute.MirroredStrategy()``: the logical CPUs; those of every worker under a cluster."""
    if IN_CLUSTER:
        return ds.MultiWorkerMirroredStrategy(devices=DEVICES)
    return ds.MirroredStrategy(DEVICES)


def ones_dataset(n, batch_size):
    """``tf.data.Dataset.from_tensors(([1.], [1.])).repeat(n).batch(batch_size)``."""
    return DataLoader(TensorDataset(torch.ones(n, 1), torch.ones(n, 1)), batch_size=batch_size)


def sizes(strategy, value):
    """The batch size of each local replica's part of ``value`` (a PerReplica, or a plain tensor)."""
    return [len(v) for v in strategy.experimental_local_results(value)]


# # Distributed Input

# ## Distributed datasets

# Helper libraries
print(torch.__version__, ds.__version__)
# Short prints: the tutorial's batches repeat one value (the sizes are printed where they matter).
torch.set_printoptions(threshold=4, edgeitems=1)

# Simulate multiple CPUs with virtual devices
N_VIRTUAL_DEVICES = args.replicas or (1 if IN_CLUSTER else 2)
DEVICES = [f"cpu:{i}" for i in range(N_VIRTUAL_DEVICES)]

print("Available devices:")
for i, device in enumerate(DEVICES):
    print("%d) %s" % (i, device))

global_batch_size = 16
# Create a dataset: a DataLoader of global batches.
dataset = ones_dataset(100, global_batch_size)


def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


# Iterate over the dataset using the for..in construct.
for inputs in dataset:
    print(train_step(inputs))

# ### `tf.distribute.Strategy.experimental_distribute_dataset`

# #### Usage

global_batch_size = 16
mirrored_strategy = MirroredStrategy()

dataset = ones_dataset(100, global_batch_size)
# Distribute input using the `experimental_distribute_dataset`.
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# 1 global batch of data fed to the model in 1 step.
print(next(iter(dist_dataset)))

# #### Properties

# ##### Batching
# The tutorial's three examples, run (distrib splits each global batch as evenly as possible;
# a replica gets an empty batch only when there are fewer examples than replicas).
for n, batch, replicas in ((6, 4, 2), (4, 4, 5), (8, 4, 3)):
    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    for step, x in enumerate(strategy.experimental_distribute_dataset(DataLoader(torch.arange(n), batch_size=batch))):
        parts = ", ".join(
            f"Replica {r + 1}: {v.tolist()}" for r, v in enumerate(strategy.experimental_local_results(x))
        )
        print(f"range({n}).batch({batch}) over {replicas} replicas: Batch {step + 1}: {parts}")

# ##### Sharding
# TF: options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA. distrib has no
# tf.data.Options: experimental_distribute_dataset always behaves as DATA (every worker reads the
# whole data and keeps its replicas' parts of each global batch). The tutorial's DATA example: 12
# elements, global batch 4.
mirrored_strategy = MirroredStrategy()
worker = mirrored_strategy.worker_index
data_sharded = mirrored_strategy.experimental_distribute_dataset(DataLoader(torch.arange(12), batch_size=4))
for step, x in enumerate(data_sharded):
    print(
        f"DATA: Worker {worker}: Batch {step + 1} = "
        + ", ".join(
            f"Replica {worker * mirrored_strategy.num_local_replicas + r + 1}: {v.tolist()}"
            for r, v in enumerate(mirrored_strategy.experimental_local_results(x))
        )
    )

# FILE: 2 "files" over the workers, each worker reads its own files, batched per replica
# (global batch 4). OFF: every worker reads everything.
files = [torch.arange(0, 6), torch.arange(6, 12)]


def file_dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(4)
    mine = files[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    return DataLoader(torch.cat(mine), batch_size=batch_size)


def off_dataset_fn(input_context):
    return DataLoader(torch.arange(12), batch_size=input_context.get_per_replica_batch_size(4))


for policy, fn in (("FILE", file_dataset_fn), ("OFF", off_dataset_fn)):
    for step, x in enumerate(mirrored_strategy.distribute_datasets_from_function(fn)):
        print(
            f"{policy}: Worker {worker}: Batch {step + 1} = "
            + ", ".join(
                f"Replica {worker * mirrored_strategy.num_local_replicas + r + 1}: {v.tolist()}"
                for r, v in enumerate(mirrored_strategy.experimental_local_results(x))
            )
        )

# ##### Prefetching
# tf.distribute adds a prefetch; in PyTorch prefetching is the DataLoader's
# (num_workers=..., prefetch_factor=..., pin_memory=True).

# ### `tf.distribute.Strategy.distribute_datasets_from_function`

# #### Usage

mirrored_strategy = MirroredStrategy()


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    print(
        f"Worker {input_context.input_pipeline_id} of {input_context.num_input_pipelines}: "
        f"per-replica batch size {batch_size} "
        f"({input_context.num_replicas_in_sync} replicas in sync)"
    )
    dataset = TensorDataset(torch.ones(64, 1), torch.ones(64, 1))  # from_tensors(...).repeat(64)
    # (the tutorial also calls .batch(16) here, before .batch(batch_size): that nests the batches,
    # which it does not mean; left out)
    dataset = Subset(
        dataset, range(input_context.input_pipeline_id, len(dataset), input_context.num_input_pipelines)
    )  # .shard(num_input_pipelines, id)
    return DataLoader(dataset, batch_size=batch_size)  # .batch(batch_size); .prefetch(2)


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
steps = [sizes(mirrored_strategy, x[0]) for x in dist_dataset]
print(f"Worker {mirrored_strategy.worker_index}: {len(steps)} steps, per-replica batch sizes {steps}")

# #### Properties

# ##### Batching
# ##### Sharding
# ##### Prefetching
# (prose: the function batches with the per-replica batch size and shards with the InputContext,
# as dataset_fn above does; prefetching is the DataLoader's.)

# ## Distributed iterators

# ### Usages

# #### Use a Pythonic for loop construct

global_batch_size = 16
mirrored_strategy = MirroredStrategy()

dataset = ones_dataset(100, global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


for x in dist_dataset:
    # train_step trains the model using the dataset elements
    loss = mirrored_strategy.run(train_step, args=(x,))
    print("Loss is ", loss)

# #### Use `iter` to create an explicit iterator

num_epochs = 10
steps_per_epoch = 5
for epoch in range(num_epochs):
    dist_iterator = iter(dist_dataset)
    for step in range(steps_per_epoch):
        # train_step trains the model using the dataset elements
        loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
        # which is the same as
        # loss = mirrored_strategy.run(train_step, args=(dist_iterator.get_next(),))
        print("Loss is ", loss)

# With `next` or `get_next`, the end of the data is an OutOfRangeError (a StopIteration too):
dist_iterator = iter(dist_dataset)
for _ in range(7):  # 100 examples, 16 a step
    dist_iterator.get_next()
try:
    dist_iterator.get_next()
except ds.input.OutOfRangeError as e:
    print("OutOfRangeError:", e)

# You can break the loop with `get_next_as_optional` by checking if the `Optional` contains a value
global_batch_size = 4
steps_per_loop = 5
strategy = MirroredStrategy()

dataset = DataLoader(torch.arange(9), batch_size=global_batch_size)  # Dataset.range(9).batch(4)
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))


def train_fn(distributed_iterator):
    for _ in range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        print(strategy.experimental_local_results(per_replica_results))


train_fn(distributed_iterator)

# ## Using the `element_spec` property

global_batch_size = 16
epochs = 5
steps_per_epoch = 5
mirrored_strategy = MirroredStrategy()

dataset = ones_dataset(100, global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
print("element_spec:", dist_dataset.element_spec)


# tf.function(input_signature=[dist_dataset.element_spec]) has no PyTorch counterpart: a plain function.
def train_step(per_replica_inputs):
    def step_fn(inputs):
        return 2 * inputs

    return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


for _ in range(epochs):
    iterator = iter(dist_dataset)
    for _ in range(steps_per_epoch):
        output = train_step(next(iterator))
        print(output)
print("iterator element_spec:", iterator.element_spec)

# ## Data preprocessing

# ### Keras preprocessing layers vs. Tensorflow Transform
# ### Best Practice with tf.distribute
# ### Preprocessing with `Model.fit`
# (prose and pseudo-code: ds.fit takes the batches, as in examples/ps_fit.py.)

# ### Preprocessing with a custom training loop


class StringLookup(torch.nn.Module):
    """``tf.keras.layers.StringLookup(vocabulary=vocab)``: index 0 for out-of-vocabulary strings, then 1, 2, ..."""

    def __init__(self, vocabulary):
        super().__init__()
        self.index = {word: i + 1 for i, word in enumerate(vocabulary)}

    def forward(self, words):
        return torch.tensor([self.index.get(w, 0) for w in words])


class Repeat(IterableDataset):
    """``tf.data.Dataset.from_tensor_slices(items).repeat()``."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return itertools.cycle(self.items)


strategy = MirroredStrategy()
vocab = ["a", "b", "c", "d", "f"]

with strategy.scope():
    # Create the layer(s) under scope.
    layer = StringLookup(vocabulary=vocab)


def dataset_fn(input_context):
    # a dataset
    dataset = Repeat(["a", "c", "e"])

    # Custom your batching, sharding, prefetching, etc.
    global_batch_size = 4
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    batches = DataLoader(dataset, batch_size=batch_size)  # .batch(batch_size): lists of strings
    batches = itertools.islice(
        batches, input_context.input_pipeline_id, None, input_context.num_input_pipelines
    )  # .shard(num_input_pipelines, id)

    # Apply the preprocessing layer(s) to the batches
    def preprocess_with_kpl(input):
        return layer(input)

    processed_ds = map(preprocess_with_kpl, batches)
    return processed_ds


distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)

# Print out a few example batches.
distributed_dataset_iterator = iter(distributed_dataset)
for _ in range(3):
    print(next(distributed_dataset_iterator))

# ## Partial batches
# (the prose, run) 9 examples in per-replica batches of 2: the last step has real data on one
# replica and a dummy batch of size 0 on the others; across workers, the step ends the epoch
# on every worker together.
mirrored_strategy = MirroredStrategy()


def partial_dataset_fn(input_context):
    mine = torch.arange(9)[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    return DataLoader(mine, batch_size=2)


partial = [sizes(mirrored_strategy, x) for x in mirrored_strategy.distribute_datasets_from_function(partial_dataset_fn)]
print(f"Partial batches: Worker {mirrored_strategy.worker_index}: per-replica batch sizes {partial}")
partial = [
    sizes(mirrored_strategy, x)
    for x in mirrored_strategy.experimental_distribute_dataset(DataLoader(torch.arange(9), batch_size=4))
]
print(f"Partial batches (global batch 4): Worker {mirrored_strategy.worker_index}: per-replica batch sizes {partial}")

# ## Caveats
mirrored_strategy = MirroredStrategy()
dataset_size = 24
batch_size = 6
dataset = DataLoader(
    TensorDataset(torch.arange(dataset_size), torch.arange(dataset_size)),  # range(24).enumerate()
    batch_size=batch_size,
)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
    outputs = 2 * inputs
    return index, outputs


result = {}
for index, inputs in dist_dataset:
    output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
    indices = list(mirrored_strategy.experimental_local_results(output_index))
    rindices = []
    for a in indices:
        rindices.extend(a.tolist())
    outputs = list(mirrored_strategy.experimental_local_results(outputs))
    routputs = []
    for a in outputs:
        routputs.extend(a.tolist())
    for i, value in zip(rindices, routputs):
        result[i] = value

print(result)

# ## Tensor inputs instead of tf.data

# ### Use experimental_distribute_values_from_function for arbitrary tensor inputs
mirrored_strategy = MirroredStrategy()


def value_fn(ctx):
    return torch.tensor(ctx.replica_id_in_sync_group)


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
    print(result)

# ### Use tf.data.Dataset.from_generator if your input is from a generator
mirrored_strategy = MirroredStrategy()


def input_gen():
    # seeded: under several workers every worker must read the same global batches
    rng = np.random.default_rng(0)
    while True:
        yield rng.random(4)


class FromGenerator(IterableDataset):
    """``tf.data.Dataset.from_generator(input_gen, output_types=tf.float32, output_shapes=[4])``."""

    def __iter__(self):
        return (torch.as_tensor(x, dtype=torch.float32) for x in input_gen())


dataset = FromGenerator()
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
    print(result)
