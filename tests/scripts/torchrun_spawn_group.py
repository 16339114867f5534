"""Each process initialises torch.distributed itself, as the ``mp.spawn`` tutorials do, then builds
``ds.MultiWorkerMirroredStrategy()`` without a resolver: the initialised group is the cluster.

    python tests/scripts/torchrun_spawn_group.py --procs 2 --port P --out OUT

Every rank trains the same small model on its share of every global batch and writes its final
parameters to ``OUT.<rank>``. Then each rank builds the strategy again with a resolver, then an
environment, that disagree with the group, and prints the errors (``refused: ...``).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--procs", type=int, default=2)
p.add_argument("--port", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--global-batch", type=int, default=8)


def mismatch(rank: int, procs: int) -> None:
    import distrib as ds

    resolver = ds.cluster_resolver.SimpleClusterResolver(
        {"worker": [f"127.0.0.1:{7000 + i}" for i in range(procs + 1)]}, task_type="worker", task_id=rank
    )
    try:
        ds.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
        print(f"rank {rank}: a resolver of {procs + 1} workers was accepted", flush=True)
    except ValueError as e:
        print(f"refused: {e}", flush=True)
    os.environ.update(
        {"RANK": str(procs - 1 - rank), "WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "7000"}
    )
    try:
        ds.MultiWorkerMirroredStrategy()
        print(f"rank {rank}: an environment saying rank {procs - 1 - rank} was accepted", flush=True)
    except ValueError as e:
        print(f"refused: {e}", flush=True)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs)
    import distrib as ds  # after the group, as a framework that set it up would

    strategy = ds.MultiWorkerMirroredStrategy()
    print(
        f"rank {rank}: worker {strategy.worker_index} of {strategy.num_workers}, "
        f"{strategy.num_replicas_in_sync} replicas in sync",
        flush=True,
    )
    assert (strategy.worker_index, strategy.num_workers) == (rank, args.procs)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(args.global_batch, 6, generator=g), torch.randn(args.global_batch, 2, generator=g))
        for _ in range(args.steps)
    ]
    with strategy.scope():
        torch.manual_seed(10 + rank)  # differs per rank: the chief's initial values are broadcast
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(inputs):
        x, y = inputs
        per_example = F.mse_loss(model(x), y, reduction="none").mean(dim=1)
        loss = ds.compute_average_loss(per_example, global_batch_size=args.global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for inputs in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(inputs,))
    torch.save([t.detach().clone() for t in model.parameters()], f"{args.out}.{rank}")
    print(f"done: rank {rank}", flush=True)
    mismatch(rank, args.procs)
    # the group is this script's, as in the mp.spawn tutorials: a gloo group left to the interpreter's exit can
    # abort the process ("terminate called without an active exception", pytorch#190489)
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = p.parse_args()
    mp.spawn(worker, args=(arguments,), nprocs=arguments.procs)
