"""`distrib launch` and preemption (issue 23): a task exiting with 42 restarts the group without counting against
--max-restarts; any other failure still does; the help says so; the tasks are told the grace period."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import launch

# exits with CODE on the first start (DISTRIB_RESTART=0), then succeeds; prints the grace period it was told
SCRIPT = textwrap.dedent("""
    import os, sys
    print("grace", os.environ["DISTRIB_GRACE_SECONDS"], "restart", os.environ["DISTRIB_RESTART"], flush=True)
    if os.environ["DISTRIB_RESTART"] == "0" and os.environ["RANK"] == "1":
        sys.exit(int(sys.argv[1]))
""")


def test_a_preemption_exit_restarts_the_group_without_using_a_restart(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    code, out, _ = launch("--workers", "2", "--max-restarts", "0", "--grace-seconds", "3", str(script), "42")
    assert code == 0, out
    assert "not counted against --max-restarts" in out
    assert out.count("grace 3 restart 1") == 2  # both tasks started again, told the grace period
    code, out, _ = launch("--workers", "2", "--max-restarts", "0", str(script), "3")
    assert code == 3 and "restart 1" not in out, out  # an ordinary failure still counts (none allowed here)


def test_the_help_says_a_preemption_restart_is_not_counted():
    out = subprocess.run(
        [sys.executable, "-m", "distrib.app.cli", "launch", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    flat = " ".join(out.split())
    assert "exiting with 42" in flat and "without counting against K" in flat, out
    assert "--grace-seconds" in flat and "DISTRIB_GRACE_SECONDS" in flat
