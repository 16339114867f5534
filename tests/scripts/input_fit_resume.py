"""``ds.fit`` on a shuffled DataLoader over a map-style dataset, stopped mid-epoch and resumed on another number of
workers (tests/input/test_fit_resume.py).

    distrib launch --workers N tests/scripts/input_fit_resume.py OUT_DIR BACKUP_DIR STOP_AT

Two epochs of 5 global batches of 8 (40 examples, the loader's shuffle seeded), BackupAndRestore every step.
With STOP_AT > 0 every worker exits with code 3 after global step STOP_AT is backed up (a job stopped there);
a later run with the same BACKUP_DIR resumes from it. The chief writes the final parameters to
OUT_DIR/params.pt; every worker writes the indices its dataset loaded to OUT_DIR/loads-w<index>.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import distrib as ds

out, backup, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Regression(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(40, 4, generator=g)
        self.y = self.x[:, :1] * 2 - self.x[:, 1:2]
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded.append(i)
        return self.x[i], self.y[i]


class StopAt(ds.callbacks.Callback):
    """Exits every worker once global step ``stop_at`` is backed up (it runs after BackupAndRestore)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == stop_at:
            strategy.barrier()
            os._exit(3)


strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
data = Regression()
loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
with strategy.scope():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
callbacks = [ds.callbacks.BackupAndRestore(backup, save_freq=1), StopAt()]
ds.fit(model, loader, optimizer=optimizer, loss="mse", epochs=2, callbacks=callbacks, verbose=0)
with open(os.path.join(out, f"loads-w{strategy.worker_index}"), "w") as f:
    f.write(" ".join(map(str, data.loaded)))
if strategy.is_chief:
    torch.save([p.detach() for p in model.parameters()], os.path.join(out, "params.pt"))
print("DONE", flush=True)
