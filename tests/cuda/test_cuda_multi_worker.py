"""Two worker processes on the one GPU (``distrib launch --workers 2``), and NCCL.

* gloo (``implementation="ring"``) with both workers on ``cuda:0``: float16 autocast with a GradScaler
  (tests/scripts/amp_train.py), whose poisoned global batch must skip the step on both workers and
  halve the scale on both; the parameters equal one device's (OneDeviceStrategy in this process).
* the default devices and ``implementation="auto"``: ``distrib launch`` sets ``LOCAL_RANK`` and both
  workers take ``cuda:LOCAL_RANK % 1 = cuda:0``; NCCL refuses two ranks on one GPU, so distrib must
  warn and fall back to gloo, and the training must still be right.
* ``implementation="nccl"`` on the shared GPU: a clear CollectiveError naming the fix, not a hang.
* NCCL alone (one rank): CUDA tensors go over NCCL and distrib's CPU collectives over gloo.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch
from helpers import SCRIPTS, launch, run_bounded

import distrib as ds
from distrib.strategies.devices import worker_devices

_spec = importlib.util.spec_from_file_location("amp_train", SCRIPTS / "amp_train.py")
assert _spec is not None and _spec.loader is not None
amp_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(amp_train)

ATOL = 3e-4  # float16 rounding of sums split differently (tests/strategies/test_amp.py)


@pytest.fixture(scope="module")
def one_device(device: torch.device) -> dict:
    """The AMP run on one replica of the checked device, in this process."""
    return amp_train.train(ds.OneDeviceStrategy(str(device)), device_type=device.type)


def two_workers(tmp_path, *args: str) -> tuple[int, str, dict]:
    out = tmp_path / "amp.pt"
    code, text, _ = launch("--workers", "2", str(SCRIPTS / "amp_train.py"), "--out", str(out), *args, timeout=150)
    return code, text, (torch.load(out, map_location="cpu") if code == 0 else {})


def assert_amp_matches(text: str, result: dict, expected: dict) -> None:
    scales = {
        int(w): eval(s) for w, s in re.findall(r"\[worker (\d)\] worker \d of 2, \d replicas: scales: (\[.*\])", text)
    }
    assert scales == {0: expected["scales"], 1: expected["scales"]}, text  # same decisions on both workers
    assert expected["scales"][amp_train.POISONED] == expected["scales"][amp_train.POISONED - 1] / 2
    for before, after in zip(result["before_poisoned"], result["after_poisoned"]):
        assert torch.equal(before, after)  # the poisoned step changed nothing
    for p, q in zip(result["params"], expected["params"]):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-3, atol=ATOL)


def test_two_workers_share_the_gpu_over_gloo_with_float16_and_a_poisoned_batch(tmp_path, device, one_device):
    code, text, result = two_workers(tmp_path, "--devices", f"{device.type}:0", "--implementation", "ring")
    assert code == 0, text
    assert re.search(rf"worker 0 devices \['{device.type}(:0)?'\] backend gloo", text), text
    assert_amp_matches(text, result, one_device)


def test_default_devices_follow_local_rank_and_nccl_falls_back_to_gloo_on_a_shared_gpu(tmp_path, device, one_device):
    code, text, result = two_workers(tmp_path)  # devices from LOCAL_RANK, implementation="auto"
    assert code == 0, text
    for w in (0, 1):  # one GPU: local rank 1 takes cuda:1 % 1 = cuda:0 as well
        assert re.search(rf"worker {w} devices \['{device.type}(:0)?'\] backend gloo", text), text
    if device.type == "cuda":
        assert "NCCL cannot run two ranks on one GPU" in text and "using gloo instead" in text, text
    assert_amp_matches(text, result, one_device)


def test_local_rank_picks_the_gpu_modulo_the_visible_count(device):
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    for rank in range(3):
        chosen = worker_devices({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3"})
        assert chosen == ([f"cuda:{rank % gpus}"] if gpus else ["cpu:0"])
        assert ds.OneDeviceStrategy(chosen[0]).local_devices[0].type == device.type


def test_nccl_asked_for_on_a_shared_gpu_is_a_clear_error(tmp_path, device, cuda_only):
    code, text, _ = two_workers(tmp_path, "--devices", "cuda:0", "--implementation", "nccl")
    assert code != 0
    assert "NCCL cannot run two ranks on one GPU" in text and "implementation='ring'" in text, text


NCCL_ONE_RANK = """
import torch, distrib as ds
from distrib.comm.process_group import ProcessGroupCommunicator
from distrib.testing import pick_unused_port
comm = ProcessGroupCommunicator(f"127.0.0.1:{pick_unused_port()}", 0, 1,
                                ds.CommunicationOptions(implementation="nccl", timeout_seconds=60),
                                uses_cuda=True, device=torch.device("cuda:0"))
t = torch.arange(4.0, device="cuda:0")
comm.all_reduce([t])
comm.verify_same("signature", "a check on the CPU")
print("backend", comm.backend, "sum", float(t.sum()), "objects", comm.all_gather_object({"a": 1}))
"""


def test_nccl_carries_cuda_tensors_and_gloo_the_cpu_checks(device, cuda_only):
    code, text, _ = run_bounded([sys.executable, "-c", NCCL_ONE_RANK], timeout=120)
    assert code == 0, text
    assert "backend cpu:gloo,cuda:nccl sum 6.0 objects [{'a': 1}]" in text, text
