"""20 Adam steps of a small MLP under ds.ShardedStrategy (run by distrib launch --workers N).

The chief writes the final parameters (whole, via the strategy's checkpoint contract) to --out.
Options: --zero2 (reshard_after_forward=False), --mixed bf16-mixed, --listed (the optimizer gets
list(model.parameters()), taken before the model is sharded), --clip (clip_grad_norm_ across shards),
--accumulate (two backward passes per step, half the batch each).
"""

import argparse
import os

import torch

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--zero2", action="store_true")
p.add_argument("--mixed", default=None)
p.add_argument("--listed", action="store_true")
p.add_argument("--clip", action="store_true")
p.add_argument("--accumulate", action="store_true")
p.add_argument("--seed-by-rank", action="store_true", help="each worker builds a different model: the chief's wins")
p.add_argument("--scaler", action="store_true", help="float16 autocast with a torch.amp.GradScaler")
p.add_argument("--poison", type=int, default=-1, help="a NaN in the last example of this step's global batch")
args = p.parse_args()

GLOBAL = 16


def build() -> torch.nn.Module:
    torch.manual_seed(int(os.environ.get("RANK", "0")) if args.seed_by_rank else 0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


strategy = ds.ShardedStrategy(
    devices=["cpu"],  # the same on a GPU machine
    sharding_policy=ds.ShardingPolicy(min_params=200),
    reshard_after_forward=not args.zero2,
    mixed_precision=args.mixed,
)
with strategy.scope():
    model = build()
    params = list(model.parameters()) if args.listed else model.parameters()
    optimizer = torch.optim.Adam(params, lr=0.01)

g = torch.Generator().manual_seed(1)
batches = [(torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 1, generator=g)) for _ in range(args.steps)]
if args.poison >= 0:
    batches[args.poison][0][-1, 0] = float("nan")  # the last worker's part
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if args.scaler else None


def step(x, y):
    if scaler is not None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ds.compute_average_loss((model(x).float() - y).pow(2).sum(1), global_batch_size=GLOBAL)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return
    if args.accumulate:
        half = x.shape[0] // 2
        for xs, ys in ((x[:half], y[:half]), (x[half:], y[half:])):
            ds.compute_average_loss((model(xs) - ys).pow(2).sum(1), global_batch_size=GLOBAL).backward()
    else:
        ds.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=GLOBAL).backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()


for x, y in strategy.experimental_distribute_dataset(batches):
    strategy.run(step, args=(x, y))
state = strategy.checkpoint_state(model)
opt_state = strategy.checkpoint_state(optimizer)
if strategy.is_chief:
    torch.save({"model": state, "optimizer": opt_state, "scale": scaler.get_scale() if scaler else None}, args.out)
if scaler is not None:
    print(f"worker {strategy.worker_index}: scale {scaler.get_scale()}")
print(
    f"worker {strategy.worker_index}: done, {sum(p.to_local().numel() if hasattr(p, 'to_local') else p.numel() for p in model.parameters())} local parameter elements"
)
