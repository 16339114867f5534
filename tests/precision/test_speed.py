"""Precision advice that holds on every machine: slow autocast is measured, and the note names a choice that is not slow.

The measurement's outcome is given through ``Precision.slow_here``'s ``slowdown`` parameter (or, for ``ds.fit`` and
``distrib train``, by replacing ``amp_speed.measured_slowdown``), so every kind of CPU is covered on this one: an
AVX2-only CPU (both dtypes slow), an AVX512-BF16 or AMX CPU (bfloat16 fast, float16 slow), a CPU fast in both. The
real measurement runs once, to check it is cheap, cached and leaves torch's state alone.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings

import pytest
import torch

import distrib as ds
from distrib.precision import Precision
from distrib.precision import speed as amp_speed
from distrib.precision.speed import SLOW_RATIO, Slowdown

SLOW, FAST = Slowdown(12.0, 0.05), Slowdown(0.8, 0.01)
MIXED = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


def probe(bf16: Slowdown | None, fp16: Slowdown | None, calls: list | None = None):
    def slowdown(dtype: torch.dtype, device_type: str) -> Slowdown | None:
        if calls is not None:
            calls.append((dtype, device_type))
        return {torch.bfloat16: bf16, torch.float16: fp16}[dtype]

    return slowdown


def refuse(dtype: torch.dtype, device_type: str) -> Slowdown | None:
    raise AssertionError("nothing may be measured here")


def faster_choice(note: str) -> str:
    match = re.search(r"'([\w-]+)'( \(float32\))? is the faster choice here", note)
    assert match, note
    return match.group(1)


@pytest.mark.parametrize(
    "bf16,fp16",
    [(SLOW, SLOW), (SLOW, FAST), (FAST, SLOW), (FAST, FAST), (SLOW, None)],
    ids=["avx2-only", "fp16-only", "avx512bf16-or-amx", "both-fast", "fp16-unmeasurable"],
)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_slow_precision_is_named_with_a_faster_choice_that_is_not_slow_here(precision, bf16, fp16):
    mixed = Precision.parse(precision)
    outcome = {torch.bfloat16: bf16, torch.float16: fp16}
    note = mixed.slow_here("cpu", probe(bf16, fp16))
    mine = outcome[mixed.dtype]
    if mine is None or not mine.slow:
        assert note is None
        return
    assert note is not None and f"{'bfloat16' if mixed.dtype is torch.bfloat16 else 'float16'} autocast is slow" in note
    assert f"{mine.ratio:.1f}x its float32 time" in note
    other_dtype = torch.float16 if mixed.dtype is torch.bfloat16 else torch.bfloat16
    other = outcome[other_dtype]
    choice = faster_choice(note)
    if other is not None and not other.slow:
        assert choice == MIXED[other_dtype]
    else:
        assert choice == "32"  # never a precision measured slow here, nor one that could not be measured
    assert choice != precision


def test_float32_and_other_devices_are_never_measured(monkeypatch):
    assert Precision.parse("32").slow_here("cpu", refuse) is None
    assert Precision.parse("16-mixed").slow_here("cuda", refuse) is None  # float16 is fast on every GPU
    assert Precision.parse("bf16-mixed").slow_here("mps", refuse) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)  # a pre-Ampere GPU
    note = Precision.parse("bf16-mixed").slow_here("cuda", refuse)
    assert note is not None and faster_choice(note) == "16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert Precision.parse("bf16-mixed").slow_here("cuda", refuse) is None


def test_the_other_dtype_is_measured_only_when_the_one_asked_for_is_slow():
    calls: list = []
    assert Precision.parse("bf16-mixed").slow_here("cpu", probe(FAST, SLOW, calls)) is None
    assert calls == [(torch.bfloat16, "cpu")]


def test_fit_warns_naming_the_faster_choice(monkeypatch):
    monkeypatch.setattr(amp_speed, "measured_slowdown", probe(SLOW, SLOW))  # an AVX2-only CPU
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds.fit(model, data, optimizer=optimizer, loss="cross_entropy", epochs=1, verbose=0, precision="bf16-mixed")
    slow = [str(w.message) for w in caught if "is the faster choice here" in str(w.message)]
    assert len(slow) == 1 and slow[0].startswith("fit(precision='bf16-mixed'): bfloat16 autocast is slow"), slow
    assert faster_choice(slow[0]) == "32" and "float16 is slow here too" in slow[0]


def test_distrib_train_prints_a_note_naming_the_faster_choice(monkeypatch, idx_dir, tmp_path, capsys):
    from distrib.app.cli import main

    # a CPU where bfloat16 is slow and float16 is not (the run itself is bfloat16, fast on the CPUs this runs on)
    monkeypatch.setattr(amp_speed, "measured_slowdown", probe(SLOW, FAST))
    code = main(
        [
            "train",
            "--strategy",
            "default",
            "--epochs",
            "1",
            "--precision",
            "bf16-mixed",
            "--batch-size-per-replica",
            "64",
            "--data-dir",
            str(idx_dir),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    notes = [line for line in out.splitlines() if line.startswith("Note: ")]
    assert len(notes) == 1 and "bfloat16 autocast is slow on this CPU" in notes[0], out
    assert faster_choice(notes[0]) == "16-mixed"


def test_the_real_measurement_is_cheap_cached_and_leaves_torch_as_it_was():
    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    measured = amp_speed.measured_slowdown.__wrapped__(torch.bfloat16, "cpu")  # uncached: really measured
    assert isinstance(measured, Slowdown) and math.isfinite(measured.ratio) and measured.ratio > 0
    assert measured.slow == (measured.ratio >= SLOW_RATIO)
    assert measured.cpu_seconds > 0  # its cost (0.02-0.09 s of CPU here) is a figure for docs/performance.md
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), rng)
    first = amp_speed.measured_slowdown(torch.bfloat16, "cpu")
    assert amp_speed.measured_slowdown(torch.bfloat16, "cpu") is first  # once per process
    assert amp_speed.measured_slowdown(torch.bfloat16, "cuda") is None  # GPUs are not measured on the CPU


def test_importing_distrib_measures_nothing():
    code = (
        "import distrib, distrib.app.train, distrib.keras\n"
        "from distrib.precision import speed as amp_speed\n"
        "info = amp_speed.measured_slowdown.cache_info()\n"
        "assert info.hits == info.misses == 0, info\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
