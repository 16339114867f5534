"""What :mod:`distrib.torch_patches` assumes of torch (and torchmetrics), pinned.

Each patch, and each private read, relies on how torch is written today. A torch upgrade that
changes one of these fails the test named after it, rather than training going silently wrong.
"""

from __future__ import annotations

import inspect
import pathlib
import warnings

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from torch.amp.grad_scaler import GradScaler

from distrib import torch_patches


def _model_and_sgd() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


# --------------------------------------------------------------------------- GradScaler (StrategyPatches)


def test_grad_scaler_methods_are_plain_functions_with_the_wrapped_signatures() -> None:
    """StrategyPatches swaps these three class attributes and calls torch's own with these arguments."""
    expected = {
        "unscale_": ["self", "optimizer"],
        "step": ["self", "optimizer", "args", "kwargs"],
        "update": ["self", "new_scale"],
    }
    for name, params in expected.items():
        fn = GradScaler.__dict__[name]
        assert inspect.isfunction(fn), (name, fn)
        assert list(inspect.signature(fn).parameters) == params, (name, inspect.signature(fn))
    assert inspect.signature(GradScaler.update).parameters["new_scale"].default is None


def test_grad_scaler_step_calls_unscale_through_the_instance() -> None:
    """The merged step runs torch's ``step``, which must reach the (patched) ``unscale_`` by attribute lookup."""
    calls: list[str] = []

    class Recording(GradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            calls.append("unscale_")
            super().unscale_(optimizer)

    model, sgd = _model_and_sgd()
    scaler = Recording("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(sgd)
    assert calls == ["unscale_"]
    scaler.update()


def test_grad_scaler_keeps_its_scale_and_inf_flags_where_torch_patches_reads_them() -> None:
    """``_scale`` and ``_per_optimizer_states[id(opt)]['found_inf_per_device']``; step and update obey the flags."""
    model, sgd = _model_and_sgd()
    scaler = GradScaler("cpu", init_scale=8.0)
    assert scaler.is_enabled()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scale = torch_patches.scale_tensor(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == 8.0
    scaler.unscale_(sgd)
    flags = torch_patches.found_inf_per_device(scaler, sgd)
    assert flags and all(isinstance(k, torch.device) and v.item() == 0.0 for k, v in flags.items())
    # the merged unscale_ writes back the workers' agreed flag: torch's step must skip, and update back off
    torch_patches.set_found_inf_per_device(scaler, sgd, {scale.device: torch.ones((), device=scale.device)})
    before = model.weight.detach().clone()
    scaler.step(sgd)
    assert torch.equal(model.weight.detach(), before)
    scaler.update()
    assert scaler.get_scale() == 4.0  # backoff_factor 0.5


def test_awaits_unscale_is_when_torchs_step_would_call_unscale() -> None:
    """amp.py unscales the sums itself before torch's ``GradScaler.step`` exactly when torch would: a scale,
    stage READY (``_per_optimizer_states``), an optimizer that does not unscale in its own step."""
    model, sgd = _model_and_sgd()
    scaler = GradScaler("cpu", init_scale=8.0)
    assert not torch_patches.awaits_unscale(scaler, sgd)  # no scale yet: torch's step raises its own error
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert torch_patches.awaits_unscale(scaler, sgd)
    scaler.unscale_(sgd)
    assert not torch_patches.awaits_unscale(scaler, sgd)
    calls: list[str] = []
    real = GradScaler.unscale_
    scaler.unscale_ = lambda opt: (calls.append("unscale_"), real(scaler, opt))[1]  # type: ignore[method-assign]
    scaler.step(sgd)  # unscaled already: torch's step does not unscale again
    assert calls == []
    scaler.update()
    fused = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert getattr(fused, "_step_supports_amp_scaling", False) and not torch_patches.awaits_unscale(scaler, fused)


def test_strategy_patches_are_counted_leases_that_restore_torch() -> None:
    """The first lease puts the methods and the global hook in place; the last release puts torch's back."""
    original = GradScaler.__dict__["update"]
    hooks = dict(optimizer_module._global_optimizer_pre_hooks)

    def update(self: GradScaler, new_scale: object = None) -> None:
        torch_patches.torch_scaler_update(self, new_scale)  # torch's own, though the class is patched

    patches = torch_patches.StrategyPatches({"update": update}, lambda opt, args, kwargs: None)
    first, second = patches.acquire(), patches.acquire()
    assert (
        GradScaler.__dict__["update"] is update and len(optimizer_module._global_optimizer_pre_hooks) == len(hooks) + 1
    )
    scaler = GradScaler("cpu", init_scale=2.0)
    model, sgd = _model_and_sgd()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(sgd)
    scaler.update()  # through the patch, into torch's update: no recursion
    first()
    first()  # a second call of the same release is a no-op: the other lease still holds both
    assert (
        GradScaler.__dict__["update"] is update and len(optimizer_module._global_optimizer_pre_hooks) == len(hooks) + 1
    )
    second()
    assert GradScaler.__dict__["update"] is original
    assert dict(optimizer_module._global_optimizer_pre_hooks) == hooks


# --------------------------------------------------------------------------- the global optimizer hook


def test_global_optimizer_pre_hook_runs_for_the_class_step_and_its_handle_removes_it() -> None:
    """The owner check is torch's register_optimizer_step_pre_hook: its first argument is the optimizer."""
    seen: list[tuple] = []
    count = len(optimizer_module._global_optimizer_pre_hooks)
    handle = optimizer_module.register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append((opt, kwargs)))
    model, sgd = _model_and_sgd()
    model(torch.ones(1, 2)).sum().backward()
    sgd.step()
    handle.remove()
    sgd.step()
    assert seen == [(sgd, {})]
    assert len(optimizer_module._global_optimizer_pre_hooks) == count


def test_an_error_in_the_global_pre_hook_stops_the_step() -> None:
    def refuse(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        raise RuntimeError("refused")

    handle = optimizer_module.register_optimizer_step_pre_hook(refuse)
    try:
        model, sgd = _model_and_sgd()
        model(torch.ones(1, 2)).sum().backward()
        before = model.weight.detach().clone()
        with pytest.raises(RuntimeError, match="refused"):
            sgd.step()
        assert torch.equal(model.weight.detach(), before)
    finally:
        handle.remove()


# --------------------------------------------------------------------------- Optimizer.__init__


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_optimizers_construct_through_the_base_class_init(cls: type) -> None:
    """patch_optimizer_init swaps ``Optimizer.__init__``: every optimizer must run it, param_groups already set."""
    assert inspect.isfunction(torch.optim.Optimizer.__dict__["__init__"])
    seen: list[int] = []
    torch_patches.patch_optimizer_init(lambda opt: seen.append(len(opt.param_groups)))
    try:
        cls(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    finally:
        torch_patches.restore_optimizer_init()
    assert seen == [1]
    assert torch.optim.Optimizer.__init__.__name__ == "__init__"
    assert not hasattr(torch.optim.Optimizer.__init__, "__wrapped__")  # restored


# --------------------------------------------------------------------------- one optimizer's step / zero_grad


def test_an_instance_step_attribute_is_what_step_calls_and_lr_schedulers_accept_it() -> None:
    """wrap_optimizer sets bound methods on the instance; LRScheduler re-wraps ``optimizer.step.__func__``."""
    calls: list[str] = []
    model, sgd = _model_and_sgd()
    torch_patches.wrap_optimizer(
        sgd,
        lambda opt, step, args, kwargs: (calls.append("step"), step(*args, **kwargs)),
        lambda opt, zero_grad, set_to_none: (calls.append("zero"), zero_grad(set_to_none)),
    )
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    model(torch.ones(1, 2)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
        sgd.step()
        scheduler.step()
    sgd.zero_grad()
    assert calls == ["step", "zero"]
    assert sgd.param_groups[0]["lr"] == 0.25
    assert "step" not in type(sgd).__dict__ or type(sgd).__dict__["step"] is not sgd.step


# --------------------------------------------------------------------------- torchmetrics


def test_torchmetrics_counts_updates_in_update_count() -> None:
    """mark_metric_updated bumps ``_update_count``, which torchmetrics' compute() checks before warning."""
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.MeanMetric()
    assert metric._update_count == 0
    with pytest.warns(UserWarning, match="before the ``update`` method"):
        metric.compute()
    metric.reset()
    torch_patches.mark_metric_updated(metric)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metric.compute()


# --------------------------------------------------------------------------- GradScaler state (parameter servers)


def _stepped_scaler(poison: bool = False, **kwargs: float) -> tuple[GradScaler, torch.optim.SGD]:
    model, sgd = _model_and_sgd()
    scaler = GradScaler("cpu", **kwargs)
    loss = model(torch.ones(1, 2)).sum() * (float("inf") if poison else 1.0)
    scaler.scale(loss).backward()
    scaler.step(sgd)
    return scaler, sgd


@pytest.mark.parametrize("poison", [False, True])
def test_a_replayed_update_is_torchs_update(poison: bool) -> None:
    """replay_scale_update drives ``torch._amp_update_scale_`` with the scaler's factors and growth tracker."""
    options = dict(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1)
    scaler, _ = _stepped_scaler(poison, **options)
    assert [f.item() for f in torch_patches.all_found_inf(scaler)] == [1.0 if poison else 0.0]
    scaler.update()
    copy = GradScaler("cpu", **options)  # has scaled nothing yet: its scale tensor is created lazily
    torch_patches.replay_scale_update(copy, 1.0 if poison else 0.0)
    assert copy.state_dict() == scaler.state_dict()
    assert copy.get_scale() == (2.0 if poison else 32.0)
    torch_patches.set_scale(copy, 3.0)
    assert copy.get_scale() == 3.0


def test_a_scalers_enabled_flag_and_step_state_can_be_set_and_dropped() -> None:
    scaler, _ = _stepped_scaler(init_scale=8.0)
    torch_patches.forget_step(scaler)
    assert torch_patches.all_found_inf(scaler) == []
    with pytest.raises(AssertionError, match="No inf checks"):  # what update() says when nothing was unscaled
        scaler.update()
    assert torch_patches.scaler_device(scaler) == "cpu"
    assert torch_patches.scaler_device(GradScaler("cuda", enabled=False)) == "cuda"
    torch_patches.set_enabled(scaler, False)
    assert not scaler.is_enabled()
    torch_patches.set_enabled(scaler, True)
    assert scaler.is_enabled()


# --------------------------------------------------------------------------- optimizer state under parameter servers


def test_a_state_dict_post_hook_gets_torchs_dict_and_its_result_is_returned() -> None:
    """ParameterServerStrategy fills in the servers' state through register_state_dict_post_hook."""
    model, sgd = _model_and_sgd()
    sgd.register_state_dict_post_hook(lambda opt, sd: {**sd, "state": {0: {"from": opt is sgd}}})
    sd = sgd.state_dict()
    assert sd["state"] == {0: {"from": True}} and sd["param_groups"][0]["lr"] == 0.5


def test_torchs_load_state_dict_replaces_the_group_dicts() -> None:
    """Why load_state_dict stays an instance patch under parameter servers: torch's load swaps the group dicts
    for copies of the saved ones (a pre-hook could not keep the groups updated in place)."""
    model, sgd = _model_and_sgd()
    group = sgd.param_groups[0]
    saved = sgd.state_dict()
    saved["param_groups"][0]["lr"] = 0.125
    sgd.load_state_dict(saved)
    assert sgd.param_groups[0] is not group and group["lr"] == 0.5 and sgd.param_groups[0]["lr"] == 0.125
    calls: list[dict] = []
    torch_patches.replace_load_state_dict(sgd, lambda opt, sd: calls.append(sd))
    sgd.load_state_dict(saved)
    assert calls == [saved]


# --------------------------------------------------------------------------- one module's forward


def test_calling_a_module_runs_its_instance_forward_and_the_class_forward_stays_reachable() -> None:
    """route_forward sets ``module.forward`` on the instance: ``module(x)`` must call it (hooks still run)."""
    module = torch.nn.Linear(2, 1)
    seen: list[str] = []
    module.register_forward_hook(lambda mod, args, out: seen.append("hook"))

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append("routed")
        return type(self).forward(self, x) * 2

    expected = torch.nn.Linear.forward(module, torch.ones(1, 2)) * 2
    torch_patches.route_forward(module, forward)
    assert torch.equal(module(torch.ones(1, 2)), expected)
    assert seen == ["routed", "hook"]
    assert "forward" not in vars(torch.nn.Linear) or torch.nn.Linear.forward is not module.forward


def test_a_modules_load_state_dict_pre_hooks_are_seen() -> None:
    """has_load_state_dict_pre_hooks reads ``_load_state_dict_pre_hooks``, filled by the public registration."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    assert not torch_patches.has_load_state_dict_pre_hooks(model)
    model[0].register_load_state_dict_pre_hook(lambda *args: None)
    assert torch_patches.has_load_state_dict_pre_hooks(model)


# --------------------------------------------------------------------------- autograd, process groups, sparse tensors


def test_a_queued_backward_callback_runs_once_after_every_gradient_hook() -> None:
    """The overlapped reducer waits for its buckets in a callback queued from a gradient hook."""
    weight = torch.ones(3, requires_grad=True)
    bias = torch.ones(1, requires_grad=True)
    events: list[str] = []

    def hook(grad: torch.Tensor) -> None:
        events.append("grad")
        if events.count("grad") == 1:
            torch_patches.queue_backward_callback(lambda: events.append("end"))

    weight.register_hook(hook)
    bias.register_hook(hook)
    ((weight * 2).sum() + bias.sum()).backward()
    assert events == ["grad", "grad", "end"]


def test_a_groups_backend_object_is_reachable_and_gloo_has_set_timeout(tmp_path: pathlib.Path) -> None:
    """process_group's long barrier sets the timeout of the WORLD group's gloo backend (torch >= 2.5)."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        backend = torch_patches.group_backend(dist.group.WORLD, torch.device("cpu"))
        assert type(backend).__name__ == "ProcessGroupGloo"
        if hasattr(backend, "set_timeout"):
            backend.set_timeout(datetime.timedelta(seconds=5))
    finally:
        dist.destroy_process_group()


def test_sparse_parts_of_an_uncoalesced_tensor_are_its_stored_entries() -> None:
    """variables.py counts the bytes of sparse gradients without coalescing them."""
    t = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
    assert not t.is_coalesced()
    with pytest.raises(RuntimeError):
        t.indices()  # the public accessor refuses: why sparse_parts exists
    indices, values = torch_patches.sparse_parts(t)
    assert indices.tolist() == [[0, 0, 2]] and values.tolist() == [1.0, 2.0, 3.0]


def test_a_fake_tensor_skeleton_saves_without_data_and_its_records_are_in_pickle_order(tmp_path: pathlib.Path) -> None:
    """What sharded_export.consolidate assumes: fake tensors save under skip_data, storage i is the zip record
    data/<i> in the order the pickle meets them, mmap loading maps each at its record's offset, and bytes written
    there are what torch.load reads back."""
    import os

    from distrib.checkpoint.sharded_export import _record_offsets
    from distrib.tensor_bytes import byte_view
    from distrib.torch_patches import fake_tensor_mode

    with fake_tensor_mode():
        fakes = {"w": torch.empty(100, 3), "b": torch.empty(5, dtype=torch.float64), "n": torch.empty(100, 3)}
    assert fakes["w"].untyped_storage().nbytes() == 1200
    path = str(tmp_path / "skeleton.pt")
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({"objects": {"m": fakes}, "note": 3}, path)
    offsets = _record_offsets(path, {f"m/{k}": k for k in fakes}, fakes)  # raises if a tensor has no record
    assert len(set(offsets.values())) == 3
    values = {
        "w": torch.arange(300.0).reshape(100, 3),
        "b": torch.arange(5.0, dtype=torch.float64) / 7,
        "n": -torch.arange(300.0).reshape(100, 3),
    }
    with open(path, "r+b") as f:
        for name, value in values.items():
            os.pwrite(f.fileno(), byte_view(value), offsets[name])
    again = torch.load(path, weights_only=True)
    assert again["note"] == 3
    for name, value in values.items():
        assert torch.equal(again["objects"]["m"][name], value), name


def test_what_deferred_initialisation_reads_of_torch() -> None:
    """strategies/deferred_record.py: a wrapper subclass with torch function disabled reports its device and
    reaches ``__torch_dispatch__`` from ``nn.init``; an in-place view op changes the wrapper's own size when run
    under no_dispatch; an op's schema says which arguments it writes; a dispatch mode sees ``torch.empty`` as
    ``aten.empty.memory_format``; the graph task id tells a backward pass apart."""
    seen: list[object] = []

    class Wrapper(torch.Tensor):
        __torch_function__ = torch_patches.DISABLED_TORCH_FUNCTION

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
            seen.append(func)
            return args[0]

    w = torch_patches.wrapper_tensor(Wrapper, torch.empty(4, 3, device="meta"), torch.device("cpu"), False)
    assert w.device.type == "cpu" and not w.is_meta and w.shape == (4, 3)
    torch.nn.init.uniform_(w)  # nn.init skips meta tensors; a wrapper reporting the CPU reaches dispatch
    assert seen == [torch.ops.aten.uniform_.default]
    torch_patches.apply_inplace_view(torch.ops.aten.t_.default, (w,), {})
    assert w.shape == (3, 4) and w.stride() == (1, 3)
    schema = torch_patches.op_schema(torch.ops.aten.copy_.default)
    assert [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments][:2] == [True, False]
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.normal_.default.tags
    assert torch.Tag.inplace_view in torch.ops.aten.t_.default.tags

    class Modes(torch_patches.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Modes():
        torch.empty(2, 2)
        torch.nn.Linear(2, 2)  # a layer allocates its parameters with torch.empty
    assert seen[1:3] == [torch.ops.aten.empty.memory_format] * 2
    flags: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: flags.append(torch_patches.in_backward()))
    (x * 2).sum().backward()
    assert flags == [True] and not torch_patches.in_backward()


# --------------------------------------------------------------------------- Optimizer.load_state_dict (restore)


def test_an_optimizer_load_adopts_the_tensors_given_and_leaves_the_old_state_as_it_was() -> None:
    """checkpoint/restore.py keeps an optimizer's old state tensors, not a copy, as the rollback of a restore."""
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    adam.step()
    old = adam.state_dict()
    old_tensors = {(i, k): v for i, s in old["state"].items() for k, v in s.items()}
    kept = {key: v.clone() for key, v in old_tensors.items()}
    new = {
        "state": {i: {k: torch.full_like(v, 7.0) for k, v in s.items()} for i, s in old["state"].items()},
        "param_groups": old["param_groups"],
    }
    assert torch_patches.optimizer_load_replaces_state(adam)
    adam.load_state_dict(new)
    for (i, k), v in old_tensors.items():
        assert torch.equal(v, kept[(i, k)]), (i, k)  # the old tensors were not written
        live = adam.state[adam.param_groups[0]["params"][i]][k]
        assert live is new["state"][i][k] and live is not v, (i, k)  # the loaded ones were adopted
    assert all(adam.state[p] is not s for p, s in zip(adam.param_groups[0]["params"], old["state"].values()))
    adam.load_state_dict(old)  # and loading the old state back restores it
    assert all(torch.equal(adam.state_dict()["state"][i][k], kept[(i, k)]) for i, k in kept)


def test_an_optimizer_with_its_own_load_or_a_load_hook_is_copied_for_the_rollback() -> None:
    class Own(torch.optim.SGD):
        def load_state_dict(self, state_dict: dict) -> None:  # may write into the old tensors
            super().load_state_dict(state_dict)

    model = torch.nn.Linear(2, 1)
    assert not torch_patches.optimizer_load_replaces_state(Own(model.parameters(), lr=0.1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert torch_patches.optimizer_load_replaces_state(sgd)
    sgd.register_load_state_dict_post_hook(lambda optimizer: None)
    assert not torch_patches.optimizer_load_replaces_state(sgd)
    replaced = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_patches.replace_load_state_dict(replaced, lambda optimizer, state: None)  # the parameter servers' load
    assert not torch_patches.optimizer_load_replaces_state(replaced)


def test_cublas_workspaces_can_be_cleared_where_torch_has_cuda() -> None:
    """``torch_patches.clear_cublas_workspaces`` calls ``torch._C._cuda_clearCublasWorkspaces`` (ds.function's
    captures, issue 28): a CUDA build of torch must still have it, or captured graphs share eager workspaces."""
    from distrib import torch_patches

    if torch.backends.cuda.is_built():
        assert callable(getattr(torch._C, "_cuda_clearCublasWorkspaces", None))
    torch_patches.clear_cublas_workspaces()  # a no-op without CUDA, never an error


def test_dtensor_keeps_its_rng_tracker_in_a_module_global_made_without_a_state_broadcast() -> None:
    """On CUDA, MeshStrategy sets ``torch.distributed.tensor._random._rng_tracker`` to an ``OffsetBasedRNGTracker``
    built with ``run_state_sync=False`` (what ``_random.manual_seed`` does, as torchtitan calls it), so that DTensor's
    random ops offset their shards within the tensor-parallel group's stream instead of taking rank 0's state."""
    from torch.distributed.tensor import _random

    assert hasattr(_random, "_rng_tracker")
    assert "run_state_sync" in inspect.signature(_random.OffsetBasedRNGTracker.__init__).parameters
    assert "_rng_tracker" in inspect.getsource(_random.manual_seed)


def test_a_modules_own_parameters_buffers_and_submodules_live_in_the_three_tables_module_tables_returns() -> None:
    """``ds.function``'s guard compares ``module_tables``' entries by identity before every replay: the tables must
    be the very dicts torch registers into, so that a rebound parameter, buffer or submodule (``self.ema = ...``,
    ``model.fc = nn.Linear(...)``) shows there, and holding nothing else."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.register_buffer("ema", torch.zeros(2))
    parameters, buffers, modules = torch_patches.module_tables(model)
    assert parameters == dict(model.named_parameters(recurse=False))
    assert buffers == dict(model.named_buffers(recurse=False))
    assert modules == dict(model.named_children())
    replaced = torch.ones(2)
    model.ema = replaced  # an out-of-place buffer update: torch writes it into the same table
    assert torch_patches.module_tables(model)[1]["ema"] is replaced
    layer = model[0]
    new_weight = torch.nn.Parameter(torch.ones(2, 2))
    layer.weight = new_weight
    assert torch_patches.module_tables(layer)[0]["weight"] is new_weight
    model[0] = torch.nn.Linear(2, 2)
    assert torch_patches.module_tables(model)[2]["0"] is not layer
