"""Auto-sharded DataLoaders on real workers: what each worker loads, and which examples it read.

    distrib launch --workers N tests/scripts/input_shard_workers.py OUT_DIR

For every case of ``CASES`` each worker iterates ``experimental_distribute_dataset(loader)`` and writes, to
``OUT_DIR/w<index>.json``, the labels of its local replicas' parts at each step; every ``__getitem__`` call
(in this process or in a DataLoader worker process) appends its index to ``OUT_DIR/<case>-w<index>.calls``.
tests/test_input_sharding.py rebuilds the same loaders in one process and compares.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

SIZE = 23


class Counted(Dataset):
    """Example i is ``(tensor([i, 10 i]), i)``; each read is logged (append-only, so DataLoader workers can too)."""

    def __init__(self, size: int = SIZE, log: str | None = None) -> None:
        self.size, self.log = size, log

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
        return torch.tensor([float(i), 10.0 * i]), i


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pad_collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads to the batch's largest label (as NLP collates pad to the longest example): shares differ in width."""
    labels = torch.tensor([i for _, i in items])
    return torch.zeros(len(items), int(labels.max()) + 1), labels


#: case name -> (make the loader from a dataset, local replicas per worker, epochs)
CASES: dict[str, tuple[Callable[[Dataset], DataLoader], int, int]] = {
    "shuffle": (lambda d: DataLoader(d, batch_size=5, shuffle=True, generator=seeded()), 1, 2),
    "shuffle_two_replicas": (lambda d: DataLoader(d, batch_size=5, shuffle=True, generator=seeded()), 2, 1),
    "drop_last_workers": (
        lambda d: DataLoader(
            d, batch_size=4, shuffle=True, drop_last=True, generator=seeded(), num_workers=2, persistent_workers=True
        ),
        1,
        2,
    ),
    "batch_sampler": (lambda d: DataLoader(d, batch_sampler=[[3, 1], [0], [5, 6, 7, 8, 9, 2], [4, 10, 11]]), 1, 1),
    "sequential_sampler": (lambda d: DataLoader(d, batch_sampler=BatchSampler(SequentialSampler(d), 7, False)), 2, 1),
    "padding_collate": (lambda d: DataLoader(d, batch_size=6, collate_fn=pad_collate), 1, 1),
}


def labels(strategy: Any, element: Any) -> list[list[int]]:
    return [part[1].tolist() for part in strategy.experimental_local_results(element)]


def main(out: str) -> None:
    import distrib as ds

    options = ds.CommunicationOptions(timeout_seconds=30)
    one = ds.MultiWorkerMirroredStrategy(communication_options=options)
    two = ds.MultiWorkerMirroredStrategy(communication_options=options, devices=["cpu:0", "cpu:1"])
    rank = one.worker_index
    results: dict[str, Any] = {}
    for name, (make, replicas, epochs) in CASES.items():
        strategy = one if replicas == 1 else two
        loader = make(Counted(log=os.path.join(out, f"{name}-w{rank}.calls")))
        dist = strategy.experimental_distribute_dataset(loader)
        results[name] = {
            "sharded": dist.auto_sharded,
            "epochs": [[labels(strategy, x) for x in dist] for _ in range(epochs)],
        }

    # DATA: every worker reads everything
    loader = DataLoader(Counted(log=os.path.join(out, f"data_policy-w{rank}.calls")), batch_size=5)
    dist = one.experimental_distribute_dataset(
        loader, ds.InputOptions(experimental_auto_shard_policy=ds.AutoShardPolicy.DATA)
    )
    results["data_policy"] = {"sharded": dist.auto_sharded, "epochs": [[labels(one, x) for x in dist]]}

    # an exact resume: steps [0, 4) from the start, then from position 4 on (cycling over epochs) 9 more steps
    def resumed(start: int, steps: int) -> list[Any]:
        loader = DataLoader(
            Counted(log=os.path.join(out, f"resume{start}-w{rank}.calls")),
            batch_size=6,
            shuffle=True,
            generator=seeded(3),
        )
        batches = one.experimental_distribute_dataset(loader).numbered_batches(start=start, cycle=True)
        return [[y.tolist(), n] for _, y, n in itertools.islice(batches, steps)]

    results["resume0"] = resumed(0, 4)
    results["resume4"] = resumed(4, 9)

    # workers that shuffle differently are caught at the first step, on every worker
    try:
        loader = DataLoader(Counted(), batch_size=4, shuffle=True, generator=seeded(100 + rank))
        list(one.experimental_distribute_dataset(loader))
        results["mismatch"] = "no error"
    except ds.CollectiveError as e:
        results["mismatch"] = str(e)
    with open(os.path.join(out, f"w{rank}.json"), "w") as f:
        json.dump(results, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
