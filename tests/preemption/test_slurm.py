"""Preemption under a real Slurm (issue 23, item 4): `scancel --signal=TERM JOB` while 2 tasks train under
`srun`; both save at the same run and exit 42; the batch script requeues the job on 42 (`#SBATCH --requeue`,
`scontrol requeue $SLURM_JOB_ID`); the requeued job resumes at that run and ends with the parameters of an
uninterrupted run (bit for bit). The cluster is tests/cluster/slurm_cluster.py's (Debian's slurm-wlm on this host,
as root); skipped, with the reason, where it cannot start."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster.slurm_cluster import SlurmCluster
from helpers import SCRIPTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import preemption as bench  # noqa: E402

REASON = SlurmCluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# docs/multi-node.md's batch script, with this test's paths
BATCH = """#!/bin/bash
#SBATCH -n2
#SBATCH --requeue
#SBATCH --open-mode=append
echo "ATTEMPT ${{SLURM_RESTART_COUNT:-0}}"
export OMP_NUM_THREADS=1  # as distrib launch gives the reference run's 2 tasks on 2 cores: the same float sums
srun {python} {script} --out {out} --checkpoint-dir {ckpt} --step-seconds 0.1
code=$?
echo "SRUN EXIT $code"
if [ $code -eq 42 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit $code
"""


def _job_state(slurm: SlurmCluster, job: str) -> str:
    _, out = slurm.run(["scontrol", "-o", "show", "job", job], timeout=30)
    found = re.search(r"JobState=(\S+)", out)
    return found.group(1) if found else out


# Not in the README's run: the requeue is Slurm's, and on this 2-core host it failed 2 times in 6 runs
# (2026-11-26: after the batch script's `scontrol requeue`, slurmd said "Job 1 already killed, do not launch batch
# job" and slurmctld purged the job, or the requeued job never ran again within 4 minutes; distrib's part, both
# tasks saving at the same run and exiting 42 within 0.3 s, was right every time). An open item of issue 23.
# `bash scripts/faults.sh` runs it.
@pytest.mark.faults_full
def test_scancel_signal_term_then_requeue_resumes_exactly(tmp_path):
    reference = bench.reference(tmp_path / "reference")
    with SlurmCluster() as slurm:
        log = tmp_path / "job.out"
        script = tmp_path / "job.sh"
        script.write_text(BATCH.format(python=sys.executable, script=SCRIPTS / "preempt_train.py",
                                       out=tmp_path / "out.pt", ckpt=tmp_path / "ckpt"))
        code, submitted = slurm.run(["sbatch", "--parsable", "-o", str(log), str(script)], timeout=30,
                                    cwd=str(tmp_path))
        assert code == 0, submitted
        job = submitted.strip().split(";")[0]
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("START worker=") == 2):
            assert time.monotonic() < deadline, (log.read_text() if log.exists() else "") + slurm.logs()
            time.sleep(0.1)
        time.sleep(0.5)  # a few steps in
        code, out = slurm.run(["scancel", "--signal=TERM", job], timeout=30)
        assert code == 0, out
        while "SRUN EXIT 0" not in log.read_text():
            if time.monotonic() > deadline + 120:
                _, shown = slurm.run(["scontrol", "-o", "show", "job", job], timeout=30)
                pytest.fail(f"the requeued job did not finish:\n{log.read_text()}\n{shown}\n{slurm.logs()[-3000:]}")
            if "SRUN EXIT 42" in log.read_text():
                _, shown = slurm.run(["scontrol", "-o", "show", "job", job], timeout=30)
                # only once it is pending again (moving the start of a job still in REQUEUE was the first suspect of
                # the race below; with this, it still failed once in 2 runs: not the whole cause)
                if "JobState=PENDING" in shown and "Reason=BeginTime" in shown:
                    # Slurm makes a requeued batch job eligible again 2 minutes later (EligibleTime): the test
                    # moves that to now, as an operator may (scontrol update JobId=... StartTime=now)
                    print("REQUEUED", " ".join(re.findall(r"(?:JobState|Reason|EligibleTime|Restarts)=\S+", shown)))
                    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)
            time.sleep(0.3)
        text = log.read_text()
    print(text)
    saved = set(re.findall(r"worker \d: preemption checkpoint at run (\d+) saved", text))
    assert len(saved) == 1 and len(re.findall(r"preemption checkpoint at run", text)) == 2, text
    run = saved.pop()
    assert "SRUN EXIT 42" in text and "ATTEMPT 1" in text, text  # requeued by the batch script on 42
    assert re.findall(rf"START worker=\d restart=0 run={run}", text), text
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "out.pt"), reference))
