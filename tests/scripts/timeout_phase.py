"""One worker of a timeout trial (issue 30, item 2): a phase that waits for a peer that never comes, died or hangs.

    TF_CONFIG=... python tests/scripts/timeout_phase.py PHASE TIMEOUT [--fault dead|hung] [--late S] [--dir DIR]

PHASE is ``join`` (build ``ds.MultiWorkerMirroredStrategy``; the test starts this worker alone, or with some
workers missing), ``collective`` (a ``strategy.reduce``), ``barrier`` (``strategy.barrier()``) or ``checkpoint``
(``ds.Checkpoint.save(timeout=TIMEOUT)`` while the chief hangs or dies mid-write; the collectives' own timeout
is then the default 300 s, so only the checkpoint's bound can end the wait). TIMEOUT is the user's number.
The faulty worker is the chief: it starts ``--late`` seconds after the other, both make one reduction
together, then it dies (``--fault dead``: ``os._exit``) or hangs (``--fault hung``: sleeps until the test
kills it), and the other times its call. The waiting worker prints one line,

    TIMED phase=<p> rank=<r> outcome=<CollectiveError|joined|returned|other exception> elapsed=<s> message=<line>

``elapsed``: from the call to its error. torch is imported before the clock starts, as any training script
imports it before building a strategy (distrib imports it lazily otherwise, and its import is no wait).
"""

import argparse
import json
import os
import sys
import time

import torch

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("phase", choices=["join", "collective", "barrier", "checkpoint"])
p.add_argument("timeout", type=float)
p.add_argument("--fault", choices=["dead", "hung"], default="hung")
p.add_argument("--dir", default=".")
p.add_argument("--late", type=float, default=0.0, help="the faulty worker joins this many seconds after the other")
args = p.parse_args()
rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", "?")


def report(outcome: str, elapsed: float, message: str = "") -> None:
    first = message.splitlines()[0] if message else "-"
    print(f"TIMED phase={args.phase} rank={rank} outcome={outcome} elapsed={elapsed:.2f} message={first}", flush=True)


def timed(call) -> None:
    start = time.monotonic()
    try:
        call()
        outcome, message = "returned", ""
    except ds.CollectiveError as e:
        outcome, message = "CollectiveError", str(e)
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        outcome, message = type(e).__name__, str(e)
    report(outcome, time.monotonic() - start, message)
    os._exit(0)  # a half-made group must not delay the exit


# the checkpoint's wait is bounded by save(timeout=...): the collectives keep their default, far longer
comm_timeout = None if args.phase == "checkpoint" else args.timeout
options = ds.CommunicationOptions(timeout_seconds=comm_timeout)
if args.phase == "join":
    timed(lambda: ds.MultiWorkerMirroredStrategy(communication_options=options))

faulty = rank == 0  # the chief: the other worker's join waits for its store
if faulty:
    # the other worker's join then uses up part of its deadline before the group is made: the group must still
    # wait the whole timeout
    time.sleep(args.late)
strategy = ds.MultiWorkerMirroredStrategy(communication_options=options)
strategy.reduce("SUM", torch.ones(3))  # both joined and have made a collective together


def fault() -> None:
    if args.fault == "dead":
        os._exit(0)
    time.sleep(3600)  # hung: the test kills it


if args.phase == "checkpoint":
    from distrib.checkpoint import core

    if faulty:  # the chief dies or hangs while it writes; the others wait for it at the checkpoint's barrier
        core.write_data_file = lambda *_: fault()
    checkpoint = ds.Checkpoint(step=torch.zeros(1))
    timed(lambda: checkpoint.save(os.path.join(args.dir, "ckpt"), timeout=args.timeout))
elif faulty:
    fault()
elif args.phase == "collective":
    timed(lambda: strategy.reduce("SUM", torch.ones(3)))
else:
    timed(strategy.barrier)
sys.exit(1)  # not reached
