"""DataLoader worker processes under MultiWorkerMirroredStrategy (or ShardedStrategy: argument ``sharded``): the matrix of tests/input/test_dataloader_workers.py.

    distrib launch --workers 2 tests/scripts/input_loader_workers.py OUT_DIR

For ``num_workers`` 1 and 2, ``persistent_workers`` off and on, each worker trains 2 epochs on an auto-sharded
loader (``auto-W-P``) and on a hand-sharded one (``distribute_datasets_from_function`` with a ``DistributedSampler``,
``hand-W-P``), recording its replica's labels per step; then it drops every
loader and records how many loader processes are left. Writes ``OUT_DIR/w<index>.json``.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import sys
import time
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import distrib as ds

MATRIX = [(workers, persistent) for workers in (1, 2) for persistent in (False, True)]


class Squares(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i), float(i * i)]), i


def loader(num_workers: int, persistent: bool, seed: int = 5, context: str | None = None) -> DataLoader:
    """The loader of every case (the test's too): shuffled from a seeded generator, pinned (a no-op on the CPU)."""
    return DataLoader(
        Squares(),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        persistent_workers=persistent,
        pin_memory=True,
        multiprocessing_context=context if num_workers else None,
    )


def main(out: str, kind: str = "multi-worker") -> None:
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    options = ds.CommunicationOptions(timeout_seconds=60)
    strategy = (
        ds.ShardedStrategy(devices=["cpu"], communication_options=options)
        if kind == "sharded"
        else ds.MultiWorkerMirroredStrategy(communication_options=options)
    )
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(b: Any) -> torch.Tensor:
        x, y = b
        ds.compute_average_loss(model(x).sum(1), global_batch_size=4).backward()
        opt.step()
        opt.zero_grad()
        return y

    def epochs(dist: Any, samplers: list[DistributedSampler]) -> list[list[list[int]]]:
        seen = []
        for epoch in range(2):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            seen.append([strategy.run(step, args=(b,)).tolist() for b in dist])
        return seen

    def hand(num_workers: int, persistent: bool) -> tuple[Any, list[DistributedSampler]]:
        samplers: list[DistributedSampler] = []

        def dataset_fn(ctx: ds.InputContext) -> DataLoader:
            samplers.append(DistributedSampler(Squares(), ctx.num_input_pipelines, ctx.input_pipeline_id, seed=5))
            return DataLoader(
                Squares(),
                batch_size=ctx.get_per_replica_batch_size(4),
                sampler=samplers[-1],
                num_workers=num_workers,
                persistent_workers=persistent,
                pin_memory=True,
            )

        return strategy.distribute_datasets_from_function(dataset_fn), samplers

    results: dict[str, Any] = {}
    for num_workers, persistent in MATRIX:
        auto = strategy.experimental_distribute_dataset(loader(num_workers, persistent))
        assert auto.auto_sharded
        results[f"auto-{num_workers}-{persistent}"] = epochs(auto, [])
        results[f"hand-{num_workers}-{persistent}"] = epochs(*hand(num_workers, persistent))
        del auto
    deadline = time.monotonic() + 15
    while True:
        gc.collect()
        if not multiprocessing.active_children() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    results["children_left"] = len(multiprocessing.active_children())
    with open(os.path.join(out, f"w{strategy.worker_index}.json"), "w") as f:
        json.dump(results, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
