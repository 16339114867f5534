"""The checkpoint matrix across meshes (tests/strategies/test_mesh_checkpoints.py), on checkpoint_matrix.py's model.

    mesh_checkpoint_matrix.py save DIR KIND [KIND ...]
    mesh_checkpoint_matrix.py load DIR KIND [KIND ...]
    mesh_checkpoint_matrix.py crash DIR KIND           (distrib launch --workers 4: a save killed midway)

checkpoint_matrix.py's kinds (``plain``, ``one_device``, ``sharded``, ``mwms``, ...) and the meshes
of 4 workers: ``hybrid`` (``replicate`` 2 x ``batch`` 2, HSDP) and ``fsdp_tp`` (``batch`` 2 x
``model`` 2: the MLP's first layer ColwiseParallel, its second RowwiseParallel, then FSDP). The
savers, loaders and their results are checkpoint_matrix.py's (3 steps saved, 2 more after
loading, the whole parameters written per cell); several kinds in one launch share its workers.
"""

from __future__ import annotations

import os
import sys

import checkpoint_matrix as cm
import torch

import distrib as ds
from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy

_CLASSIC = cm.strategy_of


def strategy_of(kind: str) -> ds.Strategy:
    policy = ds.ShardingPolicy(min_params=500)
    if kind == "hybrid":
        return MeshStrategy(DeviceMesh((2, 2), ("replicate", "batch")), devices=["cpu"], sharding_policy=policy)
    if kind == "fsdp_tp":
        layout_map = LayoutMap(DeviceMesh((2, 2), ("batch", "model")))
        layout_map[r"^0\.weight"] = ("model", None)  # Linear(8, 64): ColwiseParallel
        layout_map[r"^2\.weight"] = (None, "model")  # Linear(64, 64): RowwiseParallel
        return MeshStrategy(layout_map=layout_map, devices=["cpu"], sharding_policy=policy)
    return _CLASSIC(kind)


cm.strategy_of = strategy_of  # checkpoint_matrix's save and load build their strategies through it


def crash(directory: str, kind: str) -> None:
    """ckpt-1 saved under ``kind``; ckpt-2's save is killed midway on worker 1 (half its shard file, SIGKILL)."""
    strategy = strategy_of(kind)
    with strategy.scope():
        model = cm.build(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoint = ds.Checkpoint(model=model, optimizer=optimizer)
    where = os.path.join(directory, f"crash-{kind}", "ckpt")
    cm.train(strategy, model, optimizer, cm.batches()[:1])
    print("saved", checkpoint.save(where), flush=True)
    cm.train(strategy, model, optimizer, cm.batches()[1:2])
    if strategy.worker_index == 1:
        from die_midway import die_while_saving

        die_while_saving()
    try:
        checkpoint.save(where)
    except (ds.CheckpointError, ds.CollectiveError) as e:
        print(f"SAVE FAILED on worker {strategy.worker_index}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        os._exit(3)  # the group lost a worker: leave without tearing it down
    raise SystemExit("the save should have failed")


if __name__ == "__main__":
    mode, directory, kinds = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "crash":
        crash(directory, kinds[0])
    for kind in kinds:
        (cm.save if mode == "save" else cm.load)(directory, kind)
