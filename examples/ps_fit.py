"""Seed 003's Keras part translated: `fit`/`evaluate` under ParameterServerStrategy.

Run it:

    python examples/ps_fit.py                                   # in-process cluster (threads), like the notebook
    distrib launch --workers 3 --ps 2 examples/ps_fit.py        # one process per task; the chief runs this

TF's version::

    with strategy.scope():
        model = tf.keras.models.Sequential([tf.keras.layers.Dense(1)])
        optimizer = tf.keras.optimizers.Adagrad(learning_rate=0.05)
        model.compile(optimizer, "mse")
    model.fit(dataset, epochs=5, steps_per_epoch=10)
    model.evaluate(eval_dataset, steps=10, return_dict=True)
"""

import torch

import distrib as ds

features = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
labels = torch.tensor([[0.3], [0.5], [0.7]])
eval_features = torch.tensor([[4.0, 4.5], [5.0, 5.5], [6.0, 6.5]])
eval_labels = torch.tensor([[0.8], [0.9], [1.0]])

if ds.cluster_resolver.TFConfigClusterResolver.detect():
    cluster_resolver = ds.cluster_resolver.TFConfigClusterResolver()
else:
    cluster_resolver = ds.testing.create_in_process_cluster(num_workers=3, num_ps=2)
strategy = ds.ParameterServerStrategy(cluster_resolver)

# dataset = from_tensor_slices((features, labels)).shuffle(10).repeat().batch(64): each worker cycles
# through this list of batches; workers reshuffle with their own generator.
dataset = [(features, labels)]
eval_dataset = [(eval_features[i : i + 1], eval_labels[i : i + 1]) for i in range(3)]  # .repeat().batch(1)

with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)

ds.fit(model, dataset, optimizer=optimizer, loss="mse", epochs=5, steps_per_epoch=10)
print(ds.evaluate(model, eval_dataset, loss="mse", steps=10, return_dict=True))

if not ds.cluster_resolver.TFConfigClusterResolver.detect():
    ds.testing.stop_in_process_cluster(cluster_resolver)
