"""A step whose model has a shape mistake, under one strategy: what each worker's user sees.

    TF_CONFIG=... python tests/scripts/user_error_step.py STRATEGY WHO TIMEOUT_SECONDS [stay]   (each of 2 workers)
    python tests/scripts/user_error_step.py STRATEGY all 5        (one process: one-device, mirrored, central)

(``distrib launch --workers 2`` runs it too, but stops the other worker as soon as one fails, often before that
worker could say why its collective failed: tests/strategies/test_user_errors.py starts the two itself.)

STRATEGY: multi-worker, sharded, mesh (1 x 2, the heads split over the model axis), mesh-fsdp (2 workers on the
batch axis), one-device, mirrored (two replicas in one process), central. After one good step, the workers named
by WHO (``all``, or a worker index) run a step whose attention splits its projection into heads of the whole width
(``view(b, t, HEADS, DIM)``: the head size forgotten), a shape RuntimeError inside the user's forward; the other
workers run the good step, so they wait in a collective for the worker that raised.

Each worker prints ``RAISED <type>: <first line>``, ``AFTER <seconds the failing step took>``, the file and function
of the traceback's last frame and the exception's notes, then lets the exception go on up (exit 1), as a user's
script would. With ``stay``, a worker whose own step raised catches it and stays alive for TIMEOUT_SECONDS + 3 s
(the others' collectives then end at their timeout, not at its exit).
"""

import os
import sys
import time
import traceback

import torch
from torch import nn
from torch.nn import functional as F

import distrib as ds

name, who, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
stay = sys.argv[4:] == ["stay"]
DIM, HEADS, SEQ, BATCH = 16, 4, 4, 8
options = ds.CommunicationOptions(timeout_seconds=timeout)
if name == "multi-worker":
    strategy: ds.Strategy = ds.MultiWorkerMirroredStrategy(communication_options=options)
elif name == "sharded":
    strategy = ds.ShardedStrategy(devices=["cpu"], communication_options=options)
elif name in ("mesh", "mesh-fsdp"):
    from distrib.experimental import DeviceMesh, LayoutMap, MeshStrategy

    mesh = DeviceMesh((1, 2) if name == "mesh" else (2,), ("batch", "model") if name == "mesh" else ("batch",))
    layout_map = None
    if name == "mesh":
        layout_map = LayoutMap(mesh)
        layout_map[r"qkv\.weight"] = ("model", None)  # the heads split: ColwiseParallel
        layout_map[r"out\.weight"] = (None, "model")  # RowwiseParallel
    strategy = MeshStrategy(mesh, layout_map, devices=["cpu"], communication_options=options)
elif name == "one-device":
    strategy = ds.OneDeviceStrategy("cpu")
elif name == "mirrored":
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
elif name == "central":
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"])
else:
    raise SystemExit(f"unknown strategy {name!r}")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if forgot_head_size:
            h = self.qkv(x).view(b, t, HEADS, DIM)  # the mistake: heads of the whole width
        else:
            h = self.qkv(x).view(b, t, -1, DIM // HEADS)  # -1: the heads this worker holds
        h = h.transpose(1, 2)
        h = F.softmax(h, dim=-1).transpose(1, 2).reshape(b, t, -1)
        return self.out(h)


forgot_head_size = False
torch.manual_seed(0)
with strategy.scope():
    model = Attention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = ds.compute_average_loss((model(x) - y).pow(2).sum((1, 2)), global_batch_size=BATCH)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


g = torch.Generator().manual_seed(1)
batches = [(torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)) for _ in range(2)]
data = iter(strategy.experimental_distribute_dataset(batches))
strategy.run(step, args=next(data))
forgot_head_size = who == "all" or int(who) == strategy.worker_index
start = time.monotonic()
try:
    strategy.run(step, args=next(data))
except Exception as e:  # noqa: BLE001 - what the user would see, printed
    last = traceback.extract_tb(e.__traceback__)[-1]
    first_line = traceback.format_exception_only(type(e), e)[0].strip()
    print(f"RAISED {first_line}", flush=True)
    print(f"AFTER {time.monotonic() - start:.2f} s", flush=True)
    print(f"LAST FRAME {os.path.basename(last.filename)}:{last.name}", flush=True)
    print(f"NOTES {getattr(e, '__notes__', [])}", flush=True)
    if stay and forgot_head_size:
        time.sleep(timeout + 3)
        os._exit(0)
    raise
print("no error", flush=True)
