"""The coordinator of a parameter-server job around PreemptionCheckpointHandler (issue 23, item 6).

    distrib launch --workers 2 --ps 1 tests/scripts/preempt_ps.py --checkpoint-dir DIR [--notice-at RUN]

Schedules --steps steps through ``handler.run(coordinator.schedule, step)``. Each step applies SGD
(lr 1/64) to a zero-initialised Linear(4, 1) whose gradient is always 1, so after N applied steps every
weight is exactly -N/64: a step lost or applied twice across the preemption shows in the final weights.
On the first start the coordinator sends itself SIGTERM when --notice-at steps are scheduled. Prints
``START run=N`` and ``FINAL steps_applied=X runs=N``.
"""

import argparse
import os
import signal
import time

import torch
from torch import nn

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--checkpoint-dir", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--notice-at", type=int, default=-1)
args = p.parse_args()

strategy = ds.ParameterServerStrategy(ds.cluster_resolver.TFConfigClusterResolver(), connect_timeout=60)
with strategy.scope():
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1 / 64)
coordinator = ds.coordinator.ClusterCoordinator(strategy)
handler = ds.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, ds.Checkpoint(model=model, optimizer=optimizer), args.checkpoint_dir
)
first = os.environ.get("DISTRIB_RESTART") == "0"
print(f"START run={handler.total_run_calls}", flush=True)


def train_step():
    model(torch.ones(1, 4)).sum().backward()  # d/dw = 1 for every weight
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.02)  # several steps in flight when the notice comes


while handler.total_run_calls < args.steps:
    if handler.total_run_calls == args.notice_at and first:
        print(f"NOTICE run={handler.total_run_calls}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    handler.run(coordinator.schedule, train_step)
coordinator.join()
weight = strategy.checkpoint_state(model)["weight"]  # the value on the ps task, as a checkpoint reads it
print(
    f"FINAL steps_applied={-float(weight[0, 0]) * 64:g} runs={handler.total_run_calls} "
    f"equal={bool(torch.all(weight == weight[0, 0]))}",
    flush=True,
)
