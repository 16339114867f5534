"""pytorch/examples' ``ddp-tutorial-series/multigpu_torchrun.py`` ported to distrib.

Run it as the original is run::

    torchrun --standalone --nproc-per-node 2 examples/multigpu_torchrun.py 50 10
    distrib launch --workers 2 examples/multigpu_torchrun.py 50 10     # the same, distrib's launcher

Kill it and run it again: it resumes from the snapshot. What changed from DDP, and why
(docs/coming-from-ddp.md says more):

1. ``ds.MultiWorkerMirroredStrategy()`` replaces ``init_process_group`` + ``DDP(model)``: it reads
   torchrun's environment (or TF_CONFIG) and owns the process group; no ``destroy_process_group``.
2. The model and optimizer are built in ``strategy.scope()``; ``self.model.module`` goes.
3. ``DistributedSampler`` stays, but inside ``strategy.distribute_datasets_from_function``, which
   tells each input pipeline its index and count (``ctx``) and its per-replica batch.
4. The loss is per example, divided by the *global* batch (``ds.compute_average_loss``), since
   distrib sums gradients where DDP averages them.
5. Only the chief saves (``strategy.is_chief``, not ``LOCAL_RANK == 0``, which is one process per
   node), to the path it was given, atomically, and snapshots load with ``weights_only=True``.
6. The loss is mean squared error. The original's ``CrossEntropyLoss`` over a single output is a
   softmax over one class: identically 0, so its model never changes. Regression on ``Linear(20, 1)``
   is what the tutorial means.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import distrib as ds


class MyTrainDataset(Dataset):
    """``size`` random (20 features, 1 target) pairs, the same on every worker (seeded)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(
        self, strategy, model, train_data, optimizer, save_every: int, snapshot_path: str, batch_size: int
    ) -> None:
        self.strategy = strategy
        self.batch_size = batch_size
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, weights_only=True)  # (5)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        output = self.model(source)
        loss = ds.compute_average_loss(F.mse_loss(output, targets, reduction="none").mean(dim=1))  # (4) (6)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def _run_epoch(self, epoch: int) -> torch.Tensor:
        print(
            f"[worker {self.strategy.worker_index}] Epoch {epoch} | Batchsize: {self.batch_size} | "
            f"Steps: {len(self.train_data)}"
        )
        total = torch.zeros(())
        for source, targets in self.train_data:
            loss = self.strategy.run(self._run_batch, args=(source, targets))
            total += self.strategy.reduce("sum", loss, axis=None)
        return total / len(self.train_data)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)  # (5) a kill never leaves half a file
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.strategy.is_chief:
                print(f"Epoch {epoch} | loss {loss.item():.6f}")
                if epoch % self.save_every == 0 or epoch == max_epochs - 1:
                    self._save_snapshot(epoch)


def load_train_objs(strategy):
    train_set = MyTrainDataset(2048)  # load your dataset
    torch.manual_seed(0)  # not needed for the workers to agree (the chief's initial values are broadcast),
    # only to make a run repeatable
    with strategy.scope():  # (2)
        model = torch.nn.Linear(20, 1)  # load your model
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(strategy, dataset: Dataset, batch_size: int):
    def dataset_fn(ctx):  # (3) one pipeline per worker; DistributedSampler gets its index and count
        sampler = DistributedSampler(dataset, ctx.num_input_pipelines, ctx.input_pipeline_id, shuffle=False)
        return DataLoader(dataset, batch_size=ctx.get_per_replica_batch_size(batch_size), sampler=sampler)

    return strategy.distribute_datasets_from_function(dataset_fn)


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt") -> None:
    strategy = ds.MultiWorkerMirroredStrategy()  # (1)
    dataset, model, optimizer = load_train_objs(strategy)
    global_batch = batch_size * strategy.num_replicas_in_sync  # --batch_size is per device, as in the original
    train_data = prepare_dataloader(strategy, dataset, global_batch)
    trainer = Trainer(strategy, model, train_data, optimizer, save_every, snapshot_path, batch_size)
    trainer.train(total_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where the snapshot is saved and resumed from")
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
