"""``ds.function`` on the CPU: the paths it picks and says, its contract, and the safety checks a capture relies on.

The CUDA graph itself is checked on a GPU (``tests/cuda/test_cuda_function.py``, run by ``scripts/gpu_check.sh``);
here, every call runs eagerly, and what must hold is that it says so once, returns what the function returns,
and refuses what a capture could not replay.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import distrib as ds
from distrib.graphs import capturable
from distrib.graphs.cuda_graph import CaptureError, HostWorkGuard
from distrib.graphs.step_function import Function


def seed_step(strategy: ds.Strategy) -> tuple[Function, torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def replica(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=16)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    @ds.function
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(replica, args=(x, y)), axis=None)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
    return step, model, data


def test_on_a_cpu_the_step_runs_eagerly_says_why_once_and_trains_as_without_it(caplog):
    strategy = ds.OneDeviceStrategy("cpu")
    step, model, data = seed_step(strategy)
    plain_step, plain_model, _ = seed_step(ds.OneDeviceStrategy("cpu"))
    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        losses = [float(step(x, y)) for x, y in data * 3]
    plain = [float(plain_step.python_function(x, y)) for x, y in data * 3]
    assert losses == plain
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages  # once, at the first call
    assert "runs eagerly" in messages[0] and "step" in messages[0]
    assert ("computes on cpu" in messages[0]) or ("CUDA is not available" in messages[0]), messages
    assert step.always_eager == (not torch.cuda.is_available())  # no CUDA: later calls go straight through


def test_several_replicas_in_one_process_are_named_as_the_reason(caplog):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    step, _, data = seed_step(strategy)
    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        step(*data[0])
    (path,) = step.paths().values()
    assert path.startswith("eager: MirroredStrategy runs 2 replicas in this process, on threads"), path
    assert any("runs 2 replicas" in r.getMessage() for r in caplog.records)


def test_mode_cuda_graph_makes_a_failure_to_capture_an_error():
    @ds.function(mode="cuda_graph")
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(CaptureError, match="cannot capture the signature"):
        double(torch.ones(2))


def test_mode_eager_and_bad_arguments():
    calls = []

    @ds.function(mode="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x + 1

    assert [float(f(torch.zeros(()))) for _ in range(4)] == [1.0] * 4 and len(calls) == 4
    assert list(f.paths().values()) == ["eager: mode='eager'"]
    with pytest.raises(ValueError, match="mode='graph'"):
        ds.function(lambda x: x, mode="graph")
    with pytest.raises(ValueError, match="warmup_steps=0"):
        ds.function(lambda x: x, warmup_steps=0)
    with pytest.raises(ValueError, match="max_captures=0"):
        ds.function(lambda x: x, max_captures=0)


def test_on_the_replica_function_it_is_part_of_the_step():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])

    @ds.function
    def replica(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    out = strategy.run(replica, args=(torch.ones(2),))
    assert [v.tolist() for v in strategy.experimental_local_results(out)] == [[2.0, 2.0], [2.0, 2.0]]
    assert replica.paths() == {}  # called as it is, inside run: no signature of its own


def test_a_method_can_be_decorated():
    class Trainer:
        scale = 3.0

        @ds.function
        def step(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    assert Trainer().step(torch.ones(1)).tolist() == [3.0]


def test_the_host_work_guard_refuses_what_a_replay_would_not_repeat():
    """A CPU write and a host-to-GPU copy inside a capture are errors naming the op, checked before torch runs it."""
    state = torch.zeros(3)
    with pytest.raises(CaptureError, match=r"aten\.add_\.Tensor writes a CPU tensor"):
        with HostWorkGuard():
            state.add_(1)
    with pytest.raises(CaptureError, match="copies a CPU tensor of shape \\[3\\] to the GPU"):
        # what the guard sees of `cpu_tensor.to("cuda")` (a CPU build of torch refuses before dispatching it)
        HostWorkGuard()._check_copy("aten._to_copy.default", (torch.ones(3),), {"device": torch.device("cuda", 0)})
    with HostWorkGuard():  # new CPU tensors and their shapes are fine
        assert (torch.ones(3) * 2).shape == (3,)
    with pytest.raises(CaptureError, match=r"reads a tensor's value on the host at .*test_function\.py:\d+"):
        with HostWorkGuard():  # a value read on the host would be the capture's at every replay
            float((torch.ones(3) * 2).sum())


def test_the_capture_notes_the_tensors_that_outlive_it():
    """What a graph must keep alive (see ``cuda_graph``'s docstring): every tensor its ops used that is still alive
    when the capture ends (parameters, state, a list argument of a fused op), not the temporaries."""
    import gc
    import weakref

    w, state = torch.ones(3), torch.zeros(3)
    guard = HostWorkGuard()
    with guard:
        temporary = w * 2
        gone = weakref.ref(temporary)
        torch._foreach_add_([state], [temporary])  # a list argument, as the fused optimizers take
        del temporary
    gc.collect()
    assert gone() is None
    survivors = guard.survivors()
    assert any(t is w for t in survivors) and any(t is state for t in survivors)
    assert all(t.shape == (3,) for t in survivors) and len(survivors) == 2


def test_a_float_written_into_a_tensor_rate_is_copied_into_it():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1), capturable=False, foreach=False)
    rate = opt.param_groups[0]["lr"]
    watch = capturable.OptimizerWatch([opt])
    opt.param_groups[0]["lr"] = 0.05  # a hand-written schedule, Keras' LearningRateScheduler
    watch.sync()
    assert opt.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(0.05)
    guard = watch.current_guard()
    opt.param_groups[0]["weight_decay"] = 0.1  # baked into a graph: another graph
    assert watch.current_guard() != guard


def test_the_guard_sees_every_change_of_a_hyperparameter_and_nothing_else():
    """The guard is rebuilt only when a group's objects changed (its fast path, run before every replay): a new
    value, a new key, a new group, a load; an equal float written anew keeps the same guard."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    watch = capturable.OptimizerWatch([opt])
    guard = watch.current_guard()
    assert watch.current_guard() is guard  # nothing changed: the same object, no rebuild
    group = opt.param_groups[0]
    group["lr"] = float("0.1")  # a new float of the same value (what a scheduler writes): the same graph
    assert watch.current_guard() == guard
    group["momentum"] = 0.5
    assert watch.current_guard() != guard
    group["momentum"] = 0.9
    assert watch.current_guard() == guard
    del group["dampening"]
    group["extra"] = 0.0  # as many keys as before, one replaced
    assert watch.current_guard() != guard
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    changed = watch.current_guard()
    assert changed != guard and watch.current_guard() is changed


def test_a_graph_replays_only_in_the_grad_state_it_was_captured_in():
    """``CapturedGraph.matches`` (no GPU needed: it reads ``.grad`` alone), as the accumulation tests on a GPU need
    it: a graph captured with no gradients writes fresh ones, so it must not replay once they exist (it would
    overwrite what should add up); a graph captured with gradients adds into those very tensors, in either state
    it leaves; one that set them to None (``zero_grad`` inside) matches only the gradients it found."""
    from distrib.graphs.cuda_graph import CapturedGraph
    from distrib.graphs.signature import flatten_inputs

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    inputs = flatten_inputs((torch.ones(1),), {})
    grads = [torch.zeros(2) for _ in params]

    def graph(entry: list, left: list) -> CapturedGraph:
        return CapturedGraph(None, list(inputs.leaves), inputs, params, entry, left, torch.ones(()))  # type: ignore[arg-type]

    def set_grads(values: list) -> None:
        for p, g in zip(params, values):
            p.grad = g

    first_micro_batch = graph([None] * 3, grads)
    set_grads([None] * 3)
    assert first_micro_batch.matches()
    set_grads(grads)  # the state it leaves: the next micro-batch must add, which this graph does not
    assert not first_micro_batch.matches()

    later_micro_batch = graph(grads, grads)
    assert later_micro_batch.matches()
    params[1].grad = torch.zeros(2)  # another tensor than the graph's: a different state
    assert not later_micro_batch.matches()
    set_grads([None] * 3)
    assert not later_micro_batch.matches()

    zeroes = graph(grads, [None] * 3)
    set_grads(grads)
    assert zeroes.matches()
    set_grads([None] * 3)
    assert not zeroes.matches()
    params[0].grad = grads[0]  # mixed: one as found, the others None
    assert not zeroes.matches()


def test_a_state_load_is_counted_so_that_its_graphs_are_dropped():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    assert capturable.make_capturable(opt) == []  # on a CPU nothing changes: CUDA graphs only
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    watch = capturable.OptimizerWatch([opt])
    before = watch.current_guard()
    opt.load_state_dict(opt.state_dict())
    assert capturable.state_version(opt) == 1 and watch.current_guard() != before


def test_a_new_signature_is_a_new_trace_and_python_arguments_count_by_value():
    from distrib.graphs.signature import flatten_inputs

    calls = [
        ((torch.ones(4), True), {}),
        ((torch.zeros(4), True), {}),
        ((torch.ones(4), False), {}),
        ((torch.ones(3), True), {}),
        ((torch.ones(4, dtype=torch.float64), True), {}),
        ((torch.ones(4),), {"training": True}),
    ]
    keys = [flatten_inputs(args, kwargs).key for args, kwargs in calls]
    assert keys[0] == keys[1]  # other values: the same graph
    assert len(set(keys)) == 5  # a Python value, a shape, a dtype, a keyword: each a new one


def test_strategies_say_why_they_cannot_be_captured():
    assert ds.OneDeviceStrategy("cpu").graph_capture_blocker == (
        "OneDeviceStrategy computes on cpu, and CUDA graphs need a CUDA device"
    )
    assert "runs 2 replicas" in ds.MirroredStrategy(["cpu:0", "cpu:1"]).graph_capture_blocker
    assert ds.get_strategy().graph_capture_blocker is None  # the default: wherever the tensors are


def test_the_bound_on_captures_and_reduce_retracing(caplog):
    """``max_captures`` (the graphs held) and ``reduce_retracing`` decide whether another graph may be captured
    (checked without a GPU through ``capture_refusal``, which a signature asks before each capture)."""
    from distrib.graphs.signature import flatten_inputs

    f = Function(lambda x: x, reduce_retracing=True)
    full, ragged = flatten_inputs((torch.ones(64, 3),), {}), flatten_inputs((torch.ones(40, 3),), {})
    assert f.capture_refusal(full, "x") is None and f.capture_refusal(full, "x") is None  # the first shape, again
    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        assert "other shapes" in str(f.capture_refusal(ragged, "x"))  # another shape, same structure and dtypes
        assert f.capture_refusal(flatten_inputs((torch.ones(64, 3, dtype=torch.float64),), {}), "x") is None
    assert any("reduce_retracing=True" in r.getMessage() for r in caplog.records)

    bounded = Function(lambda x: x, max_captures=2)
    bounded.held = lambda: 2  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="distrib.function"):
        assert bounded.capture_refusal(full, "the signature (Tensor[64, 3])") is not None
    assert any("max_captures=2" in r.getMessage() and "retracing" in r.getMessage() for r in caplog.records)
