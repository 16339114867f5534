"""Mistakes that differ between 2 workers; each must be a CollectiveError (or ValueError) on every worker.

    distrib launch --workers 2 tests/scripts/mw_mismatch.py
Prints `OK <case>: <error>` for every case that raised as it should, `WRONG <case>` otherwise.
After each error the workers have run the same collectives, so the next case can go on.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import distrib as ds
from distrib.app.train import TensorBatches

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=20))
rank = strategy.worker_index


def expect(case: str, error: type, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except error as e:
        print(f"OK {case}: {str(e)[:160]}", flush=True)
        return
    print(f"WRONG {case}: no error", flush=True)


expect("reduce shapes", ds.CollectiveError, lambda: strategy.reduce("sum", torch.ones(3 + rank), axis=None))
expect(
    "reduce dtypes",
    ds.CollectiveError,
    lambda: strategy.reduce("sum", torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64)),
)
expect("gather shapes", ds.CollectiveError, lambda: strategy.gather(torch.ones(2, 3 + rank), axis=0))
# uneven batch sizes along the reduced / gathered axis are fine
uneven = strategy.reduce("mean", torch.ones(2 + rank, 3), axis=0)
gathered = strategy.gather(torch.full((1 + rank, 2), float(rank)), axis=0)
print(f"OK uneven reduce {uneven.tolist()} gather {gathered.shape[0]} rows", flush=True)


def build_different_models() -> None:
    with strategy.scope():
        model = torch.nn.Linear(4, 2 + rank)  # noqa: F841 - kept alive until the scope closes


expect("model differs", ds.CollectiveError, build_different_models)

x = torch.arange(24.0).reshape(12, 2)
short = TensorBatches(x[: 8 if rank == 0 else 12], batch_size=4)  # worker 0 has 2 batches, worker 1 has 3


def iterate(data) -> None:  # type: ignore[no-untyped-def]
    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(lambda b: b[0].sum(), args=(batch,))


expect("dataset ends early", ds.CollectiveError, lambda: iterate(short))
shuffled = TensorBatches(x, batch_size=4, shuffle=True, seed=rank)  # a different shuffle on every worker
expect("different global batches", ds.CollectiveError, lambda: iterate(shuffled))
loader = DataLoader(TensorDataset(x), batch_size=4, sampler=DistributedSampler(TensorDataset(x), 2, rank))
expect("DistributedSampler", ValueError, lambda: strategy.experimental_distribute_dataset(loader))
strategy.barrier()
print("done", flush=True)
