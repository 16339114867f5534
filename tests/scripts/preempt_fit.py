"""A worker script for the preemption tests of ds.fit: BackupAndRestore(save_before_preemption=True).

    distrib launch --workers 2 tests/scripts/preempt_fit.py --out OUT --backup-dir DIR [--notice-at BATCH]

Fits a small CNN for 2 epochs of 10 global batches under MultiWorkerMirroredStrategy. On the first
attempt, before its global batch --notice-at, worker 1 sends itself SIGTERM. Prints
``START worker=W restart=R epoch=E step=S`` (where fit resumes) and ``NOTICE ...``; the chief writes
the final parameters to --out.
"""

import argparse
import os
import signal
import time

import torch
from torch import nn

import distrib as ds
from distrib.app.train import TensorBatches

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--backup-dir", required=True)
p.add_argument("--notice-at", type=int, default=-1)
args = p.parse_args()
restart = int(os.environ.get("DISTRIB_RESTART", "0"))
strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
g = torch.Generator().manual_seed(0)
data = TensorBatches(
    torch.randn(160, 1, 8, 8, generator=g),
    torch.randint(0, 10, (160,), generator=g),
    batch_size=16,
    shuffle=True,
    seed=5,
)
with strategy.scope():
    torch.manual_seed(strategy.worker_index * 1000)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)


class Notice(ds.callbacks.Callback):
    """Reports where fit resumed; sends the notice before global batch --notice-at on the first attempt."""

    def on_train_begin(self, logs=None):
        print(
            f"START worker={strategy.worker_index} restart={restart} epoch={int(self.loop.epoch)} "
            f"step={int(self.loop.step_in_epoch)}",
            flush=True,
        )

    def on_train_batch_begin(self, batch, logs=None):
        at = int(self.loop.epoch) * len(data) + batch
        if at == args.notice_at and restart == 0 and strategy.worker_index == 1:
            print(f"NOTICE worker=1 batch={at} t={time.time():.4f}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


backup = ds.callbacks.BackupAndRestore(args.backup_dir, save_before_preemption=True)
ds.fit(model, data, optimizer=optimizer, loss=nn.CrossEntropyLoss(), epochs=2, verbose=0, callbacks=[backup, Notice()])
if strategy.is_chief:
    torch.save([q.detach() for q in model.parameters()], args.out)
print(f"done: worker {strategy.worker_index}", flush=True)
