"""Keras' own files from every worker of a job: ``model.save`` / ``model.save_weights`` as TF's tutorial calls them.

    distrib launch --workers 2 tests/scripts/keras_save_worker.py --dir D --out OUT

Trains keras_custom_loop.py's model a few steps under MultiWorkerMirroredStrategy, then, on every worker:
``model.save(D/model.keras)`` and ``model.save_weights(D/model.weights.h5)`` (the same paths everywhere), and TF's
convention: ``model.save(write_filepath)``, the chief's path on the chief and ``D/workertemp_<id>/model.keras``
elsewhere, that directory deleted afterwards. Keras' ``Model.save`` and ``Model.save_weights`` are wrapped in this
process to count the files Keras really wrote here. The chief writes its predictions for a fixed input to OUT; each
worker prints ``WROTE worker=W save=N weights=M``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import torch  # noqa: E402
from keras_custom_loop import GLOBAL_BATCH, create_model, global_batches  # noqa: E402

import distrib as ds  # noqa: E402

written = {"save": 0, "save_weights": 0}


def counting(name: str) -> None:
    original = getattr(keras.Model, name)

    def wrapper(self: keras.Model, *args: object, **kwargs: object) -> object:
        written[name] += 1
        return original(self, *args, **kwargs)

    setattr(keras.Model, name, wrapper)


counting("save")
counting("save_weights")

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
with strategy.scope():
    model = create_model()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def train_step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = ds.compute_average_loss(loss_object(labels, model(images)), global_batch_size=GLOBAL_BATCH)
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in model.trainable_weights], model.trainable_weights)
    return loss


half = GLOBAL_BATCH // strategy.num_workers
rows = slice(strategy.worker_index * half, (strategy.worker_index + 1) * half)
for images, labels in global_batches(4):
    strategy.run(train_step, args=(images[rows], labels[rows]))

model.save(os.path.join(args.dir, "model.keras"))
model.save_weights(os.path.join(args.dir, "model.weights.h5"))

# TF's "Multi-worker training with Keras", Model saving and loading: write_filepath, then the temporary copy removed
model_path = os.path.join(args.dir, "tutorial", "model.keras")
if strategy.is_chief:
    write_model_path = model_path
else:
    write_model_path = os.path.join(args.dir, "tutorial", f"workertemp_{strategy.worker_index}", "model.keras")
model.save(write_model_path)
if not strategy.is_chief:
    assert os.path.isfile(write_model_path)
    shutil.rmtree(os.path.dirname(write_model_path))

print(f"WROTE worker={strategy.worker_index} save={written['save']} weights={written['save_weights']}", flush=True)
if strategy.is_chief:
    probe = global_batches(5)[4][0]
    torch.save({"input": probe, "predictions": torch.as_tensor(model.predict(probe.numpy(), verbose=0))}, args.out)
