"""Tests for distrib.checkpoint: round trips, numbering, atomicity, safety, multi-worker."""

from __future__ import annotations

import json
import os


import pytest
import torch

import distrib.checkpoint as dc
from distrib import context
from distrib.strategies import DefaultStrategy
from distrib.checkpoint import Checkpoint, CheckpointError, CheckpointManager, latest_checkpoint


def _trained() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _fresh() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def test_round_trip_linear_adam_epoch(tmp_path):
    model, opt = _trained()
    epoch = torch.tensor(7)
    path = Checkpoint(model=model, optimizer=opt, epoch=epoch).save(tmp_path / "ckpt")

    model2, opt2 = _fresh()
    epoch2 = torch.tensor(0)
    held = epoch2
    assert not torch.equal(model2.weight, model.weight)
    result = Checkpoint(model=model2, optimizer=opt2, epoch=epoch2).restore(path)

    assert isinstance(result, Checkpoint)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]  # lr 0.01 restored over 0.5
    assert s1["state"].keys() == s2["state"].keys() and len(s1["state"]) == 2
    for k in s1["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])
    assert held is epoch2 and int(held) == 7  # restored in place
    # The restored optimizer keeps training identically.
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight)


def test_on_disk_format_is_plain_and_weights_only(tmp_path):
    model, opt = _trained()
    path = Checkpoint(model=model, optimizer=opt, step=torch.arange(10)[3]).save(tmp_path / "c")
    data = torch.load(path + ".pt", map_location="cpu", weights_only=True)
    assert data["format"] == "distrib-checkpoint" and data["version"] == 1
    assert set(data["objects"]) == {"model", "optimizer", "step"}
    assert set(data["objects"]["model"]) == {"weight", "bias"}
    assert type(data["objects"]["model"]["weight"]) is torch.Tensor
    assert data["objects"]["optimizer"]["param_groups"][0]["lr"] == 0.01
    step = data["objects"]["step"]
    assert int(step) == 3 and step.untyped_storage().nbytes() == step.element_size()


def test_save_numbering_and_counter_continues_after_restore(tmp_path):
    prefix = str(tmp_path / "ckpt")
    ckpt = Checkpoint(w=torch.zeros(2))
    assert ckpt.save(prefix) == f"{prefix}-1"
    assert ckpt.save(prefix) == f"{prefix}-2"
    fresh = Checkpoint(w=torch.zeros(2))
    fresh.restore(f"{prefix}-2")
    assert fresh.save_counter == 2
    assert fresh.save(prefix) == f"{prefix}-3"


def test_write_uses_exact_path_and_leaves_counter_and_index(tmp_path):
    w = torch.tensor([1.0, 2.0])
    ckpt = Checkpoint(w=w)
    assert ckpt.write(tmp_path / "exact") == str(tmp_path / "exact")
    assert (tmp_path / "exact.pt").is_file()
    assert ckpt.save_counter == 0 and latest_checkpoint(tmp_path) is None
    w.zero_()
    ckpt.restore(tmp_path / "exact")
    assert w.tolist() == [1.0, 2.0]


def test_latest_checkpoint_after_three_saves(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    ckpt = Checkpoint(w=torch.zeros(1))
    paths = [ckpt.save(tmp_path / "ckpt") for _ in range(3)]
    assert latest_checkpoint(tmp_path) == paths[2]
    index = json.loads((tmp_path / "checkpoint").read_text())
    assert index == {"latest": "ckpt-3", "all": ["ckpt-1", "ckpt-2", "ckpt-3"]}
    # If the newest data file disappears, fall back to the newest one that exists.
    os.remove(paths[2] + ".pt")
    assert latest_checkpoint(tmp_path) == paths[1]


def test_manager_max_to_keep(tmp_path):
    step = torch.tensor(0)
    manager = CheckpointManager(Checkpoint(step=step), tmp_path / "run", max_to_keep=2)
    assert manager.restore_or_initialize() is None
    for _ in range(4):
        step.add_(1)
        last = manager.save()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("*.pt")) == ["ckpt-3.pt", "ckpt-4.pt"]
    assert manager.checkpoints == [str(run / "ckpt-3"), str(run / "ckpt-4")]
    assert manager.latest_checkpoint == last == latest_checkpoint(run) == str(run / "ckpt-4")
    assert json.loads((run / "checkpoint").read_text())["all"] == ["ckpt-3", "ckpt-4"]

    # A new process: picks up the kept list, restores, and continues numbering.
    step2 = torch.tensor(0)
    manager2 = CheckpointManager(Checkpoint(step=step2), run, max_to_keep=2)
    assert manager2.restore_or_initialize() == str(run / "ckpt-4") and int(step2) == 4
    assert manager2.save() == str(run / "ckpt-5")
    assert sorted(p.name for p in run.glob("*.pt")) == ["ckpt-4.pt", "ckpt-5.pt"]
    assert manager2.save(checkpoint_number=100) == str(run / "ckpt-100")
    assert manager2.checkpoints == [str(run / "ckpt-5"), str(run / "ckpt-100")]


