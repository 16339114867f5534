"""``import distrib`` changes nothing in torch; a strategy's patches are gone once it is released.

Each check runs in a fresh interpreter (this test process has long imported distrib and built
strategies). What is compared: the identity of every attribute in the ``__dict__`` of
``torch.optim.Optimizer``, ``torch.amp.GradScaler``, ``torch.cuda.amp.GradScaler`` and
``torch.nn.Module`` (so ``__init__``, ``step``, ``zero_grad``, ``unscale_``, ``update``, ``__call__``...),
and the contents of torch's global hook dicts (optimizer step pre/post hooks, module forward /
backward / registration hooks). The patches (:mod:`distrib.torch_patches`) are
applied while a strategy needs them and removed when its scope closes (``Optimizer.__init__``)
or when the strategy, its modules and optimizers are garbage-collected (the GradScaler methods
and the global optimizer hook).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SNAPSHOT = textwrap.dedent("""
    import gc, warnings
    import torch
    import torch.optim.optimizer as optimizer_module
    import torch.nn.modules.module as module_module

    CLASSES = [torch.optim.Optimizer, torch.amp.GradScaler, torch.cuda.amp.GradScaler, torch.nn.Module]
    HOOK_DICTS = [optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks] + [
        getattr(module_module, name) for name in sorted(vars(module_module))
        if name.startswith("_global_") and isinstance(getattr(module_module, name), dict)]

    def snapshot():
        classes = {(c.__module__, c.__qualname__, k): id(v) for c in CLASSES for k, v in vars(c).items()}
        hooks = [tuple((k, id(v)) for k, v in d.items()) for d in HOOK_DICTS]
        return classes, hooks

    def differences(before, after):
        changed = sorted(str(k) for k in set(before[0]) | set(after[0]) if before[0].get(k) != after[0].get(k))
        if before[1] != after[1]:
            changed.append("global hook dicts: %r -> %r" % (before[1], after[1]))
        return changed
""")


def _run(body: str) -> str:
    """Run ``SNAPSHOT + body`` in a fresh interpreter; its stdout (a failure shows its stderr)."""
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT + textwrap.dedent(body)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_distrib_leaves_torch_untouched() -> None:
    out = _run("""
        before = snapshot()
        assert len(before[1]) >= 6, before[1]  # the optimizer dicts and the module hook dicts were found
        import distrib, distrib.parameter_server, distrib.keras  # every subpackage a user may import
        print("CHANGED", differences(before, snapshot()))
    """)
    assert "CHANGED []" in out, out


def test_patches_are_applied_while_used_and_removed_after() -> None:
    out = _run("""
        before = snapshot()
        import distrib as ds
        warnings.simplefilter("ignore")

        def collect():
            gc.collect(); gc.collect()  # the second pass frees what the first one's weakref callbacks released

        for make in (lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]), lambda: ds.CentralStorageStrategy(["cpu:0"])):
            strategy = make()
            with strategy.scope():
                inside = differences(before, snapshot())
                model = torch.nn.Linear(2, 1)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu")

            def step(x):
                loss = ds.compute_average_loss(model(x).sum(1), global_batch_size=4)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()

            for batch in strategy.experimental_distribute_dataset([torch.ones(4, 2)]):
                strategy.run(step, args=(batch,))
            in_use = differences(before, snapshot())
            del strategy
            collect()
            model_kept = differences(before, snapshot())
            del model, optimizer, step, batch
            collect()
            print("INSIDE", inside)
            print("IN_USE", in_use)
            print("MODEL_KEPT", model_kept)
            print("RELEASED", differences(before, snapshot()))
    """)
    lines = out.splitlines()
    inside = [line for line in lines if line.startswith("INSIDE")]
    in_use = [line for line in lines if line.startswith("IN_USE")]
    kept = [line for line in lines if line.startswith("MODEL_KEPT")]
    released = [line for line in lines if line.startswith("RELEASED")]
    assert len(released) == 2, out
    for line in inside:  # in a scope: Optimizer.__init__ is wrapped (and, with 2 replicas, GradScaler too)
        assert "'Optimizer', '__init__'" in line, line
    for line in in_use + kept:  # scope closed, strategy in use (or its model and optimizer kept): GradScaler only
        assert "'GradScaler', 'unscale_'" in line and "'GradScaler', 'update'" in line, line
        assert "'__init__'" not in line, line
    assert "global hook dicts" in in_use[0], in_use[0]  # the owner check: a global optimizer pre-hook
    assert released == ["RELEASED []", "RELEASED []"], out
