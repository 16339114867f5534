"""Checkpoints under strategies: saved under one, restored under another or none; partial and failed restores
under MirroredStrategy; two real workers meeting at the barrier while the chief writes (its own timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from helpers import launch
from torch import nn

import distrib as ds
from distrib import context
from distrib.checkpoint import checkpoint_timeout, checkpoints_iterator
from distrib.strategies import DefaultStrategy


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


# --------------------------------------------------------------- workers and the barrier's own timeout
class _Worker(DefaultStrategy):
    """A strategy whose chief role is set by the test: the checkpoint contract is all Checkpoint uses."""

    def __init__(self, chief: bool, barriers: list) -> None:
        super().__init__()
        self.chief, self.barriers = chief, barriers

    @property
    def is_chief(self) -> bool:
        return self.chief

    def barrier(self, timeout=None) -> None:
        self.barriers.append(timeout)


def test_non_chief_writes_nothing_but_keeps_numbering(tmp_path):
    barriers: list = []
    strategy = _Worker(chief=False, barriers=barriers)
    model = torch.nn.Linear(1, 1)
    context.set_owner(model, strategy)  # what a strategy's scope records for the modules it distributes

    ckpt = ds.Checkpoint(model=model, w=torch.zeros(1))
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-1")
    manager = ds.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=1)
    assert manager.save() == str(tmp_path / "run" / "ckpt-2")
    assert ckpt.write(tmp_path / "w") == str(tmp_path / "w")
    assert list(tmp_path.iterdir()) == []  # not even the manager's directory
    assert ckpt.save_counter == 2 and len(barriers) == 3

    strategy.chief = True
    path = manager.save()
    assert path == str(tmp_path / "run" / "ckpt-3") and os.path.isfile(path + ".pt")
    assert len(barriers) == 4


def test_the_barrier_after_a_save_has_its_own_timeout(tmp_path, monkeypatch):
    barriers: list = []
    strategy = _Worker(chief=True, barriers=barriers)
    model = torch.nn.Linear(1, 1)
    context.set_owner(model, strategy)
    ckpt = ds.Checkpoint(model=model)
    monkeypatch.delenv("DISTRIB_CHECKPOINT_TIMEOUT", raising=False)
    ckpt.save(tmp_path / "a")
    ckpt.write(tmp_path / "b", timeout=30)
    monkeypatch.setenv("DISTRIB_CHECKPOINT_TIMEOUT", "7200")
    ckpt.save(tmp_path / "a")
    ds.CheckpointManager(ckpt, tmp_path / "m", timeout=45).save()
    assert barriers == [1800.0, 30.0, 7200.0, 45.0]
    monkeypatch.setenv("DISTRIB_CHECKPOINT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DISTRIB_CHECKPOINT_TIMEOUT='soon' must be a positive number of seconds"):
        ckpt.save(tmp_path / "a")
    assert ckpt.save_counter == 3 and checkpoint_timeout(12.5) == 12.5  # the refused save changed nothing
    with pytest.raises(ValueError, match="timeout=-1"):
        checkpoint_timeout(-1)


def test_a_mirrored_evaluator_restores_only_the_model_into_every_replica(tmp_path):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train_a_little(strategy, model, optimizer)
    path = ds.Checkpoint(model=model, optimizer=optimizer, epoch=torch.tensor(2)).save(str(tmp_path / "ckpt"))

    evaluator = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with evaluator.scope():
        eval_model = make_model()
    status = ds.Checkpoint(model=eval_model).read(path).expect_partial()
    assert status.unused == ["epoch", "optimizer"]
    x = torch.randn(6, 4)
    model.eval(), eval_model.eval()
    expected = model(x)
    for out in evaluator.run(lambda v: eval_model(v), args=(ds.PerReplica([x, x]),)).values:
        torch.testing.assert_close(out, expected)


class Flaky:
    """Restored after the model; it refuses the saved state, so the model must be put back on every replica."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] == 99:
            raise RuntimeError("cannot load")
        self.n = state["n"]