def test_manager_keeps_all_with_none(tmp_path):
    manager = CheckpointManager(Checkpoint(w=torch.zeros(1)), tmp_path, max_to_keep=None)
    for _ in range(7):
        manager.save()
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 7
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(Checkpoint(), tmp_path, max_to_keep=0)


def test_save_dying_halfway_keeps_previous(tmp_path, monkeypatch):
    w = torch.tensor([1.0, 2.0])
    manager = CheckpointManager(Checkpoint(w=w), tmp_path)
    first = manager.save()
    w.fill_(9.0)

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk died")

    monkeypatch.setattr(dc.torch, "save", dying_save)
    with pytest.raises(OSError, match="disk died"):
        manager.save()
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == first == manager.latest_checkpoint
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["ckpt-1.pt"]
    assert not list(tmp_path.glob(".tmp-*"))  # the half-written temp file was removed
    Checkpoint(w=w).restore(latest_checkpoint(tmp_path))
    assert w.tolist() == [1.0, 2.0]


def test_crash_before_index_replace_keeps_previous(tmp_path, monkeypatch):
    w = torch.tensor([1.0])
    ckpt = Checkpoint(w=w)
    first = ckpt.save(tmp_path / "ckpt")
    # A leftover temp file from an earlier crash is ignored by everything.
    (tmp_path / ".tmp-leftover").write_bytes(b"junk")
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == "checkpoint":
            raise KeyboardInterrupt("killed before the index was replaced")
        real_replace(src, dst)

    monkeypatch.setattr(dc.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert ckpt.save_counter == 1  # the failed save did not consume a number
    manager = CheckpointManager(Checkpoint(w=torch.zeros(1)), tmp_path)
    assert manager.restore_or_initialize() == first


class Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_pickled_payload_is_refused_without_running_it(tmp_path):
    pwned = tmp_path / "pwned"
    bad = tmp_path / "ckpt-1.pt"
    torch.save({"format": "distrib-checkpoint", "version": 1,
                "objects": {"x": Evil(str(pwned))}}, bad)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(x=torch.zeros(1)).restore(tmp_path / "ckpt-1")
    msg = str(info.value)
    assert "pickled Python object" in msg and str(bad) in msg and "system" in msg
    assert "torch.load" in msg
    assert not pwned.exists()


def test_truncated_and_foreign_files(tmp_path):
    ckpt = Checkpoint(w=torch.randn(1000))
    path = ckpt.save(tmp_path / "ckpt")
    data = open(path + ".pt", "rb").read()
    open(path + ".pt", "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is truncated or not a distrib checkpoint") as info:
        ckpt.restore(path)
    assert isinstance(info.value, CheckpointError) and "ckpt-1.pt" in str(info.value)

    for content in (b"", b"garbage bytes", b"PK\x03", data[:10]):
        (tmp_path / "junk.pt").write_bytes(content)
        with pytest.raises(CheckpointError, match="junk.pt. is truncated or not a distrib"):
            ckpt.restore(tmp_path / "junk")
    torch.save({"weight": torch.ones(1)}, tmp_path / "plain.pt")  # valid torch, not ours
    with pytest.raises(CheckpointError, match="not a distrib checkpoint"):
        ckpt.restore(tmp_path / "plain")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="latest_checkpoint") as info:
        Checkpoint(w=torch.zeros(1)).restore(tmp_path / "nope-3")
    assert "nope-3" in str(info.value)


