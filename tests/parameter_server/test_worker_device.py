"""Where a worker task computes: ``Server(device=...)``, ``DISTRIB_WORKER_DEVICE``, else its GPU or its CPU."""

from __future__ import annotations

import pytest
import torch

import distrib as ds
from distrib.parameter_server.worker_device import WORKER_DEVICE_ENV, resolve_worker_device, to_worker_device

CLUSTER = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}


def test_the_default_is_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.delenv(WORKER_DEVICE_ENV, raising=False)
    assert resolve_worker_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_the_environment_names_the_device(monkeypatch):
    monkeypatch.setenv(WORKER_DEVICE_ENV, "cpu")
    assert resolve_worker_device() == torch.device("cpu")
    monkeypatch.setenv(WORKER_DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=f"{WORKER_DEVICE_ENV}='tpu'.*'cpu', 'cuda' or 'cuda:N'"):
        resolve_worker_device()
    assert resolve_worker_device("cpu") == torch.device("cpu")  # the argument wins


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_a_gpu_the_process_does_not_see_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"Server\(device=.cuda:1.\), but this process sees no GPU.*use 'cpu'"):
        resolve_worker_device("cuda:1")


def test_a_ps_task_keeps_its_variables_in_host_memory():
    with pytest.raises(ValueError, match="a ps task keeps its variables in host memory"):
        ds.Server(CLUSTER, "ps", 0, token="a-token-of-32-characters-or-more", start=False, device="cuda")
    assert ds.Server(CLUSTER, "ps", 0, token="a-token-of-32-characters-or-more", start=False).device == torch.device(
        "cpu"
    )


def test_a_worker_server_reports_its_device(monkeypatch):
    monkeypatch.delenv(WORKER_DEVICE_ENV, raising=False)
    assert ds.Server(
        CLUSTER, "worker", 0, token="a-token-of-32-characters-or-more", start=False, device="cpu"
    ).device == torch.device("cpu")


def test_tensors_move_and_the_rest_stays():
    moved = to_worker_device({"x": torch.ones(2), "n": 3, "s": "a", "t": (torch.zeros(1),)}, torch.device("meta"))
    assert moved["n"] == 3 and moved["s"] == "a"
    assert moved["x"].device.type == "meta" and moved["t"][0].device.type == "meta"  # nested tensors move too
