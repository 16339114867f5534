"""A model built under ds.ShardedStrategy (deferred initialisation) against the same model built plainly.

Run by tests/strategies/test_deferred_init.py through ``distrib launch --workers N``. Modes:

* ``equal``: a model of torch.nn layers and user modules with custom init (an Embedding tied to the head,
  a TransformerEncoderLayer, a Conv2d, a Block with ``nn.init.normal_`` and ``nn.Parameter(torch.randn(...))``,
  buffers, ``trunc_normal_``) built with seed 0 in the scope; every worker gathers every parameter
  (``full_tensor()``) and buffer and compares it bit for bit with a plain build with seed 0 in the same
  process, then checks that the generator is where a plain build leaves it, and that one SGD step of the
  sharded model equals one of the plain model. ``--seed-by-rank``: each worker seeds with its rank (the
  chief's values must win). Prints ``RESULT {json}``.
* ``memory``: the residual-block model of benchmarks/sharded_memory.py (``--width``, ``--blocks``) built in
  the scope (``--how deferred``, the default), in the scope with ``deferred_init=False`` (``whole``) or
  outside any scope (``plain``); prints the peak RSS of the build above the baseline (VmHWM, reset
  before), the RSS after it, and its seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["equal", "memory"])
p.add_argument("--seed-by-rank", action="store_true")
p.add_argument("--width", type=int, default=2048)
p.add_argument("--blocks", type=int, default=12)
p.add_argument("--how", choices=["deferred", "whole", "plain"], default="deferred")
args = p.parse_args()
torch.set_num_threads(1)


class Block(nn.Module):
    """User code with custom init in __init__."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        nn.init.normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)
        self.proj = nn.Parameter(torch.randn(2 * d, d) * 0.02)  # built with values: whole once, as plainly
        self.scale = nn.Parameter(torch.empty(d))
        nn.init.trunc_normal_(self.scale, std=0.5)  # rejection sampling: data-dependent
        pe = torch.empty(5, d)
        pe.fill_(1.0)
        pe[:, 0::2] = torch.sin(torch.arange(5.0)).unsqueeze(1)
        self.register_buffer("pe", pe)
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x + torch.relu(self.fc(x)) @ self.proj * self.scale + self.pe[0])


class Model(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.conv = nn.Conv2d(1, 2, 3)
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # weight tying
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.layer(self.emb(tokens)))
        return self.head(x) + self.conv.weight.sum() * 0


def status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k.startswith("Vm")}


def equal() -> None:
    strategy = ds.ShardedStrategy(devices=["cpu"], sharding_policy=ds.ShardingPolicy(module_classes=[Block]))
    rank = strategy.worker_index
    seed = rank if args.seed_by_rank else 0
    with strategy.scope():
        torch.manual_seed(seed)
        model = Model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    after_sharded = torch.rand(4)
    torch.manual_seed(0)
    plain = Model()
    after_plain = torch.rand(4)
    local = sum(p.to_local().numel() for p in model.parameters())
    names, differ = 0, []
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        names += 1
        if not torch.equal(p.full_tensor(), q.detach()):
            differ.append(name)
    for (name, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
        names += 1
        if not torch.equal(b, c):
            differ.append(name)
    tokens = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(1))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for m, opt, x in (
        (plain, plain_opt, tokens),
        (model, optimizer, tokens[2 * rank : 2 * rank + 2] if strategy.num_workers == 2 else tokens[rank : rank + 1]),
    ):
        loss = m(x).pow(2).sum() / tokens.shape[0]
        loss.backward()
        opt.step()
    step_diff = max(
        (p.full_tensor() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), plain.parameters())
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "worker": rank,
                "tensors": names,
                "differ": differ,
                "local": local,
                "total": sum(p.numel() for p in plain.parameters()),
                "tied": model.head.weight is model.emb.weight,
                "rng": torch.equal(after_sharded, after_plain) if not args.seed_by_rank else None,
                "step_diff": step_diff,
            }
        ),
        flush=True,
    )


def memory() -> None:
    class Residual(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = nn.Linear(d, d)

    strategy = ds.ShardedStrategy(
        devices=["cpu"],
        sharding_policy=ds.ShardingPolicy(module_classes=[Residual]),
        deferred_init=args.how == "deferred",
    )
    strategy.barrier()
    import torch.distributed.fsdp  # noqa: F401  (loaded on first use: the baseline's, not the model's)

    warm = nn.Linear(4, 4)
    torch.optim.Adam(warm.parameters()).step()
    base = status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.how == "plain":
        model = nn.Sequential(*[Residual(args.width) for _ in range(args.blocks)])
    else:
        with strategy.scope():
            model = nn.Sequential(*[Residual(args.width) for _ in range(args.blocks)])
    built = status()
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    print(
        "RESULT "
        + json.dumps(
            {
                "worker": int(os.environ.get("RANK", "0")),
                "how": args.how,
                "local": local,
                "build_mb": round((built["VmHWM"] - base["VmRSS"]) / 1e6, 1),
                "after_mb": round((built["VmRSS"] - base["VmRSS"]) / 1e6, 1),
                "build_s": round(seconds, 2),
            }
        ),
        flush=True,
    )


equal() if args.mode == "equal" else memory()
