"""`ds.fit` in a process of its own: exact resume with BackupAndRestore, TensorBoard, chief-only output.

    python tests/scripts/fit_worker.py --out OUT [--backup-dir DIR] [--kill-at STEP] [--tensorboard DIR]
    distrib launch --workers 2 tests/scripts/fit_worker.py --out OUT --tensorboard DIR

With --kill-at S the process SIGKILLs itself after global step S when FIT_ATTEMPT is 0.
"""

import argparse
import os
import signal

import torch

import distrib as ds
from distrib.app.train import TensorBatches

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--backup-dir", default=None)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--tensorboard", default=None)
args = p.parse_args()

strategy = ds.MultiWorkerMirroredStrategy() if os.environ.get("TF_CONFIG") else ds.MirroredStrategy(["cpu:0", "cpu:1"])
g = torch.Generator().manual_seed(0)
x = torch.randn(80, 4, generator=g)
y = (x[:, :1] * 2 - x[:, 1:2]).add(0.1 * torch.randn(80, 1, generator=g))
data = TensorBatches(x, y, batch_size=16, shuffle=True, seed=3)

with strategy.scope():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)


class KillAt(ds.callbacks.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == args.kill_at and os.environ.get("FIT_ATTEMPT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [KillAt()]
if args.backup_dir:
    callbacks.append(ds.callbacks.BackupAndRestore(args.backup_dir, save_freq=2))
if args.tensorboard:
    callbacks.append(ds.callbacks.TensorBoard(os.path.join(args.tensorboard, f"task{strategy.worker_index}")))
history = ds.fit(
    model,
    data,
    optimizer=optimizer,
    loss="mse",
    epochs=3,
    metrics=["mae"],
    callbacks=callbacks,
    validation_data=[(x[:16], y[:16])],
    verbose=2,
)
if strategy.is_chief:
    torch.save([p.detach() for p in model.parameters()], args.out)
print("final loss", history.history["loss"][-1], flush=True)