def test_a_failed_restore_leaves_every_mirrored_replica_as_it_was(tmp_path):
    torch.manual_seed(7)
    plain = make_model()
    train_a_little(ds.get_strategy(), plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    path = ds.Checkpoint(model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1), flaky=Flaky(99)).save(
        str(tmp_path / "ckpt")
    )
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(99)
        model = make_model()
        two_groups = torch.optim.SGD(
            [
                {"params": list(model[0].parameters())},
                {"params": list(model[1].parameters()) + list(model[3].parameters())},
            ],
            lr=0.1,
        )
        one_group = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    model.eval()

    def outputs():
        return [out.detach().clone() for out in strategy.run(lambda v: model(v), args=(ds.PerReplica([x, x]),)).values]

    before = outputs()
    with pytest.raises(ds.CheckpointError, match="optimizer has 2"):  # found before anything changes
        ds.Checkpoint(model=model, optimizer=two_groups, flaky=Flaky(1)).restore(path)
    with pytest.raises(ds.CheckpointError, match="cannot load.*every object was put back"):  # found while loading
        ds.Checkpoint(model=model, optimizer=one_group, flaky=Flaky(1)).restore(path)
    for a, b in zip(before, outputs()):
        assert torch.equal(a, b)
    assert not torch.equal(before[0], plain.eval()(x))


SLOW_CHIEF = textwrap.dedent("""
    import errno, os, sys, time
    import torch
    import distrib as ds
    from distrib.checkpoint import CheckpointError
    from distrib.comm import CollectiveError

    mode, out = sys.argv[1], sys.argv[2]
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=3))
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):  # the chief's write outlasts the collectives' 3 s timeout
        time.sleep(4.5)
        return real_save(obj, f, *args, **kwargs)

    def full_save(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    own = mode == "worker_full" and not strategy.is_chief  # a path of its own, as the TF tutorials give it
    if strategy.is_chief and mode != "worker_full":
        torch.save = slow_save if mode == "slow" else full_save
    elif own:
        torch.save = full_save
    try:
        path = ds.Checkpoint(model=model, optimizer=optimizer).save(out + ("/workertemp_1/ckpt" if own else "/ckpt"))
        total = float(strategy.reduce("SUM", torch.ones(1)))  # the workers still talk after the save
        print(f"SAVED {os.path.basename(path)}, then reduce={total}", flush=True)
    except (CheckpointError, CollectiveError) as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        sys.exit(3)
""")


def _two_workers(tmp_path, mode: str) -> tuple[int, dict[str, str]]:
    script = tmp_path / "worker.py"
    script.write_text(SLOW_CHIEF)
    code, out, _ = launch("--workers", "2", str(script), mode, str(tmp_path / "ckpts"), timeout=150)
    lines = {}
    for line in out.splitlines():
        for worker in ("[worker 0] ", "[worker 1] "):
            if line.startswith(worker) and line[len(worker) :].startswith(("SAVED", "CheckpointError", "Collective")):
                lines[worker.strip()] = line[len(worker) :]
    return code, lines


