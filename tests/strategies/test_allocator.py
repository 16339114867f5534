"""glibc's allocator settings for sharded CPU workers (strategies/allocator.py): who gets them, who is warned."""

from __future__ import annotations

import logging

import pytest

from distrib.strategies import allocator, registry


def train_workers_env(name, device):
    """What distrib train --workers N adds to its workers' environment (app/cli.py reads the registry entry)."""
    entry = registry.get(name)
    return entry.worker_env(device) if entry.worker_env else {}


@pytest.mark.parametrize(
    "chosen",
    [
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"LD_PRELOAD": "libjemalloc.so.2"},
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
        {"DISTRIB_MALLOC": "default"},
    ],
)
def test_a_chosen_allocator_is_left_alone(chosen):
    assert allocator.recommended_env(chosen, libc="glibc") == {}


def test_the_recipe_is_for_glibc_only_and_keeps_other_tunables():
    assert allocator.recommended_env({}, libc="glibc") == allocator.RECIPE
    assert allocator.recommended_env({}, libc="") == {}  # musl and others: their allocator, their settings
    got = allocator.recommended_env({"GLIBC_TUNABLES": "glibc.rtld.nns=8"}, libc="glibc")
    assert got["GLIBC_TUNABLES"] == "glibc.rtld.nns=8:glibc.malloc.hugetlb=1"


def test_distrib_train_gives_it_to_sharded_cpu_workers_only(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD", "GLIBC_TUNABLES", "DISTRIB_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert train_workers_env("sharded", None) == allocator.RECIPE
    assert train_workers_env("sharded", "cuda:0") == {}
    assert train_workers_env("multi-worker", None) == {}
    monkeypatch.setenv("DISTRIB_MALLOC", "default")
    assert train_workers_env("sharded", None) == {}


def test_an_untuned_sharded_cpu_job_is_warned_once_on_the_chief(monkeypatch, caplog):
    for name in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD", "GLIBC_TUNABLES", "DISTRIB_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(allocator, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="distrib.strategies"):
        allocator.warn_if_untuned("cpu", 2, chief=False)
        allocator.warn_if_untuned("cuda", 2, chief=True)
        allocator.warn_if_untuned("cpu", 1, chief=True)
        assert not caplog.records
        allocator.warn_if_untuned("cpu", 2, chief=True)
        allocator.warn_if_untuned("cpu", 4, chief=True)
    assert len(caplog.records) == 1 and "MALLOC_MMAP_THRESHOLD_=131072" in caplog.text and "1.3x" in caplog.text


def test_the_advice_names_the_strategy_built_and_where_its_settings_go(monkeypatch, caplog):
    for name in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD", "GLIBC_TUNABLES", "DISTRIB_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    for strategy, where in (("MeshStrategy", "distrib launch"), ("ShardedStrategy", "distrib train")):
        monkeypatch.setattr(allocator, "_warned", False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="distrib.strategies"):
            allocator.warn_if_untuned("cpu", 2, chief=True, strategy=strategy)
        (message,) = [r.getMessage() for r in caplog.records]
        assert message.startswith(f"{strategy} on the CPU") and where in message, message
