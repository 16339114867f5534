"""``ds.fit`` under ShardedStrategy with the checkpointing callbacks, unchanged (tests/keras/test_sharded_fit.py).

    distrib launch --workers 2 [--max-restarts 1] tests/scripts/sharded_fit.py DIR [--kill-at STEP]

Callbacks: BackupAndRestore(DIR/backup, save_freq=2), ModelCheckpoint(DIR/weights.{epoch}) and a
CheckpointManager(DIR/manager, max_to_keep=2) saved at every epoch's end; every one writes the sharded
format (``<prefix>.dcp``, each worker its own shards). With --kill-at S, worker 1 SIGKILLs itself after
global step S on the first attempt; the restarted group resumes from the backup. The chief writes the
final whole parameters to DIR/final.pt.
"""

import argparse
import os
import signal

import torch

import distrib as ds
from distrib.app.train import TensorBatches

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("--kill-at", type=int, default=-1)
args = p.parse_args()

strategy = ds.ShardedStrategy(devices=["cpu"], sharding_policy=ds.ShardingPolicy(min_params=100))
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 4, generator=g)
y = (x[:, :1] * 2 - x[:, 1:2]).add(0.1 * torch.randn(96, 1, generator=g))
data = TensorBatches(x, y, batch_size=16, shuffle=True, seed=3)

with strategy.scope():
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)


class KillAt(ds.callbacks.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == args.kill_at and strategy.worker_index == 1 and os.environ.get("DISTRIB_RESTART") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


class SaveEachEpoch(ds.callbacks.Callback):
    def __init__(self) -> None:
        self.manager = ds.CheckpointManager(
            ds.Checkpoint(model=model, optimizer=optimizer), os.path.join(args.dir, "manager"), max_to_keep=2
        )

    def on_epoch_end(self, epoch, logs=None):
        self.manager.save(checkpoint_number=epoch + 1)


callbacks = [
    KillAt(),
    ds.callbacks.BackupAndRestore(os.path.join(args.dir, "backup"), save_freq=2),
    ds.callbacks.ModelCheckpoint(os.path.join(args.dir, "weights.{epoch}")),
    SaveEachEpoch(),
]
history = ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=3, callbacks=callbacks, verbose=2)
whole = strategy.checkpoint_state(model)
if strategy.is_chief:
    torch.save(whole, os.path.join(args.dir, "final.pt"))
print(f"worker {strategy.worker_index} done, loss {history.history['loss'][-1]:.6f}", flush=True)
