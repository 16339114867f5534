"""Gradient compression (issue 12, item 1): what lands in ``.grad`` through each hook.

``TwinWorkers`` stands for two workers whose peer computed exactly the same gradients, so
the exact SUM over workers is twice the local gradient; it records the dtype and size of
everything it "sends". The real two-process run is ``test_two_workers_train_...`` at the end.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from helpers import SCRIPTS, launch
from torch import nn

import distrib as ds
from distrib.comm import (
    BucketedGradientReducer,
    CastHook,
    CommunicationOptions,
    GradBucket,
    PowerSGD,
    allreduce_hook,
    reduce_gradients,
)
from distrib.comm.communicator import completed_future


class TwinWorkers:
    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.sent: list[tuple[torch.dtype, int]] = []

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        self.sent.append((tensor.dtype, tensor.numel()))
        tensor.mul_(2)  # exact in every float type (bar overflow, as a real sum would)
        return completed_future(tensor)

    def wait(self, future: Any) -> Any:
        return future.wait()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _local_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    twin = copy.deepcopy(model)
    twin(x).pow(2).sum().backward()
    return [p.grad.clone() for p in twin.parameters()]


def _reduce_once(model: nn.Module, hook: Any, x: torch.Tensor, comm: TwinWorkers) -> list[torch.Tensor]:
    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=1 << 20, hook=hook)
    model(x).pow(2).sum().backward()
    reducer.synchronize()
    reducer.close()
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------- options
def test_options_turn_each_compression_into_its_hook():
    assert CommunicationOptions().comm_hook() is allreduce_hook
    assert repr(CommunicationOptions(compression="BF16").comm_hook()) == "CastHook('bf16')"
    assert CommunicationOptions(compression="fp16").compression == "fp16"
    psgd = PowerSGD(rank=2, start_iter=3)
    hook_a, hook_b = (CommunicationOptions(compression=psgd).comm_hook() for _ in range(2))
    assert hook_a is not hook_b and hook_a.settings == psgd  # each hook has its own state
    assert ds.PowerSGD is PowerSGD


@pytest.mark.parametrize(
    "value, message",
    [
        ("int8", "compression='int8') is not a compression; accepted: None, 'fp16', 'bf16' or ds.PowerSGD"),
        ("bfloat16", "(for 'bfloat16' write 'bf16')"),
        (PowerSGD, "pass an instance, e.g. compression=ds.PowerSGD(rank=2, start_iter=10)"),
        (0.5, "compression=0.5) is not a compression"),
    ],
)
def test_a_wrong_compression_is_an_error_that_lists_what_is_accepted(value, message):
    with pytest.raises(ValueError) as info:
        CommunicationOptions(compression=value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 0}, "PowerSGD(rank=0): rank must be an integer >= 1"),
        ({"rank": 2.5}, "PowerSGD(rank=2.5)"),
        ({"start_iter": -1}, "PowerSGD(start_iter=-1): start_iter must be an integer >= 0"),
        ({"min_compression_rate": 0.5}, "PowerSGD(min_compression_rate=0.5)"),
    ],
)
def test_wrong_powersgd_settings_are_errors_that_name_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PowerSGD(**kwargs)


# ---------------------------------------------------------------------------------------- casts
def test_no_compression_leaves_the_exact_sum_in_grad():
    model, comm = _model(), TwinWorkers()
    x = torch.randn(5, 12)
    expected = [2 * g for g in _local_grads(model, x)]
    got = _reduce_once(model, CommunicationOptions().comm_hook(), x, comm)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert {d for d, _ in comm.sent} == {torch.float32}


def test_bf16_sends_bf16_and_leaves_the_bf16_rounded_sum_in_fp32_grads():
    model, comm = _model(), TwinWorkers()
    x = torch.randn(5, 12)
    local = _local_grads(model, x)
    got = _reduce_once(model, CommunicationOptions(compression="bf16").comm_hook(), x, comm)
    assert comm.sent == [(torch.bfloat16, sum(g.numel() for g in local))]  # one bucket, half the bytes
    for g, loc in zip(got, local):
        assert g.dtype == torch.float32
        assert torch.equal(g, 2 * loc.to(torch.bfloat16).float())  # exactly the sum of the bf16 values
        assert (g - 2 * loc).abs().le(2 * loc.abs() * 2**-8).all()  # within bf16 rounding
    assert any(not torch.equal(g, 2 * loc) for g, loc in zip(got, local))  # the cast really happened


def test_fp16_sums_within_fp16_rounding():
    model, comm = _model(), TwinWorkers()
    x = torch.randn(5, 12)
    local = _local_grads(model, x)
    got = _reduce_once(model, CommunicationOptions(compression="fp16").comm_hook(), x, comm)
    assert [d for d, _ in comm.sent] == [torch.float16]
    for g, loc in zip(got, local):
        assert (g - 2 * loc).abs().le(2 * loc.abs() * 2**-11 + 1e-7).all()
    assert any(not torch.equal(g, 2 * loc) for g, loc in zip(got, local))


def test_fp16_divides_by_the_workers_so_a_sum_beyond_fp16_range_stays_finite():
    grads = [torch.full((4,), 40000.0), torch.full((3,), -1e-3)]  # 2 x 40000 = 80000 > 65504, fp16's largest
    reduce_gradients(TwinWorkers(), grads, 1 << 20, hook=CastHook("fp16"))
    assert torch.isfinite(grads[0]).all() and grads[0].tolist() == [80000.0] * 4
    torch.testing.assert_close(grads[1], torch.full((3,), -2e-3), rtol=2**-10, atol=0)


def test_the_several_replicas_path_reduces_complete_gradients_through_the_cast_hook():
    comm = TwinWorkers()
    grads = [torch.full((3,), 1.0 + 2**-10), torch.full((2, 2), 5.0)]
    reduce_gradients(comm, grads, 1 << 20, hook=CommunicationOptions(compression="bf16").comm_hook())
    assert comm.sent == [(torch.bfloat16, 7)]
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [[10.0, 10.0], [10.0, 10.0]]


# ---------------------------------------------------------------------------------------- PowerSGD
def test_powersgd_is_exact_before_start_iter_then_sends_low_rank_factors():
    torch.manual_seed(1)
    model, comm = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 20)), TwinWorkers()
    hook = PowerSGD(rank=2, start_iter=3).hook()
    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=1 << 20, hook=hook)
    for step in range(5):
        x = torch.randn(8, 40)
        local = _local_grads(model, x)
        comm.sent.clear()
        model(x).pow(2).sum().backward()
        reducer.synchronize()
        grads = [p.grad for p in model.parameters()]
        if step < 3:  # plain all-reduce: the exact sum, the whole bucket on the wire
            assert all(torch.equal(g, 2 * loc) for g, loc in zip(grads, local))
            assert comm.sent == [(torch.float32, 40 * 30 + 30 + 30 * 20 + 20)]
        else:  # P with the biases, then Q: (30 + 20) x 2 + 50 numbers, then (40 + 30) x 2
            assert comm.sent == [(torch.float32, 2 * (20 + 30) + 20 + 30), (torch.float32, 2 * (30 + 40))]
            w1, b1, w2, b2 = grads
            assert torch.equal(b1, 2 * local[1]) and torch.equal(b2, 2 * local[3])  # 1-d: summed exactly
            assert torch.linalg.matrix_rank(w1) == 2 and torch.linalg.matrix_rank(w2) == 2
            assert not torch.allclose(w1, 2 * local[0], rtol=0.05)  # a real approximation of the sum
        model.zero_grad()
    assert hook.steps(0) == 5


def test_powersgd_returns_the_sum_itself_for_a_gradient_of_low_rank():
    g = torch.outer(torch.randn(30), torch.randn(50)) + torch.outer(torch.randn(30), torch.randn(50))  # rank 2
    out = PowerSGD(rank=2, start_iter=0).hook()(TwinWorkers(), GradBucket(0, g.flatten().clone(), [g])).wait()
    torch.testing.assert_close(out.view_as(g), 2 * g, rtol=1e-4, atol=1e-4)  # the SUM, not the mean


def _accumulated_deviation(error_feedback: bool, steps: int) -> list[float]:
    """Feed one fixed full-rank gradient every step; how far the sum of what was sent drifts from the truth."""
    torch.manual_seed(0)
    g = torch.randn(16, 24)
    hook, comm = PowerSGD(rank=2, start_iter=0, error_feedback=error_feedback).hook(), TwinWorkers()
    sent, drift = torch.zeros_like(g), []
    for step in range(1, steps + 1):
        sent += hook(comm, GradBucket(0, g.flatten().clone(), [g])).wait().view_as(g)
        drift.append(float((sent - 2 * step * g).norm() / (2 * g).norm()))
    return drift


def test_error_feedback_keeps_the_accumulated_error_bounded():
    with_feedback, without = _accumulated_deviation(True, 60), _accumulated_deviation(False, 60)
    # with error feedback, what was not sent is sent later: the drift stays a few gradients, not growing
    assert max(with_feedback) < 8 and with_feedback[-1] < 1.5 * max(with_feedback[:20])
    # without it, the part outside rank 2 is lost every step: the drift grows with the steps
    assert without[-1] > 30 and without[-1] > 2.5 * without[19]


def test_a_gradient_that_was_zero_for_a_step_is_sent_again_afterwards():
    hook, comm = PowerSGD(rank=1, start_iter=0).hook(), TwinWorkers()
    zero, g = torch.zeros(6, 8), torch.outer(torch.arange(1.0, 7.0), torch.ones(8))
    out = hook(comm, GradBucket(0, zero.flatten().clone(), [zero])).wait()
    assert torch.equal(out, torch.zeros(48))  # no NaN from normalising a zero vector
    out = hook(comm, GradBucket(0, g.flatten().clone(), [g])).wait()
    torch.testing.assert_close(out.view_as(g), 2 * g)  # a Q lost to the zero gradient is drawn again


def test_a_bucket_that_changes_shape_is_an_error_naming_the_fix():
    hook, comm = PowerSGD(rank=1, start_iter=0).hook(), TwinWorkers()
    a, b = torch.randn(4, 6), torch.randn(6, 4)
    hook(comm, GradBucket(0, a.flatten().clone(), [a])).wait()
    with pytest.raises(ValueError, match=r"bucket 0 was .*\(4, 6\).* now .*\(6, 4\).*own hook"):
        hook(comm, GradBucket(0, b.flatten().clone(), [b]))


# ---------------------------------------------------------------------------------------- two real workers
def test_two_workers_compress_as_computed_by_hand_and_train_to_the_uncompressed_result(tmp_path):
    """Real processes over gloo, MultiWorkerMirroredStrategy's two gradient paths: the bucketed reducer
    (1 replica per worker) and several local replicas (summed in fp32, then reduced across workers).

    What each compression leaves in ``param.grad`` after ``strategy.run`` equals the sum computed by hand
    from every replica's own gradient (cast, summed in the low type, cast back; PowerSGD: the exact sum
    projected onto rank 2), and differs from the fp32 sum within the type's rounding: the strategy
    really compresses.
    """
    out = tmp_path / "compression.json"
    code, log, _ = launch("--workers", "2", str(SCRIPTS / "compression_train.py"), "--out", str(out), timeout=180)
    assert code == 0, log
    results = json.loads(out.read_text())
    for path in ("bucketed", "replicas"):
        runs = results[path]
        none = runs["none"]
        assert none["max_diff_vs_reference"] < 1e-5  # no compression: what one process computes
        assert none["step"]["vs_hand"] < 1e-6 and none["step"]["within_rounding"], (path, none["step"])
        for name in ("bf16", "fp16"):
            step = runs[name]["step"]
            assert step["vs_hand"] == 0, f"{path}/{name}: not the {name} sum: {step}"  # exactly the cast-sum-cast
            assert step["vs_exact"] > 0, f"{path}/{name}: the strategy did not compress: {step}"
            assert step["within_rounding"], (path, name, step)
        assert runs["bf16"]["step"]["vs_exact"] > runs["fp16"]["step"]["vs_exact"]  # 8 significant bits vs 11
        psgd = runs["powersgd"]["step"]
        assert psgd["ranks"] == [2, 2], (
            path,
            psgd,
        )  # both weight matrices arrive as rank 2 (the exact sums have rank 20 and 5)
        assert psgd["vs_hand"] < 1e-4, (path, psgd)  # = the exact sum projected onto that rank-2 column space
        assert psgd["vs_exact"] > 1e-3, (path, psgd)  # ... which is not the exact sum
        for name, tolerance in (("bf16", 0.02), ("fp16", 0.005), ("powersgd", 0.05)):
            run = runs[name]
            assert run["max_diff_vs_none"] > 0, f"{path}/{name}: the strategy did not compress"
            assert abs(run["loss"] - none["loss"]) < tolerance * none["start_loss"], (path, name, run)


def test_powersgd_on_several_local_replicas_buckets_by_bytes_per_pack_as_the_overlapped_reducer(tmp_path):
    """Issue 19, item 6: both gradient paths bucket through one function with ``bytes_per_pack``.

    Two real workers train with ``CommunicationOptions(bytes_per_pack=512, compression=PowerSGD(...))``
    once with one replica each (the reducer overlapped with backward) and once with two local
    replicas each (summed, then reduced). Both hand PowerSGD the same buckets under the same index
    (the 512 bytes split the model in two, reverse order), so its per-index state means the same
    thing, and the two runs train to the same parameters (their local sums differ only by rounding).
    Before, the several-replicas path made one 25 MiB bucket in forward order.
    """
    out = tmp_path / "buckets.json"
    code, log, _ = launch("--workers", "2", str(SCRIPTS / "powersgd_buckets.py"), "--out", str(out), timeout=120)
    assert code == 0, log
    results = json.loads(out.read_text())
    layout = [[0, ["2.bias", "2.weight"]], [1, ["0.bias", "0.weight"]]]
    for path, run in results.items():
        assert run["buckets"] == layout * 12, (path, run["buckets"][:4])  # every step, the same two buckets
        assert run["steps"] == {"0": 12, "1": 12}, path  # PowerSGD's state: one reduction a step per index
        assert run["loss"] < 0.85 * run["start_loss"], (path, run)  # it trains
    diff = max(
        abs(a - b)
        for pa, pb in zip(results["bucketed"]["params"], results["replicas"]["params"])
        for a, b in zip(pa, pb)
    )
    assert diff < 1e-4, diff  # the same compression of the same buckets on both paths
