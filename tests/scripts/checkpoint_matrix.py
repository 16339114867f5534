"""The checkpoint matrix: saved under one strategy, loaded under another (tests/checkpoint/test_checkpoint_matrix.py).

    checkpoint_matrix.py save DIR KIND [KIND ...]    (single-process kinds; or one launched kind)
    checkpoint_matrix.py load DIR KIND [KIND ...]
    checkpoint_matrix.py crash DIR                   (distrib launch --workers 2: a save killed midway)

Kinds: ``plain`` (plain PyTorch, no distrib: ``torch.save`` / ``torch.load`` and, for a sharded
directory, torch's ``dcp_to_torch_save``), ``one_device``, ``mirrored`` (2 local replicas),
``sharded`` (ShardedStrategy; its worker count is the job's: 1 without ``distrib launch``) and
``mwms`` (MultiWorkerMirroredStrategy). A saver trains 3 Adam steps on global batches of 16 and saves
``ds.Checkpoint(model, optimizer, epoch)`` as ``DIR/<kind>-<N>/ckpt-1`` (plain: ``ckpt-1.pt``
through ``torch.save``). A loader restores every checkpoint found in DIR into a model built with
another seed, trains 2 more steps and writes the whole parameters (and the optimizer's step count)
to ``DIR/results/<saver>__<loader>.pt``: each must equal 5 uninterrupted steps in one process.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import distrib as ds

GLOBAL = 16


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 1, generator=g)) for _ in range(5)]


def strategy_of(kind: str) -> ds.Strategy:
    if kind == "one_device":
        return ds.OneDeviceStrategy("cpu")
    if kind == "mirrored":
        return ds.MirroredStrategy(["cpu:0", "cpu:1"])
    if kind == "sharded":  # units of >= 500 parameters: the 64x64 layer is one (with several workers)
        return ds.ShardedStrategy(devices=["cpu"], sharding_policy=ds.ShardingPolicy(min_params=500))
    if kind == "mwms":
        return ds.MultiWorkerMirroredStrategy()
    raise SystemExit(f"unknown kind {kind!r}")


def train(
    strategy: ds.Strategy | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    if strategy is None:  # plain PyTorch
        for x, y in data:
            ((model(x) - y).pow(2).sum(1).sum() / GLOBAL).backward()
            optimizer.step()
            optimizer.zero_grad()
        return

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        ds.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=GLOBAL).backward()
        optimizer.step()
        optimizer.zero_grad()

    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x, y))


def name_of(kind: str, strategy: ds.Strategy | None) -> str:
    return f"{kind}-{strategy.num_workers if strategy is not None else 1}"


def save(directory: str, kind: str) -> None:
    strategy = None if kind == "plain" else strategy_of(kind)
    where = os.path.join(directory, name_of(kind, strategy))
    if strategy is None:
        model = build(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        train(None, model, optimizer, batches()[:3])
        os.makedirs(where, exist_ok=True)  # torch's own format: what a plain-PyTorch user hands over
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": torch.tensor(3)},
            os.path.join(where, "ckpt-1.pt"),
        )
        return
    with strategy.scope():
        model = build(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(strategy, model, optimizer, batches()[:3])
    path = ds.Checkpoint(model=model, optimizer=optimizer, epoch=torch.tensor(3)).save(os.path.join(where, "ckpt"))
    print(
        f"saved {path} ({ds.Checkpoint.__name__} under {type(strategy).__name__}, format {strategy.checkpoint_format})",
        flush=True,
    )


def plain_load(path: str) -> dict:
    """What a plain-PyTorch user does with either format (no distrib)."""
    if os.path.isfile(path + ".pt"):
        data = torch.load(path + ".pt", weights_only=True)
        return data.get("objects", data)  # distrib's file holds the states under "objects"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path + ".consolidated.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it runs without a process group
        dcp_to_torch_save(path + ".dcp", out)
    objects = torch.load(out, weights_only=False)["objects"]  # torch's converter pickles; our own files do not
    state = objects["optimizer"]["state"]  # DCP keeps dict keys as strings
    objects["optimizer"]["state"] = {int(k): v for k, v in state.items()}
    return objects


def load(directory: str, kind: str) -> None:
    strategy = None if kind == "plain" else strategy_of(kind)
    me = name_of(kind, strategy)
    results = os.path.join(directory, "results")
    os.makedirs(results, exist_ok=True)
    for saver in sorted(d for d in os.listdir(directory) if "-" in d and d != "crash"):
        path = os.path.join(directory, saver, "ckpt-1")
        if strategy is None:
            model = build(7)
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            objects = plain_load(path)
            model.load_state_dict(objects["model"])
            optimizer.load_state_dict(objects["optimizer"])
            epoch = objects["epoch"]
        else:
            with strategy.scope():
                model = build(7)
                optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            epoch = torch.tensor(0)
            if saver.startswith("plain"):  # torch's own file: its state dicts, handed to the strategy's objects
                objects = torch.load(path + ".pt", weights_only=True)
                strategy.restore_checkpoint_state(model, objects["model"])
                strategy.restore_checkpoint_state(optimizer, objects["optimizer"])
                epoch = objects["epoch"]
            else:
                ds.Checkpoint(model=model, optimizer=optimizer, epoch=epoch).restore(path)
        assert int(epoch) == 3, (saver, me, epoch)
        train(strategy, model, optimizer, batches()[3:])
        whole = model.state_dict() if strategy is None else strategy.checkpoint_state(model)
        steps = (optimizer.state_dict() if strategy is None else strategy.checkpoint_state(optimizer))["state"]
        if strategy is None or strategy.is_chief:
            torch.save(
                {"model": whole, "steps": [float(s["step"]) for s in steps.values()]},
                os.path.join(results, f"{saver}__{me}.pt"),
            )
    print(f"{me} loaded every checkpoint", flush=True)


def crash(directory: str) -> None:
    """ckpt-1 saved; ckpt-2's save is killed midway on worker 1 (half its shard file written, SIGKILL)."""
    strategy = strategy_of("sharded")
    with strategy.scope():
        model = build(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoint = ds.Checkpoint(model=model, optimizer=optimizer)
    train(strategy, model, optimizer, batches()[:1])
    print("saved", checkpoint.save(os.path.join(directory, "crash", "ckpt")), flush=True)
    train(strategy, model, optimizer, batches()[1:2])
    if strategy.worker_index == 1:
        from die_midway import die_while_saving

        die_while_saving()
    try:
        checkpoint.save(os.path.join(directory, "crash", "ckpt"))
    except (ds.CheckpointError, ds.CollectiveError) as e:
        print(f"SAVE FAILED on worker {strategy.worker_index}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        os._exit(3)  # the group lost a worker: leave without tearing it down
    raise SystemExit("the save should have failed")


if __name__ == "__main__":
    mode, directory, kinds = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "crash":
        crash(directory)
    for kind in kinds:
        (save if mode == "save" else load)(directory, kind)