def test_a_save_longer_than_the_collective_timeout_succeeds_on_every_worker(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTRIB_CHECKPOINT_TIMEOUT", raising=False)
    code, lines = _two_workers(tmp_path, "slow")
    assert code == 0, lines
    assert lines == {"[worker 0]": "SAVED ckpt-1, then reduce=2.0", "[worker 1]": "SAVED ckpt-1, then reduce=2.0"}
    assert ds.latest_checkpoint(tmp_path / "ckpts") == str(tmp_path / "ckpts" / "ckpt-1")


def test_the_checkpoint_timeout_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTRIB_CHECKPOINT_TIMEOUT", "2")  # shorter than the chief's 4.5 s write
    code, lines = _two_workers(tmp_path, "slow")
    assert code != 0 and lines.get("[worker 1]", "").startswith("CollectiveError"), lines
    assert "barrier" in lines["[worker 1]"]


def test_a_chief_that_cannot_write_fails_the_save_on_every_worker(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTRIB_CHECKPOINT_TIMEOUT", raising=False)
    code, lines = _two_workers(tmp_path, "full")
    assert code != 0
    assert (
        lines["[worker 0]"].startswith("CheckpointError: Writing checkpoint file") and "ENOSPC" in lines["[worker 0]"]
    )
    assert lines["[worker 1]"].startswith("CheckpointError: The chief could not write the checkpoint: Writing")
    assert ds.latest_checkpoint(tmp_path / "ckpts") is None


def test_a_worker_that_cannot_write_its_own_copy_fails_the_save_on_every_worker(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTRIB_CHECKPOINT_TIMEOUT", raising=False)
    code, lines = _two_workers(tmp_path, "worker_full")
    assert code != 0
    assert (
        lines["[worker 1]"].startswith("CheckpointError: Writing checkpoint file") and "ENOSPC" in lines["[worker 1]"]
    )
    assert lines["[worker 0]"].startswith(
        "CheckpointError: Worker 1 could not write its own copy of the checkpoint "
        "(it was given a path other than the chief's): Writing checkpoint file"
    )
    assert ds.latest_checkpoint(tmp_path / "ckpts") == str(tmp_path / "ckpts" / "ckpt-1")  # the chief's is written


WRITER = """
import sys, time, torch, distrib as ds
directory = sys.argv[1]
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
manager = ds.CheckpointManager(ds.Checkpoint(model=model, optimizer=optimizer), directory, max_to_keep=None)
for step in range(1, 4):
    with torch.no_grad():
        model.weight.fill_(step)
    manager.save()
    time.sleep(1.5)
open(directory + "/DONE", "w").close()
"""


def test_a_side_car_evaluator_follows_a_training_process(tmp_path):
    """TF's side-car evaluation: checkpoints_iterator + read(...).expect_partial() of the model alone."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120

    def done() -> bool:
        return (tmp_path / "DONE").exists() or writer.poll() is not None or time.monotonic() > deadline

    model, evaluated = torch.nn.Linear(2, 1), []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # expect_partial(): no warning about the optimizer
            for path in checkpoints_iterator(tmp_path, timeout=2, timeout_fn=done):
                ds.Checkpoint(model=model).read(path).expect_partial()
                evaluated.append((os.path.basename(path), model.weight[0, 0].item()))
    finally:
        writer.kill()
        _, err = writer.communicate()
    assert (tmp_path / "DONE").exists(), err
    names = [name for name, _ in evaluated]
    assert names[-1] == "ckpt-3" and names == sorted(set(names), key=lambda n: int(n.split("-")[1]))
    assert all(value == float(name.split("-")[1]) for name, value in evaluated)  # each file, whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_checkpoint_is_cpu_on_disk_and_restores_on_device(tmp_path):
    model = torch.nn.Linear(3, 2).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3, device="cuda")).sum().backward()
    opt.step()
    path = ds.Checkpoint(model=model, opt=opt).save(tmp_path / "c")
    data = torch.load(path + ".pt", map_location="cpu", weights_only=True)
    assert data["objects"]["model"]["weight"].device.type == "cpu"
    cpu_model = torch.nn.Linear(3, 2)
    ds.Checkpoint(model=cpu_model, opt=torch.optim.Adam(cpu_model.parameters())).restore(path)
    assert torch.equal(cpu_model.weight, model.weight.cpu())
    gpu_model = torch.nn.Linear(3, 2).cuda()
    gpu_opt = torch.optim.Adam(gpu_model.parameters())
    ds.Checkpoint(model=gpu_model, opt=gpu_opt).restore(path)
    assert gpu_model.weight.device.type == "cuda" and torch.equal(gpu_model.weight, model.weight)
    assert gpu_opt.state_dict()["state"][0]["exp_avg"].device.type == "cuda"
    # a failed restore on the GPU leaves the device tensors unchanged
    before = gpu_model.weight.detach().clone()
    with pytest.raises(ds.CheckpointError):
        ds.Checkpoint(model=gpu_model, opt=torch.optim.Adam([gpu_model.weight])).restore(path)
    assert torch.equal(gpu_model.weight, before)
