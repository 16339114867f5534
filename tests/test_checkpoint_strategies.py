"""Checkpoints hold plain whole tensors: saved under one strategy, restored under another or none."""

from __future__ import annotations

import torch
from torch import nn

import distrib as ds


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def train_a_little(strategy: ds.Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]

    def step(inputs):
        x, y = inputs
        loss = ds.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for x in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x,))


def test_mirrored_checkpoint_restores_without_a_strategy(tmp_path):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        checkpoint = ds.Checkpoint(model=model, optimizer=optimizer)
    train_a_little(strategy, model, optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    plain = make_model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    ds.Checkpoint(model=plain, optimizer=plain_opt).restore(path)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert plain_opt.state_dict()["state"][0]["step"] == 3
    x = torch.randn(5, 4)
    model.eval(), plain.eval()
    assert torch.equal(model(x), plain(x))


def test_plain_checkpoint_restores_into_every_mirrored_replica(tmp_path):
    torch.manual_seed(7)
    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    train_a_little(ds.get_strategy(), plain, plain_opt)
    path = ds.Checkpoint(model=plain, optimizer=plain_opt).save(str(tmp_path / "ckpt"))

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        torch.manual_seed(99)
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ds.Checkpoint(model=model, optimizer=optimizer).restore(ds.latest_checkpoint(str(tmp_path)))
    assert ds.latest_checkpoint(str(tmp_path)) == path
    x = torch.randn(6, 4)
    plain.eval(), model.eval()
    expected = plain(x)
    # every replica's copy (parameters and BatchNorm statistics) now computes what the saved model computes
    outs = strategy.run(lambda v: model(v), args=(ds.PerReplica([x, x, x]),))
    for out in outs.values:
        torch.testing.assert_close(out, expected)
