"""Checkpoint fault scenarios (issue 10, C.3-C.6 and D): kills during saves, bit flips, truncation, a full disk.

Each scenario runs real processes (this file run as a script is the child), bounded in time,
prints its figure (``FAULT ...``) and asserts it. The many-trial variants are marked
``faults_full`` (``bash scripts/faults.sh``); a fast variant of each runs by default.

    python tests/faults/test_checkpoint.py flips DIR SEED COUNT     # child: one JSON line of counts
    python tests/faults/test_checkpoint.py truncate DIR STEP|fast   # child: one JSON line of counts
    python tests/faults/test_checkpoint.py saver DIR                # child: saves until killed
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distrib.checkpoint import Checkpoint, CheckpointError, CheckpointManager, latest_checkpoint


# --------------------------------------------------------------- the state every scenario saves
def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01), torch.tensor(0)


def _trained_checkpoint(directory: str) -> tuple[str, list[Any]]:
    """Save a trained model, its Adam state and an epoch; return the path and the reference state."""
    model, opt, epoch = _build(0)
    for _ in range(2):
        model(torch.randn(5, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    epoch.fill_(3)
    path = Checkpoint(model=model, optimizer=opt, epoch=epoch).save(os.path.join(directory, "ckpt"))
    return path, [model.state_dict(), opt.state_dict(), epoch.clone()]


def _same(a: Any, b: Any) -> bool:
    """Bit-identical: same types, keys, dtypes, shapes and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _restore_and_classify(path: str, reference: list[Any]) -> str:
    """``refused`` (CheckpointError naming the file or a tensor), ``identical``, ``different``, or another error."""
    model, opt, epoch = _build(1)
    try:
        Checkpoint(model=model, optimizer=opt, epoch=epoch).restore(path)
    except CheckpointError as e:
        return "refused" if (path in str(e) or "tensor" in str(e)) else "refused without naming the file"
    except Exception as e:  # anything else is a finding
        return f"{type(e).__name__}: {str(e)[:80]}"
    got = [model.state_dict(), opt.state_dict(), epoch]
    return "identical" if all(_same(a, b) for a, b in zip(reference, got)) else "different"


