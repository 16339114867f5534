"""The gradient reducer, driven by a deterministic fake communicator (the real one is in test_collectives.py).

``TwinWorkers`` stands for two workers whose peer computed exactly the same gradients,
so a correct SUM over workers doubles every gradient: anything else (a bucket reduced
twice, a pass reduced whole instead of only its new part, a missed bucket) shows.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from distrib.comm import BucketedGradientReducer, GradBucket, reduce_gradients
from distrib.comm.communicator import completed_future
from distrib.comm.gradient_reducer import bucket_layout


class TwinWorkers:
    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.reduced: list[int] = []  # numel of every bucket reduced, in order

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        self.reduced.append(tensor.numel())
        tensor.mul_(2)
        return completed_future(tensor)

    def wait(self, future: Any) -> Any:
        return future.wait()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _local_grads(model: nn.Module, *batches: torch.Tensor) -> list[torch.Tensor]:
    twin = copy.deepcopy(model)
    for x in batches:
        twin(x).pow(2).sum().backward()
    return [p.grad.clone() for p in twin.parameters()]


def test_backward_leaves_the_sum_over_workers_in_grad_bucket_by_bucket_in_order():
    model, comm = _model(), TwinWorkers()
    x = torch.randn(3, 4)
    expected = [2 * g for g in _local_grads(model, x)]
    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=64)
    model(x).pow(2).sum().backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    # reverse registration order, a new bucket once 64 bytes are reached: [b2, w2] then [b1, w1]
    assert comm.reduced == [2 + 16, 8 + 32]
    reducer.synchronize()


def test_after_the_first_step_grads_are_views_into_the_bucket_buffers():
    model, comm = _model(), TwinWorkers()
    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=1 << 20)  # one bucket
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        reducer.synchronize()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # every grad lives in the one flat buffer: nothing is copied back


def test_accumulating_two_backward_passes_reduces_only_each_pass_new_part():
    model, comm = _model(), TwinWorkers()
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    expected = [2 * g for g in _local_grads(model, a, b)]
    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=64)
    model(a).pow(2).sum().backward()
    model(b).pow(2).sum().backward()  # a second pass before step(): only b's part may travel
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    assert comm.reduced == [18, 40, 18, 40]
    reducer.synchronize()


def test_a_parameter_no_worker_used_keeps_grad_none():
    model = _model()
    unused = nn.Parameter(torch.ones(3))
    comm = TwinWorkers()
    reducer = BucketedGradientReducer([*model.parameters(), unused], comm, bucket_bytes=1 << 20)
    model(torch.randn(2, 4)).sum().backward()
    assert unused.grad is None and all(p.grad is not None for p in model.parameters())
    reducer.synchronize()


def test_a_comm_hook_sees_every_bucket_and_its_result_lands_in_grad():
    model, comm = _model(), TwinWorkers()
    x = torch.randn(3, 4)
    expected = [3 * g for g in _local_grads(model, x)]
    seen: list[tuple[int, int]] = []

    def triple(communicator: Any, bucket: GradBucket) -> Any:
        seen.append((bucket.index, len(bucket.parameters)))
        return completed_future(bucket.buffer * 3)  # a new tensor: the reducer copies it back

    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=64, hook=triple)
    model(x).pow(2).sum().backward()
    assert seen == [(0, 2), (1, 2)] and comm.reduced == []
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    reducer.synchronize()


def test_close_removes_the_autograd_hooks():
    model, comm = _model(), TwinWorkers()
    x = torch.randn(3, 4)
    local = _local_grads(model, x)
    reducer = BucketedGradientReducer(list(model.parameters()), comm, bucket_bytes=64)
    reducer.close()
    model(x).pow(2).sum().backward()
    assert comm.reduced == []
    for p, e in zip(model.parameters(), local):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("bucket_bytes", [4, 1 << 20])
def test_reduce_gradients_sums_complete_gradients_through_the_hook(bucket_bytes):
    comm = TwinWorkers()
    grads = [torch.ones(3), torch.full((2, 2), 5.0), torch.zeros(1, dtype=torch.float64)]
    reduce_gradients(comm, grads, bucket_bytes)
    assert [g.tolist() for g in grads] == [[2.0] * 3, [[10.0, 10.0], [10.0, 10.0]], [0.0]]
    assert sum(comm.reduced) == 8 and (len(comm.reduced) == 3 if bucket_bytes == 4 else len(comm.reduced) == 2)


@pytest.mark.parametrize("bucket_bytes", [64, 100, 1 << 20])
def test_both_paths_hand_the_hook_the_same_buckets_under_the_same_index(bucket_bytes):
    """The overlapped reducer and the complete-gradient path (several local replicas) bucket through
    ``bucket_layout``: bucket ``i`` holds the same parameters on both, so per-index hook state agrees."""
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}

    def recorder(seen: list) -> Any:
        def hook(communicator: Any, bucket: GradBucket) -> Any:
            seen.append((bucket.index, [names[id(p)] for p in bucket.parameters], bucket.buffer.numel()))
            return completed_future(bucket.buffer)

        return hook

    overlapped: list = []
    reducer = BucketedGradientReducer(list(model.parameters()), TwinWorkers(), bucket_bytes, hook=recorder(overlapped))
    model(torch.randn(3, 4)).sum().backward()
    reducer.synchronize()
    reducer.close()
    complete: list = []
    params = list(model.parameters())
    reduce_gradients(TwinWorkers(), [p.grad for p in params], bucket_bytes, recorder(complete), parameters=params)
    assert complete == overlapped
    expected = {
        64: [["2.bias", "2.weight"], ["0.bias", "0.weight"]],
        100: [["2.bias", "2.weight", "0.bias"], ["0.weight"]],
        1 << 20: [["2.bias", "2.weight", "0.bias", "0.weight"]],
    }[bucket_bytes]
    assert [members for _, members, _ in complete] == expected


def test_bucket_layout_starts_a_bucket_at_the_size_and_at_each_dtype_change():
    tensors = [torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(2), torch.zeros(8)]
    assert bucket_layout(tensors, 32) == [[3], [2], [1], [0]]
    assert bucket_layout(tensors, 1 << 20) == [[3, 2], [1], [0]]
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        bucket_layout(tensors, 0)
