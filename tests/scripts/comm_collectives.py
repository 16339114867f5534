"""Every collective of ProcessGroupCommunicator between 2 real workers; prints `OK <name>` per check.

    distrib launch --workers 2 tests/scripts/comm_collectives.py [dead-peer]
With `dead-peer`, worker 1 exits at once and worker 0's backward must fail with CollectiveError
within the 3 s timeout (it prints `DEAD PEER ... after S s`).
"""

import gc
import os
import sys
import time

import torch

import distrib as ds
from distrib.comm import CollectiveError

strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=3))
comm = strategy.communicator
rank = strategy.worker_index
assert strategy.num_workers == 2 and comm.world_size == 2 and strategy.is_chief == (rank == 0)

if sys.argv[1:] == ["dead-peer"]:
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy.barrier()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        model(torch.ones(2, 4)).sum().backward()  # the bucketed all-reduce finds no peer
    except CollectiveError as e:
        print(f"DEAD PEER {type(e).__name__} after {time.monotonic() - start:.1f}s: {e}", flush=True)
        os._exit(0)
    print("no error", flush=True)
    os._exit(1)


def check(name: str, ok: bool) -> None:
    print(f"{'OK' if ok else 'FAILED'} {name}", flush=True)


t = torch.tensor([1.0 + rank, 10.0])
comm.all_reduce([t])
check("all_reduce", t.tolist() == [3.0, 20.0])
a, b = torch.ones(2) * (rank + 1), torch.ones(3, dtype=torch.float32) * 10
comm.all_reduce([a, b])
check("all_reduce several", a.tolist() == [3.0, 3.0] and b.tolist() == [20.0] * 3)
c = torch.full((4,), float(rank))
check("all_reduce_async", comm.wait(comm.all_reduce_async(c)) is c and c.tolist() == [1.0] * 4)
gathered = comm.all_gather(torch.full((rank + 1, 2), float(rank)), axis=0)  # uneven: 1 row, then 2 rows
check("all_gather uneven", gathered.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
check(
    "all_gather_object",
    comm.all_gather_object({"rank": rank, "x": "y" * rank}) == [{"rank": 0, "x": ""}, {"rank": 1, "x": "y"}],
)
w = torch.full((3,), float(rank))
comm.broadcast([w], src=1)
check("broadcast", w.tolist() == [1.0] * 3)
check("broadcast_object", comm.broadcast_object(["from", rank], src=0) == ["from", 0])
part = comm.reduce_scatter(torch.arange(4.0) + rank)
check("reduce_scatter", part.tolist() == ([1.0, 3.0] if rank == 0 else [5.0, 7.0]))
strategy.barrier()
check("barrier", True)

# the gradient reducer of an optimizer that is gone reduces nothing: only worker 0 runs a backward
with strategy.scope():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
del optimizer
gc.collect()
if rank == 0:
    model(torch.ones(2, 4)).sum().backward()  # with the reducer still hooked, this would wait for a peer
strategy.barrier()
check("reducer removed with its optimizer", True)