# --------------------------------------------------------------- children
def _child_flips(directory: str, seed: int, count: int) -> dict[str, int]:
    path, reference = _trained_checkpoint(directory)
    good = open(path + ".pt", "rb").read()
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    for _ in range(count):
        raw = bytearray(good)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        with open(path + ".pt", "wb") as f:
            f.write(raw)
        kind = _restore_and_classify(path, reference)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _child_truncate(directory: str, step: str) -> dict[str, int]:
    path, reference = _trained_checkpoint(directory)
    good = open(path + ".pt", "rb").read()
    n = len(good)
    lengths = [0, n // 4, n // 2, 3 * n // 4, n - 1] if step == "fast" else range(0, n, int(step))
    counts: dict[str, int] = {"lengths": 0}
    for length in lengths:
        with open(path + ".pt", "wb") as f:
            f.write(good[:length])
        kind = _restore_and_classify(path, reference)
        counts[kind] = counts.get(kind, 0) + 1
        counts["lengths"] += 1
    return counts


def _child_saver(directory: str) -> None:
    """Save 4 MB states w = i (i = 1, 2, ...) through a CheckpointManager until killed."""
    w = torch.zeros(1 << 20)
    manager = CheckpointManager(Checkpoint(w=w), directory, max_to_keep=2)
    for i in range(1, 10_000):
        w.fill_(float(i))
        manager.save()
        print(f"saved {i}", flush=True)


# --------------------------------------------------------------- running children, bounded
def _run(*args: str, timeout: float = 300) -> dict[str, int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"child {args} did not finish in {timeout}s:\n{err[-2000:]}")
    assert proc.returncode == 0, (
        f"child {args} died with {proc.returncode} (a crash counts as a finding):\n{err[-3000:]}"
    )
    return json.loads(out.strip().splitlines()[-1])


def _merge(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


# --------------------------------------------------------------- bit flips
def _bit_flips(tmp_path: Path, trials: int) -> None:
    counts: dict[str, int] = {}
    for chunk, start in enumerate(range(0, trials, 50)):
        directory = tmp_path / f"flips{chunk}"
        _merge(counts, _run("flips", str(directory), str(1000 + chunk), str(min(50, trials - start))))
    refused, identical, different = counts.get("refused", 0), counts.get("identical", 0), counts.get("different", 0)
    others = {k: v for k, v in counts.items() if k not in ("refused", "identical", "different")}
    print(
        f"FAULT bit flips: {trials} trials, {refused} refused with CheckpointError, {identical} restored "
        f"bit-identical, {different} loaded silently with different values, other outcomes {others}"
    )
    assert different == 0 and not others and refused + identical == trials and refused > 0


def test_bit_flips_fast(tmp_path):
    _bit_flips(tmp_path, 10)


@pytest.mark.faults_full
def test_bit_flips_x100(tmp_path):
    _bit_flips(tmp_path, 100)


# --------------------------------------------------------------- truncation
def _truncation(tmp_path: Path, step: str) -> None:
    counts = _run("truncate", str(tmp_path / "trunc"), step)
    n, refused = counts.pop("lengths"), counts.pop("refused", 0)
    bare = {k: v for k, v in counts.items()}
    print(
        f"FAULT truncation: {n} lengths ({'5 spread' if step == 'fast' else 'every ' + step + 'th byte'}), "
        f"{refused} refused with a CheckpointError naming the file, other outcomes {bare}"
    )
    assert refused == n and not bare


def test_truncation_fast(tmp_path):
    _truncation(tmp_path, "fast")


@pytest.mark.faults_full
def test_truncation_at_every_10th_length(tmp_path):
    _truncation(tmp_path, "10")


# --------------------------------------------------------------- kill during save
def _kill_during_save(tmp_path: Path, trials: int) -> None:
    rng = random.Random(42)
    loaded = mid_write = cleaned = 0
    for trial in range(trials):
        directory = tmp_path / f"kill{trial}"
        proc = subprocess.Popen(
            [sys.executable, __file__, "saver", str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # one checkpoint is on disk: now kill in the middle of later saves
            assert first.startswith("saved 1"), proc.stderr.read() if proc.stderr else first
            time.sleep(rng.uniform(0.0, 0.4))
            os.killpg(proc.pid, signal.SIGKILL)
            rest = proc.communicate(timeout=30)[0]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        announced = max([int(line.split()[1]) for line in (first + rest).splitlines() if line.startswith("saved")])
        mid_write += any(p.name.startswith(".tmp-") for p in directory.iterdir())
        w = torch.zeros(1 << 20)
        path = latest_checkpoint(directory)
        assert path is not None
        manager = CheckpointManager(Checkpoint(w=w), directory, max_to_keep=2)
        assert manager.restore_or_initialize() == path
        value = w[0].item()
        # one of the saved states, whole: the last announced one, or the next if the kill hit after its commit
        if torch.all(w == value) and value in (announced, announced + 1):
            loaded += 1
        manager.save()
        cleaned += not any(p.name.startswith(".tmp-") for p in directory.iterdir())
    print(
        f"FAULT kill during save: {trials} trials ({mid_write} killed mid-write), {loaded} restored one of the "
        f"saved states whole, {cleaned} had every temp file removed by the next save"
    )
    assert loaded == trials and cleaned == trials


def test_kill_during_save_fast(tmp_path):
    _kill_during_save(tmp_path, 4)


@pytest.mark.faults_full
def test_kill_during_save_x20(tmp_path):
    _kill_during_save(tmp_path, 20)


# --------------------------------------------------------------- a full disk
@contextlib.contextmanager
def _small_disk(path: Path, size: int) -> Iterator[bool]:
    """A real tmpfs of ``size`` bytes at ``path`` when this process may mount one (root), else a plain directory."""
    path.mkdir()
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
            ).returncode
            == 0
        )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def _simulated_enospc(free: int) -> Iterator[None]:
    """Writes through os.fdopen fail with ENOSPC once ``free`` bytes are written (no tmpfs available)."""
    real_fdopen = os.fdopen
    written = [0]

    class Full:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.close()

        def write(self, data: Any) -> int:
            n = memoryview(data).nbytes
            if written[0] + n > free:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written[0] += n
            return int(self.f.write(data))

    os.fdopen = lambda fd, mode="r", *a, **k: Full(real_fdopen(fd, mode, *a, **k))  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fdopen = real_fdopen


def _disk_full(tmp_path: Path, fractions: list[float]) -> None:
    """Each trial: the disk has room for ``fraction`` of the next data file (1.0: all of it, but not the index
    written after it); the save must fail with a CheckpointError and leave the previous checkpoint as it was."""
    ok = 0
    with _small_disk(tmp_path / "disk", 8 << 20) as real:
        directory = tmp_path / "disk"
        w = torch.zeros(128 << 10)  # 512 KiB checkpoints
        manager = CheckpointManager(Checkpoint(w=w), directory, max_to_keep=1)
        manager.save()
        saved_value, need = 0.0, os.path.getsize(str(manager.latest_checkpoint) + ".pt")
        for trial, fraction in enumerate(fractions):
            previous, counter = manager.latest_checkpoint, manager.checkpoint.save_counter
            w.fill_(float(trial + 1))
            filler = directory / "filler"
            error = None
            with contextlib.ExitStack() as stack:
                # room for `fraction` of the data file; 1.0: the whole data file, but not the index after it
                if real:  # fill the disk up to that, in whole pages
                    free = -(-need // 4096) * 4096 if fraction >= 1 else int(need * fraction) // 4096 * 4096
                    stat = os.statvfs(directory)
                    with open(filler, "wb") as f:
                        f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - free))
                else:
                    stack.enter_context(_simulated_enospc(need if fraction >= 1 else int(need * fraction)))
                try:
                    manager.save()
                except CheckpointError as e:
                    error = e
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()
            if error is None:  # the disk was not full after all: a failed trial, not a crash of the scenario
                saved_value = float(trial + 1)
                continue
            named = (
                error is not None and "No space left on device (ENOSPC)" in str(error) and str(directory) in str(error)
            )
            intact = (
                latest_checkpoint(directory) == previous == manager.latest_checkpoint
                and manager.checkpoint.save_counter == counter
                and not list(directory.glob(".tmp-*"))
            )
            check = torch.empty_like(w)
            Checkpoint(w=check).restore(previous).assert_consumed()
            intact = intact and bool(torch.all(check == saved_value))
            again = manager.save()  # space again: the next save works
            saved_value = float(trial + 1)
            ok += bool(named and intact and again == manager.latest_checkpoint)
    how = "a real tmpfs" if real else "simulated ENOSPC: no tmpfs could be mounted"
    print(
        f"FAULT disk full ({how}): {len(fractions)} trials, {ok} gave a CheckpointError naming the file and "
        "ENOSPC with the previous checkpoint intact and loadable, and a working save once space was back"
    )
    assert ok == len(fractions)


def test_disk_full_fast(tmp_path):
    _disk_full(tmp_path, [0.5, 1.0])


@pytest.mark.faults_full
def test_disk_full_at_every_tenth_of_the_file(tmp_path):
    _disk_full(tmp_path, [i / 10 for i in range(11)])


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # version notes etc.: the parent reads one JSON line
    mode, directory = sys.argv[1], sys.argv[2]
    os.makedirs(directory, exist_ok=True)
    if mode == "flips":
        print(json.dumps(_child_flips(directory, int(sys.argv[3]), int(sys.argv[4]))))
    elif mode == "truncate":
        print(json.dumps(_child_truncate(directory, sys.argv[3])))
    elif mode == "saver":
        _child_saver(directory)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
