"""An exact resume survives whatever the input sharding: ``ds.fit`` on a shuffled ``DataLoader`` over a map-style
dataset, stopped after 3 of its 10 steps on 2 workers and resumed on 3, ends with the parameters of the
uninterrupted run on 1 worker (tests/scripts/input_fit_resume.py). The batch-level check (the resumed workers see
exactly the uninterrupted global batches, and load none of the skipped ones) is
tests/input/test_sharding.py::test_a_resumed_run_sees_the_uninterrupted_batches_and_loads_none_it_skips; the
script records what each worker loaded (loads-w<index>) for the day fit's executor feeds through
``DistributedDataset.numbered_batches``: the resumed job then loads its 7 remaining global batches once over all
workers (56 examples) instead of all 10 on every worker (240).
"""

from __future__ import annotations

import torch
from helpers import SCRIPTS, launch

SCRIPT = str(SCRIPTS / "input_fit_resume.py")


def test_fit_stopped_on_two_workers_and_resumed_on_three_ends_as_the_uninterrupted_run(tmp_path):
    whole, stopped, resumed = (tmp_path / name for name in ("whole", "stopped", "resumed"))
    for d in (whole, stopped, resumed):
        d.mkdir()
    code, log, _ = launch("--workers", "1", SCRIPT, str(whole), str(tmp_path / "backup-whole"), "0", timeout=120)
    assert code == 0, log
    code, log, _ = launch("--workers", "2", SCRIPT, str(stopped), str(tmp_path / "backup"), "3", timeout=120)
    assert code != 0 and "DONE" not in log, log  # stopped after step 3, its backup written
    code, log, _ = launch("--workers", "3", SCRIPT, str(resumed), str(tmp_path / "backup"), "0", timeout=120)
    assert code == 0 and log.count("DONE") == 3, log
    for a, b in zip(torch.load(whole / "params.pt"), torch.load(resumed / "params.pt")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
