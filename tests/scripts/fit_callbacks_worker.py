"""LearningRateScheduler, TerminateOnNaN and CSVLogger in ``ds.fit`` on several workers.

    distrib launch --workers 2 tests/scripts/fit_callbacks_worker.py CSV_DIR

Global batches of 8 are split over the workers; in the third batch only worker 1's half holds a NaN,
so only worker 1's running loss is NaN after that batch. Every worker must stop after that same batch
(a worker that went on would wait for the other in the next gradient all-reduce). Prints, on every
worker, ``DONE worker=W batches=B lr=[...] epochs=[...]``; each worker gives CSVLogger its own file
name (CSV_DIR/log<W>.csv): only the chief may write one.
"""

import os
import sys

import torch

import distrib as ds

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=30))
with strategy.scope():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

x = torch.ones(40, 2)
x[22, 0] = float("nan")  # batch 2 holds examples 16..23: worker 0 gets 16..19, worker 1 gets 20..23
batches = [(x[i : i + 8], torch.zeros(8, 1)) for i in range(0, 40, 8)]


class Count(ds.callbacks.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


count = Count()
schedule = ds.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * (epoch + 1))
csv_path = os.path.join(sys.argv[1], f"log{strategy.worker_index}.csv")
history = ds.fit(
    model,
    batches,
    optimizer=optimizer,
    loss="mse",
    epochs=3,
    verbose=0,
    callbacks=[schedule, ds.callbacks.TerminateOnNaN(), ds.callbacks.CSVLogger(csv_path), count],
)
print(
    f"DONE worker={strategy.worker_index} batches={count.batches} lr={history.history['lr']} epochs={history.epoch}",
    flush=True,
)
