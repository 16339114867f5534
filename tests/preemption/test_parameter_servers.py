"""Preemption under ParameterServerStrategy (issue 23, item 6): a notice to the coordinator while steps are in
flight; the handler waits for them (ClusterCoordinator.join) before it saves the count of scheduled steps, exits 42,
and `distrib launch` restarts the whole cluster (ps tasks included, which get the saved variables back). Every
completed step is applied and counted exactly once: the weights, -steps/64 exactly, say so."""

from __future__ import annotations

import re

from helpers import SCRIPTS, launch


def test_the_coordinator_saves_after_the_steps_in_flight_and_the_restart_counts_each_once(tmp_path):
    code, out, _ = launch(
        "--workers",
        "2",
        "--ps",
        "1",
        str(SCRIPTS / "preempt_ps.py"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--steps",
        "40",
        "--notice-at",
        "15",
        timeout=240,
    )
    assert code == 0, out
    saved = re.findall(r"worker 0: preemption checkpoint at run (\d+) saved", out)
    assert saved == ["15"], out  # one process decides: it saves at the run where it saw the notice
    assert "START run=0" in out and "START run=15" in out and "not counted against --max-restarts" in out, out
    assert "FINAL steps_applied=40 runs=40 equal=True" in out, out  # 15 before, 25 after: none lost or doubled
