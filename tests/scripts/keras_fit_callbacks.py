"""A compiled Keras 3 model trained by ``ds.fit`` on several workers with ``ds.callbacks``: ModelCheckpoint,
BackupAndRestore and TensorBoard, for the test that they act once, on the chief, and that a
run resumed from the backup ends where an uninterrupted one does.

    distrib launch --workers 2 tests/scripts/keras_fit_callbacks.py WORK_DIR EPOCHS OUT

The model, data and compile arguments are ``keras_fit.py``'s (Keras Adam). Run once with EPOCHS=1, then with
EPOCHS=2: the second run restores the first's backup (the model, the Keras optimizer's slots, the position) and
trains the second epoch only. The chief writes the trainable variables and the history to OUT.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras_fit  # noqa: E402

import distrib as ds  # noqa: E402

work, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
with strategy.scope():
    model, _ = keras_fit.build("keras")
callbacks = [
    ds.callbacks.ModelCheckpoint(os.path.join(work, "ckpt", "weights-{epoch}")),
    ds.callbacks.BackupAndRestore(os.path.join(work, "backup"), delete_checkpoint=False),
    ds.callbacks.TensorBoard(os.path.join(work, "logs"), write_graph=False),
]
history = ds.fit(
    model, keras_fit.batches(), epochs=epochs, steps_per_epoch=keras_fit.STEPS, verbose=0, callbacks=callbacks
)
if strategy.is_chief:
    torch.save(
        {"weights": [v.value.detach().clone() for v in model.trainable_weights], "history": history.history}, out
    )
print("DONE", flush=True)
