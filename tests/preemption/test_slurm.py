"""Preemption under a real Slurm (issue 23, item 4): `scancel --signal=TERM JOB` while 2 tasks train under
`srun`; both save at the same run and exit 42; the batch script exits with srun's 42 and slurmctld requeues the job
(`RequeueExit=42` in slurm.conf: "Enables automatic requeue for batch jobs which exit with the specified values",
slurm.conf(5)); the requeued job resumes at that run and ends with the parameters of an uninterrupted run (bit for
bit). The cluster is tests/cluster/slurm_cluster.py's (Debian's slurm-wlm on this host, as root); skipped, with the
reason, where it cannot start.

Nothing hurries the requeued job: Slurm lets it start again only `cred_expire` + 1 seconds after the requeue
(slurmctld's batch_requeue_fini: "The time stamp on the new batch launch credential must be larger than the time
stamp on the revoke request"; slurm.conf(5), AuthInfo's cred_expire: "This also controls how long a requeued job
must wait before starting again"). The test used to move the start to now (`scontrol update StartTime=now`) after
an `scontrol requeue` from inside the running batch script, and raced with exactly that: slurmd refused the new
launch ("Job N already killed, do not launch batch job") and slurmctld dropped the job. Its cluster shortens the
wait the documented way instead (cred_expire=10, the main scheduling loop every second).
"""

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

# docs/multi-node.md's batch script, with this test's paths. No requeue inside it: the script ends with srun's
# status, and slurmctld requeues the job on 42 once the job has ended (RequeueExit); --open-mode=append keeps the
# first attempt's lines in the log when the requeued job writes it again
BATCH = """#!/bin/bash
#SBATCH -n2
#SBATCH --open-mode=append
echo "ATTEMPT ${{SLURM_RESTART_COUNT:-0}}"
export OMP_NUM_THREADS=1  # as distrib launch gives the reference run's 2 tasks on 2 cores: the same float sums
srun {python} {script} --out {out} --checkpoint-dir {ckpt} --step-seconds 0.1
code=$?
echo "SRUN EXIT $code"
exit $code
"""
CRED_EXPIRE = 10  # the requeued job may start 11 s after the requeue (Slurm's default: 121 s)
BOUND = 240  # seconds from the submission to the end of the requeued job (typically 40 to 60)


def _job(slurm: SlurmCluster, job: str) -> str:
    """The job's state fields, as `scontrol show job` gives them (empty once slurmctld purged the record)."""
    _, out = slurm.run(["scontrol", "-o", "show", "job", job], timeout=30)
    return " ".join(re.findall(r"(?:JobState|Reason|Restarts|ExitCode|EligibleTime)=\S+", out))


def test_scancel_signal_term_then_requeue_exit_resumes_exactly(tmp_path):
    reference = bench.reference(tmp_path / "reference")
    with SlurmCluster(requeue_exit=(42,), cred_expire=CRED_EXPIRE, sched_interval=1) as slurm:
        log = tmp_path / "job.out"
        script = tmp_path / "job.sh"
        script.write_text(
            BATCH.format(
                python=sys.executable,
                script=SCRIPTS / "preempt_train.py",
                out=tmp_path / "out.pt",
                ckpt=tmp_path / "ckpt",
            )
        )
        code, submitted = slurm.run(
            ["sbatch", "--parsable", "-o", str(log), str(script)], timeout=30, cwd=str(tmp_path)
        )
        assert code == 0, submitted
        job = submitted.strip().split(";")[0]
        started = time.monotonic()

        def read() -> str:
            return log.read_text(errors="replace") if log.exists() else ""

        def fail(what: str) -> None:
            pytest.fail(
                f"{what} ({time.monotonic() - started:.0f} s after the submission):\n{read()}\n"
                f"job: {_job(slurm, job)}\n{slurm.logs()[-4000:]}"
            )

        while read().count("START worker=") < 2:
            if time.monotonic() - started > BOUND / 2:
                fail("the job's 2 tasks did not start")
            time.sleep(0.1)
        time.sleep(0.5)  # a few steps in
        code, out = slurm.run(["scancel", "--signal=TERM", job], timeout=30)
        assert code == 0, out
        noticed = time.monotonic()
        seen: dict[str, float] = {}
        requeued = ""
        while "SRUN EXIT 0" not in read():
            if time.monotonic() - started > BOUND:
                fail("the requeued job did not finish")
            text = read()
            for mark in ("SRUN EXIT 42", "ATTEMPT 1"):
                if mark in text and mark not in seen:
                    seen[mark] = time.monotonic() - noticed
            if "SRUN EXIT 42" in text and "ATTEMPT 1" not in text and not requeued:
                state = _job(slurm, job)
                if "Restarts=1" in state and "JobState=PENDING" in state:
                    requeued = state  # pending again, by slurmctld's own requeue
            time.sleep(0.2)
        text = read()
        finished = time.monotonic()
    print(text)
    print(f"REQUEUED {requeued}")
    print(
        f"FIGURES exit 42 {seen.get('SRUN EXIT 42', -1):.1f} s after the notice, the requeued job started "
        f"{seen.get('ATTEMPT 1', -1):.1f} s after it, the job ended {finished - noticed:.1f} s after it "
        f"({finished - started:.1f} s after the submission)"
    )
    saved = set(re.findall(r"worker \d: preemption checkpoint at run (\d+) saved", text))
    assert len(saved) == 1 and len(re.findall(r"preemption checkpoint at run", text)) == 2, text
    run = saved.pop()
    # one preempted attempt that exited 42, one requeued attempt (by Slurm, SLURM_RESTART_COUNT=1) that exited 0
    assert text.count("ATTEMPT ") == 2 and "ATTEMPT 0" in text and "ATTEMPT 1" in text, text
    assert text.count("SRUN EXIT 42") == 1 and text.index("SRUN EXIT 42") < text.index("ATTEMPT 1"), text
    assert requeued, "the job was never seen PENDING with Restarts=1 between its 2 attempts"
    assert len(re.findall(rf"START worker=\d restart=0 run={run}\b", text)) == 2, text  # both resumed at that run
    final = torch.load(tmp_path / "out.pt")
    assert len(final) == len(reference) and all(torch.equal(a, b) for a, b in zip(final, reference))
