"""Parameter-server training with a custom training loop: TF's tutorial, translated line by line.

Run it:

    python examples/ps_training_tutorial.py                                  # in-process cluster (3 workers, 2 ps), as the notebook
    python examples/ps_training_tutorial.py --epochs 2 --steps-per-epoch 3   # shorter
    distrib launch --workers 3 --ps 2 examples/ps_training_tutorial.py       # one process per task; the chief runs this script

The source is ``site/en/tutorials/distribute/parameter_server_training.ipynb`` (repository
``tensorflow/docs``): "Training with a custom training loop" and "Evaluation" (inline: direct
and distributed). The data are the tutorial's toy examples, made here: three of seven
feature words per example, labelled "yes" when "avenger" is among them.

What differs from TF, and why (see docs/migration.md):

* Keras' ``StringLookup`` preprocessing layers become a dictionary lookup: they hold no
  variable that a parameter server would keep, so there is nothing to build under the scope.
* ``tf.function`` is not needed: the step is a Python function, pickled once and sent to
  each worker; ``loss.backward()`` and ``optimizer.step()`` replace the tape and
  ``apply_gradients``.
* The metrics are built under ``strategy.scope()`` and updated inside the scheduled
  function, as in TF; what each call adds on its worker comes back with its result, so
  after ``coordinator.join()`` the coordinator's ``accuracy.result()`` counts every completed
  step exactly once (TF: "no visitation guarantee"; a step re-run after a worker loss
  counts once here).
"""

import argparse
import random

import torch
import torch.nn.functional as F

import distrib as ds

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)  # the tutorial's num_epoches
parser.add_argument("--steps-per-epoch", type=int, default=5)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
random.seed(args.seed)
torch.manual_seed(args.seed)

# --- Cluster setup: TF_CONFIG when launched, else an in-process cluster (the notebook's) --------------
NUM_WORKERS = 3
NUM_PS = 2
if ds.cluster_resolver.TFConfigClusterResolver.detect():
    cluster_resolver = ds.cluster_resolver.TFConfigClusterResolver()
    NUM_PS = cluster_resolver.cluster_spec().num_tasks("ps")
else:
    cluster_resolver = ds.testing.create_in_process_cluster(NUM_WORKERS, NUM_PS)

# --- Instantiate a ParameterServerStrategy ------------------------------------------------------------
variable_partitioner = ds.partitioners.MinSizePartitioner(min_shard_bytes=(256 << 10), max_shards=NUM_PS)
strategy = ds.ParameterServerStrategy(cluster_resolver, variable_partitioner=variable_partitioner)

# --- Set up the data ----------------------------------------------------------------------------------
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]

# StringLookup(vocabulary=feature_vocab, mask_token=None): index 0 is the out-of-vocabulary bucket
feature_lookup = {word: i + 1 for i, word in enumerate(feature_vocab)}
# StringLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None): "yes" -> 0, "no" -> 1
label_lookup = {word: i for i, word in enumerate(label_vocab)}


def feature_preprocess_stage(features):
    return torch.tensor([[feature_lookup.get(w, 0) for w in row] for row in features], dtype=torch.int64)


def label_preprocess_stage(labels):
    return torch.tensor([[label_lookup[w] for w in row] for row in labels], dtype=torch.int64)


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def batches(examples, batch_size, shuffle, repeat, seed):
    """``from_tensor_slices(examples).map(preprocess).shuffle(n).batch(batch_size).repeat()``."""
    features = feature_preprocess_stage(examples["features"])
    labels = label_preprocess_stage(examples["label"])
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(labels), generator=g) if shuffle else torch.arange(len(labels))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            yield {"features": features[rows]}, labels[rows]
        if not repeat:
            return


def dataset_fn(input_context):
    return batches(examples, batch_size=32, shuffle=True, repeat=True, seed=input_context.input_pipeline_id)


# --- Build the model: its variables are placed on the parameter servers in a round-robin fashion -------
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb_layer = torch.nn.Embedding(len(feature_vocab) + 1, 16384)
        self.dense = torch.nn.Linear(16384, 1)

    def forward(self, batch_data):
        emb_output = self.emb_layer(batch_data["features"]).mean(dim=1)
        return torch.sigmoid(self.dense(emb_output))


with strategy.scope():
    model = Model()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.1, alpha=0.9, eps=1e-7)  # Keras' RMSprop defaults
    accuracy = ds.metrics.Accuracy()

# The partitioner split the embedding (8 x 16384 float32 = 512 KiB) into two shards, one on each ps:
placement = strategy.variable_placement(model)
assert placement["emb_layer.weight"] == [(0, 0, 4), (1, 4, 8)], placement
shards = strategy.variable_shards(model)["emb_layer.weight"]
assert [tuple(s.shape) for s in shards] == [(4, 16384), (4, 16384)]


# --- Define the training step -------------------------------------------------------------------------
def step_fn(iterator):

    def replica_fn(batch_data, labels):
        pred = model(batch_data)
        per_example_loss = F.binary_cross_entropy(pred, labels.float(), reduction="none").mean(dim=-1)
        loss = ds.compute_average_loss(per_example_loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        actual_pred = (pred > 0.5).to(torch.int64)
        accuracy.update_state(labels, actual_pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(ds.ReduceOp.SUM, losses, axis=None)


# --- Dispatch training steps to remote workers --------------------------------------------------------
coordinator = ds.coordinator.ClusterCoordinator(strategy)


def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epoches = args.epochs
steps_per_epoch = args.steps_per_epoch
for i in range(num_epoches):
    accuracy.reset_states()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()))

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % loss.fetch())

# --- Evaluation: inline, direct (on the coordinator, which reads the parameter servers) ----------------
eval_examples = feature_and_label_gen(num_examples=16)
eval_dataset = batches(eval_examples, batch_size=8, shuffle=False, repeat=False, seed=0)

eval_accuracy = ds.metrics.Accuracy()

with torch.no_grad():
    for batch_data, labels in eval_dataset:
        pred = model(batch_data)
        actual_pred = (pred > 0.5).to(torch.int64)
        eval_accuracy.update_state(labels, actual_pred)

print("Evaluation accuracy: %f" % eval_accuracy.result())

# --- Evaluation: inline, distributed (scheduled on the workers) ----------------------------------------
with strategy.scope():
    # Define the eval metric on parameter servers.
    eval_accuracy = ds.metrics.Accuracy()


def eval_step(iterator):
    def replica_fn(batch_data, labels):
        with torch.no_grad():
            pred = model(batch_data)
        actual_pred = (pred > 0.5).to(torch.int64)
        eval_accuracy.update_state(labels, actual_pred)

    batch_data, labels = next(iterator)
    strategy.run(replica_fn, args=(batch_data, labels))


def eval_dataset_fn(input_context):
    return batches(eval_examples, batch_size=8, shuffle=True, repeat=True, seed=100 + input_context.input_pipeline_id)


per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
per_worker_eval_iterator = iter(per_worker_eval_dataset)

eval_steps_per_epoch = 2
for _ in range(eval_steps_per_epoch):
    coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
coordinator.join()
print("Evaluation accuracy: %f" % eval_accuracy.result())
print(
    f"(the distributed evaluation counted {eval_steps_per_epoch} steps x 8 examples = "
    f"{int(eval_accuracy.state_dict()['count'])} examples, each completed step once)"
)

coordinator.close()
if not ds.cluster_resolver.TFConfigClusterResolver.detect():
    ds.testing.stop_in_process_cluster(cluster_resolver)
