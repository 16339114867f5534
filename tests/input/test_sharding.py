"""Auto-sharding on 2 and 3 real worker processes (gloo over loopback): the union of the workers' examples at each
step is one process's global batch, in the same order; each replica's part is the one splitting that batch gives;
each worker's ``__getitem__`` ran only for its own indices; an exact resume skips without loading.

The workers run tests/scripts/input_shard_workers.py under ``distrib launch``; the reference is the same
``DataLoader`` iterated here, in one process, with the same seed.
"""

from __future__ import annotations

import collections
import gc
import importlib.util
import itertools
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SCRIPTS, launch

from distrib.input import split_batch

SCRIPT = SCRIPTS / "input_shard_workers.py"
_spec = importlib.util.spec_from_file_location("input_shard_workers", SCRIPT)
assert _spec is not None and _spec.loader is not None
workers_script: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers_script)


def one_process_epochs(name: str) -> list[list[list[int]]]:
    """The global batches' labels, epoch by epoch, of the case's loader iterated by one plain process."""
    make, _, epochs = workers_script.CASES[name]
    loader = make(workers_script.Counted())
    return [[batch[1].tolist() for batch in loader] for _ in range(epochs)]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-workers", "3-workers"])
def run(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp(f"shard{request.param}")
    code, log, _ = launch("--workers", str(request.param), str(SCRIPT), str(out), timeout=180)
    assert code == 0 and log.count("DONE") == request.param, log
    results = [json.loads((out / f"w{w}.json").read_text()) for w in range(request.param)]
    return request.param, results, out


def calls(out: Path, case: str, worker: int) -> collections.Counter[int]:
    path = out / f"{case}-w{worker}.calls"
    return (
        collections.Counter(int(line) for line in path.read_text().split()) if path.exists() else collections.Counter()
    )


@pytest.mark.parametrize("case", list(workers_script.CASES))
def test_workers_load_only_their_share_and_together_make_one_process_s_batches(run, case):
    workers, results, out = run
    _, replicas, _ = workers_script.CASES[case]
    expected = one_process_epochs(case)
    total = workers * replicas
    for w in range(workers):
        assert results[w][case]["sharded"]
        own: collections.Counter[int] = collections.Counter()
        for epoch, batches in enumerate(expected):
            got = results[w][case]["epochs"][epoch]
            assert len(got) == len(batches)
            for step, (global_batch, parts) in enumerate(zip(batches, got)):
                # this worker's replicas hold exactly what splitting the whole batch gives them (empty included)
                want = [
                    p.tolist()
                    for p in split_batch(torch.tensor(global_batch), total)[w * replicas : (w + 1) * replicas]
                ]
                assert parts == want, (case, w, epoch, step)
                own.update(i for p in parts for i in p)
        # __getitem__ ran once for each example of this worker's parts, and for nothing else
        assert calls(out, case, w) == own, (case, w)
    for epoch, batches in enumerate(expected):  # the union over workers, in worker order, is the global batch
        for step, global_batch in enumerate(batches):
            union = [i for w in range(workers) for part in results[w][case]["epochs"][epoch][step] for i in part]
            assert union == global_batch


def test_policy_data_reads_everything_on_every_worker(run):
    workers, results, out = run
    expected = [list(range(i, min(i + 5, workers_script.SIZE))) for i in range(0, workers_script.SIZE, 5)]
    for w in range(workers):
        assert not results[w]["data_policy"]["sharded"]
        parts = results[w]["data_policy"]["epochs"][0]
        assert [p[0] for p in parts] == [split_batch(torch.tensor(b), workers)[w].tolist() for b in expected]
        assert calls(out, "data_policy", w) == collections.Counter(range(workers_script.SIZE))


def test_a_resumed_run_sees_the_uninterrupted_batches_and_loads_none_it_skips(run):
    """Steps [0, 4) from the start and [4, 13) resumed from position 4 (cycling over reshuffled epochs), on 2 and on
    3 workers, are each the uninterrupted one-process batches: so a job stopped after 4 steps on either number of
    workers and resumed on either other one continues exactly where it stopped."""
    workers, results, out = run
    loader = torch.utils.data.DataLoader(
        workers_script.Counted(), batch_size=6, shuffle=True, generator=workers_script.seeded(3)
    )
    # one process, uninterrupted, cycling over epochs (each epoch reshuffles): 13 global batches
    uninterrupted = [
        b[1].tolist() for b in itertools.islice(itertools.chain.from_iterable(iter(loader) for _ in range(4)), 13)
    ]
    for start, first in ((0, 0), (4, 4)):
        steps = [
            [i for w in range(workers) for i in results[w][f"resume{start}"][k][0]]
            for k in range(len(results[0][f"resume{start}"]))
        ]
        assert steps == uninterrupted[first : first + len(steps)]
        for w in range(workers):  # fit's global batch size is the whole batch's, on every worker
            assert [n for _, n in results[w][f"resume{start}"]] == [len(b) for b in steps]
            # the 4 skipped batches were drawn, never loaded: this worker read exactly its resumed parts
            assert calls(out, f"resume{start}", w) == collections.Counter(
                i for part, _ in results[w][f"resume{start}"] for i in part
            )


def test_workers_that_draw_different_batches_fail_on_every_worker(run):
    workers, results, _ = run
    for w in range(workers):
        assert "global batch 0 differs between workers" in results[w]["mismatch"]
        assert "seed the shuffle" in results[w]["mismatch"]


def halves(loader_for_worker: Any, epochs: int) -> list[list[list[int]]]:
    """Two workers' shares (1 replica each), simulated in one process with one loader per worker."""
    from distrib.input.sharding import sharded_loader

    out = []
    for _ in range(epochs):  # distributed anew every epoch, as fit does
        shards = [sharded_loader(loader_for_worker(w), 2, w, 1) for w in range(2)]
        steps = zip(*(shard.steps() for shard in shards))
        out.append([[i for _, share in pair if share is not None for i in share[1].tolist()] for pair in steps])
    return out


def test_the_shares_of_a_persistent_loader_distributed_again_continue_its_random_draws():
    """fit distributes the same loader every epoch: the sharded copy is made once per loader, so a loader with
    persistent workers draws its workers' base seed once, as when iterated plainly, and keeps its processes."""
    from distrib.input.sharding import sharded_loader

    def make(_: int = 0) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            workers_script.Counted(10),
            batch_size=4,
            shuffle=True,
            num_workers=1,
            persistent_workers=True,
            generator=workers_script.seeded(11),
        )

    plain = make()
    expected = [[b[1].tolist() for b in plain] for _ in range(3)]
    loaders = [make(), make()]
    assert halves(loaders.__getitem__, 3) == expected
    assert sharded_loader(loaders[0], 2, 0, 1) is sharded_loader(loaders[0], 2, 0, 1)
    assert sharded_loader(loaders[0], 2, 1, 1) is not sharded_loader(loaders[0], 2, 0, 1)
    del plain, loaders
    deadline = time.monotonic() + 15  # the cache holds its loaders weakly: their persistent processes end with them
    while multiprocessing.active_children() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
