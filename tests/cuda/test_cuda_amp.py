"""CUDA automatic mixed precision under the strategies of one process.

* float16 with a GradScaler (tests/scripts/amp_train.py, autocast and scaler on the checked device):
  under OneDevice, Mirrored over ``[cuda:0]`` and over ``[cuda:0, cpu]``, the scale after every step must be
  one device's, the poisoned (NaN) global batch must skip the step (parameters unchanged) and halve the scale;
  the parameters match one device's. The two-process case is in test_cuda_multi_worker.py.
* the main job's ``make_steps`` with ``bf16-mixed`` and ``16-mixed`` under OneDevice: the logits really are
  bfloat16 / float16 (autocast active on the device), and the training follows the fp32 run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import SCRIPTS

import distrib as ds
from distrib.app import models
from distrib.app.train import make_steps

_spec = importlib.util.spec_from_file_location("amp_train", SCRIPTS / "amp_train.py")
assert _spec is not None and _spec.loader is not None
amp_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(amp_train)


@pytest.fixture(scope="module")
def one_device(device: torch.device) -> dict:
    return amp_train.train(ds.OneDeviceStrategy(str(device)), device_type=device.type)


def test_one_device_float16_skips_the_poisoned_step_and_halves_the_scale(one_device):
    scales = one_device["scales"]
    assert scales[amp_train.POISONED] == scales[amp_train.POISONED - 1] / 2
    assert scales[0] == 2.0**10 and max(scales) > 2.0**10  # it grew on clean steps (growth_interval 2)
    for before, after in zip(one_device["before_poisoned"], one_device["after_poisoned"]):
        assert torch.equal(before, after)
    assert all(torch.isfinite(p).all() for p in one_device["params"])


@pytest.mark.parametrize("two", [False, True], ids=["mirrored_gpu", "mirrored_gpu_and_cpu"])
def test_mirrored_float16_agrees_with_one_device(device, other_device, one_device, two):
    strategy = ds.MirroredStrategy([str(device), other_device] if two else [str(device)])
    result = amp_train.train(strategy, device_type=device.type)
    assert result["scales"] == one_device["scales"]
    for before, after in zip(result["before_poisoned"], result["after_poisoned"]):
        assert torch.equal(before, after)
    atol = 3e-3 if two and device.type == "cuda" else 3e-4  # the CPU replica is not autocast to float16 by "cuda"
    for p, q in zip(result["params"], one_device["params"]):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-3, atol=atol)


def run_main_job(device: torch.device, precision: str, steps: int = 6) -> tuple[list[torch.Tensor], set, list[float]]:
    strategy = ds.OneDeviceStrategy(str(device))
    with strategy.scope():
        torch.manual_seed(0)
        model = models.fashion_mnist_cnn()
        opt = models.fashion_mnist_optimizer(model.parameters())
        metrics = (ds.metrics.SparseCategoricalAccuracy(), ds.metrics.Mean(), ds.metrics.SparseCategoricalAccuracy())
    dtypes: set = set()

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        dtypes.add(out.dtype)
        return out

    train_step, _ = make_steps(forward, opt, 32, *metrics, precision=precision)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    # the batch reaches the device as distrib train's does: through the strategy's input (run copies nothing)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = [float(strategy.run(train_step, args=(batch,)).detach()) for _ in range(steps)]  # one batch, learnt
    return [p.detach().cpu() for p in model.parameters()], dtypes, losses


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_main_job_mixed_precision_runs_in_that_dtype_and_follows_fp32(device, precision, dtype):
    ref, ref_dtypes, ref_losses = run_main_job(device, "32")
    got, dtypes, losses = run_main_job(device, precision)
    assert ref_dtypes == {torch.float32} and dtypes == {dtype}
    assert losses[-1] < losses[0] - 0.08 and ref_losses[-1] < ref_losses[0] - 0.08  # both learn the batch
    assert losses == pytest.approx(ref_losses, rel=0.05, abs=0.02)
    init = [p.detach() for p in models.fashion_mnist_cnn().parameters()]
    moved = sum(float((r - i).abs().mean()) for r, i in zip(ref, init))
    apart = sum(float((a - r).abs().mean()) for a, r in zip(got, ref))
    assert apart < 0.25 * moved  # mixed precision moves the parameters as fp32 does, up to rounding
