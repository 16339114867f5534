"""One random stream per tensor-parallel group under ``ds.experimental.MeshStrategy``.

tests/scripts/mesh_dropout.py runs a small MLP whose dropout follows a RowwiseParallel layer (its output whole
on every worker of a tensor-parallel group) on a 1 x 2 and a 2 x 2 (batch x model) mesh of gloo workers, the
users' seeds per rank or none at all: every step's mask must be the same on the workers of a group and differ
across the data-parallel replicas; a sharded DataLoader with a random augmentation must load the same values
on the workers of a group (in the main process and in a loader process), and a shuffled one must still give
every worker the same global batches. On 2 x 2 the MLP trains 40 Adam steps with dropout: the peers of a group
must end with the same parameters (the ones no layout splits drift apart when their masks differ), and the
evaluation loss must lie within one process's own spread over 8 dropout seeds.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
from pathlib import Path

import torch
from helpers import SCRIPTS, run_bounded

from distrib.strategies.group_random import GroupRandomStream, stream_seed


def _run(tmp_path: Path, workers: int, *extra: str) -> tuple[dict, str]:
    """The script's results and output; the workers start with glibc's allocator as it comes (the advice shows)."""
    out = tmp_path / "dropout.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD", "DISTRIB_MALLOC")}
    env.pop("GLIBC_TUNABLES", None)
    cmd = [sys.executable, "-m", "distrib.app.cli", "launch", "--workers", str(workers)]
    code, log, _ = run_bounded([*cmd, str(SCRIPTS / "mesh_dropout.py"), "--out", str(out), *extra], 240, env=env)
    assert code == 0, log
    print("\n".join(line for line in log.splitlines() if "masks_" in line))
    return json.loads(out.read_text())["results"], log


def _check_allocator_advice(log: str) -> None:
    """The chief's allocator advice names the strategy the user built."""
    if platform.libc_ver()[0] == "glibc":
        assert "[worker 0] MeshStrategy on the CPU with glibc's allocator" in log, log
        assert "ShardedStrategy" not in log, log


def _groups(workers: list[dict]) -> dict[int, list[dict]]:
    by_dp: dict[int, list[dict]] = {}
    for w in workers:
        by_dp.setdefault(w["dp"], []).append(w)
    return by_dp


def _check_masks_and_loaders(results: dict) -> None:
    for seeding in ("none", "rank"):
        groups = _groups(results[f"masks_{seeding}"]["workers"])
        for dp, group in groups.items():
            first = group[0]
            assert len(first["masks"]) == 3 and first["masks"][0] != first["masks"][1], "one mask for every step"
            for peer in group[1:]:
                assert peer["masks"] == first["masks"], (
                    f"seeding {seeding}: tensor-parallel peers of replica {dp} drew different dropout masks "
                    f"(sums {first['sums']} against {peer['sums']})"
                )
        if len(groups) > 1:
            assert groups[0][0]["masks"] != groups[1][0]["masks"], f"seeding {seeding}: the replicas drew alike"
    for name in ("loader_main", "loader_process", "loader_shuffled"):
        for dp, group in _groups(results[name]["workers"]).items():
            for peer in group[1:]:
                assert peer["shares"] == group[0]["shares"], f"{name}: the peers of replica {dp} loaded differently"


def test_dropout_masks_agree_inside_each_tensor_parallel_group_on_1x2(tmp_path: Path) -> None:
    results, log = _run(tmp_path, 2)
    _check_masks_and_loaders(results)
    _check_allocator_advice(log)


def test_dropout_on_2x2_agrees_per_group_differs_across_replicas_and_trains_as_one_process(tmp_path: Path) -> None:
    results, log = _run(tmp_path, 4, "--train")
    _check_masks_and_loaders(results)
    train = results["train"]
    for dp, group in _groups(train["workers"]).items():
        for name, value in group[0]["state"].items():
            for peer in group[1:]:
                assert torch.tensor(peer["state"][name]).equal(torch.tensor(value)), (
                    f"{name}: the tensor-parallel peers of replica {dp} hold different values after training"
                )
    evaluated = train["workers"][0]["eval"]
    refs = [r["eval"] for r in train["refs"]]
    mean, spread = statistics.mean(refs), statistics.stdev(refs)
    print(
        f"evaluation loss: 2 x 2 mesh {evaluated:.4f}; one process over {len(refs)} dropout seeds {mean:.4f} "
        f"+- {spread:.4f} [{min(refs):.4f}, {max(refs):.4f}]; last training losses {train['losses'][-3:]}"
    )
    assert abs(evaluated - mean) <= 3 * spread, (evaluated, refs)
    assert evaluated < 0.8 * train["losses"][0]  # it trained
    _check_allocator_advice(log)


# ----------------------------------------------------------------------------- the stream itself, one process
def _stream(data_index: int = 0, seed: int = 5) -> GroupRandomStream:
    return GroupRandomStream("model", data_index, torch.device("cpu"), lambda: seed)


def test_a_stream_leaves_the_process_generators_as_they_were_and_goes_on_where_it_stopped() -> None:
    torch.manual_seed(3)
    random.seed(3)
    expected = (torch.rand(4), random.random())
    torch.manual_seed(3)
    random.seed(3)
    stream = _stream()
    with stream.active():
        first = (torch.rand(4), random.random())
    with stream.active():
        second = torch.rand(4)
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]  # the process's, untouched
    again = _stream()
    with again.active():
        assert torch.equal(torch.rand(4), first[0]) and random.random() == first[1]  # the same seed, the same draws
        assert torch.equal(torch.rand(4), second)  # one stream across entries
    assert stream.seed == 5 and not stream.live


def test_streams_differ_per_replica_and_purpose_and_suspend_inside() -> None:
    draws = []
    for stream in (_stream(0), _stream(1), GroupRandomStream("input", 0, torch.device("cpu"), lambda: 5)):
        with stream.active():
            draws.append(torch.rand(8))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert stream_seed(5, "model", 0) != stream_seed(5, "model", 1) != stream_seed(6, "model", 1)
    torch.manual_seed(11)
    outside = torch.rand(3)
    torch.manual_seed(11)
    stream = _stream()
    with stream.active():
        with stream.suspended():  # the process's generators, live again (a sampler's shuffle)
            assert torch.equal(torch.rand(3), outside)
        with stream.active():  # already live: nothing changes
            assert stream.live