def test_untrackable_objects_and_bad_names():
    with pytest.raises(TypeError) as info:
        Checkpoint(x=3)
    assert "'x'" in str(info.value) and "int" in str(info.value)
    assert "torch.nn.Module" in str(info.value) and "state_dict" in str(info.value)
    with pytest.raises(ValueError, match="identifier"):
        Checkpoint(**{"not valid": torch.zeros(1)})
    with pytest.raises(ValueError, match="identifier"):
        Checkpoint(save=torch.zeros(1))


def test_duck_typed_state_and_attribute_access(tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    c = Counter()
    c.n = 5
    ckpt = Checkpoint(counter=c)
    assert ckpt.counter is c
    path = ckpt.save(tmp_path / "c")
    c2 = Counter()
    Checkpoint(counter=c2).restore(path)
    assert c2.n == 5


def test_mismatched_names(tmp_path):
    path = Checkpoint(model=torch.nn.Linear(2, 2), epoch=torch.tensor(1)).save(tmp_path / "c")
    with pytest.raises(ValueError) as info:
        Checkpoint(net=torch.nn.Linear(2, 2), epoch=torch.tensor(0)).restore(path)
    msg = str(info.value)
    assert "'model'" in msg and "'net'" in msg and "not tracked" in msg
    epoch = torch.tensor(0)
    with pytest.raises(CheckpointError, match="shape"):
        Checkpoint(model=torch.nn.Linear(2, 2), epoch=torch.zeros(3)).restore(path)
    with pytest.raises(CheckpointError, match="model"):
        Checkpoint(model=torch.nn.Linear(3, 2), epoch=epoch).restore(path)


class _Worker(DefaultStrategy):
    """A strategy whose chief role is set by the test: the checkpoint contract is all Checkpoint uses."""

    def __init__(self, chief: bool, barriers: list[int]) -> None:
        super().__init__()
        self.chief, self.barriers = chief, barriers

    @property
    def is_chief(self) -> bool:
        return self.chief

    def barrier(self, timeout=None) -> None:
        self.barriers.append(1)


def test_non_chief_writes_nothing_but_keeps_numbering(tmp_path):
    barriers: list[int] = []
    strategy = _Worker(chief=False, barriers=barriers)
    model = torch.nn.Linear(1, 1)
    context.set_owner(model, strategy)  # what a strategy's scope records for the modules it distributes

    ckpt = Checkpoint(model=model, w=torch.zeros(1))
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-1")
    manager = CheckpointManager(ckpt, tmp_path / "run", max_to_keep=1)
    assert manager.save() == str(tmp_path / "run" / "ckpt-2")
    assert ckpt.write(tmp_path / "w") == str(tmp_path / "w")
    assert list(tmp_path.iterdir()) == []  # not even the manager's directory
    assert ckpt.save_counter == 2 and len(barriers) == 3

    strategy.chief = True
    path = manager.save()
    assert path == str(tmp_path / "run" / "ckpt-3") and os.path.isfile(path + ".pt")
    assert len(barriers) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_checkpoint_is_cpu_on_disk_and_restores_on_device(tmp_path):
    model = torch.nn.Linear(3, 2).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3, device="cuda")).sum().backward()
    opt.step()
    path = Checkpoint(model=model, opt=opt).save(tmp_path / "c")
    data = torch.load(path + ".pt", map_location="cpu", weights_only=True)
    assert data["objects"]["model"]["weight"].device.type == "cpu"
    cpu_model = torch.nn.Linear(3, 2)
    Checkpoint(model=cpu_model, opt=torch.optim.Adam(cpu_model.parameters())).restore(path)
    assert torch.equal(cpu_model.weight, model.weight.cpu())
    gpu_model = torch.nn.Linear(3, 2).cuda()
    gpu_opt = torch.optim.Adam(gpu_model.parameters())
    Checkpoint(model=gpu_model, opt=gpu_opt).restore(path)
    assert gpu_model.weight.device.type == "cuda" and torch.equal(gpu_model.weight, model.weight)
    assert gpu_opt.state_dict()["state"][0]["exp_avg"].device.type == "cuda"
