"""The Fashion-MNIST CNN of TensorFlow's custom-training-loop tutorial.

Architecture (Keras defaults: Glorot-uniform weights, zero biases, 'valid'
padding, floor-mode 2x2 max pooling)::

    Conv2d(1, 32, 3) -> ReLU -> MaxPool 2x2 -> Conv2d(32, 64, 3) -> ReLU
    -> MaxPool 2x2 -> Flatten -> Linear(1600, 64) -> ReLU -> Linear(64, 10)

Two formulations of exactly the same function are provided:

* :func:`plain_fashion_mnist_cnn` - the textbook ``nn.Sequential`` in the default
  (NCHW-contiguous) memory format.  Used as the benchmark baseline.
* :func:`fashion_mnist_cnn` - the fast CPU formulation (~1.6-1.9x the plain
  training step on a 2-core CPU, see ``benchmarks/cnn_variants.py``).  It changes
  *how* the same math is evaluated, never *what* is computed:

  1. **Max pooling before ReLU.**  ``relu`` is monotone, so
     ``maxpool(relu(x)) == relu(maxpool(x))`` bit for bit, and the gradients are
     identical too (a window whose maximum is <= 0 gets zero gradient either
     way; otherwise the same arg-max element receives it).  The ReLU and its
     backward then touch 4x fewer elements.
  2. **Channels-last activations.**  The input is viewed (for one channel this is
     free, no copy) with NHWC strides, so oneDNN convolutions produce
     channels-last outputs and the max-pool forward/backward kernels run
     vectorised over channels.  In the default layout they are the single most
     expensive non-convolution op of the step.  Parameters keep the default
     layout, so state dicts, optimizers and gradient all-reduce are unaffected.

Both are ``nn.Sequential`` with the same layer indices, so state dicts are
interchangeable; results agree up to float rounding (summation order).

The optimizer is the tutorial's Adam with Keras' defaults (``lr=1e-3``, ``eps=1e-7``), built by
:func:`fashion_mnist_optimizer` as PyTorch's fused implementation where the parameters' device
has one (CPU, CUDA): the same update, one kernel per step instead of ~7 per parameter tensor
(the single-tensor loop PyTorch picks on CPU costs ~1.6 ms a step on one core, fused ~0.5 ms).

``torch.compile`` was measured too (torch 2.13, CPU, inductor): it was *slower*
than the eager fast formulation (inductor's max-pool backward and layout copies
cost more than ATen/oneDNN kernels) on top of 10-60 s of compile time.  It stays
available, off by default, through :func:`maybe_compile`, which never fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "FashionMNISTCNN",
    "fashion_mnist_cnn",
    "fashion_mnist_optimizer",
    "keras_init_",
    "maybe_compile",
    "plain_fashion_mnist_cnn",
]

NUM_CLASSES = 10
_FLAT_FEATURES = 64 * 5 * 5  # 28 -conv-> 26 -pool-> 13 -conv-> 11 -pool-> 5


def keras_init_(module: nn.Module) -> nn.Module:
    """Re-initialise ``Conv2d``/``Linear`` layers like Keras defaults (in place).

    Glorot-uniform weights (PyTorch's ``xavier_uniform_`` uses the same fan-in /
    fan-out, including the kernel receptive field for convolutions) and zero
    biases.  Returns ``module`` for chaining.
    """
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
    return module


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` (N, C, H, W) with channels-last strides; a view when C == 1."""
    if x.dim() != 4:
        return x
    n, c, h, w = x.shape
    if c == 1:
        # (N, H, W, 1) -> (N, 1, H, W) with strides (H*W, 1, W, 1): no copy for
        # contiguous input, and unambiguously channels-last for oneDNN.
        return x.reshape(n, h, w, 1).permute(0, 3, 1, 2)
    return x.contiguous(memory_format=torch.channels_last)


class FashionMNISTCNN(nn.Sequential):
    """Fast CPU formulation: pool-before-ReLU, channels-last activations.

    Layer indices match :func:`plain_fashion_mnist_cnn` (parameters live at
    ``0``, ``3``, ``7`` and ``9``), so state dicts load across the two.
    """

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 32, kernel_size=3),  # 0
            nn.MaxPool2d(2),  # 1  (pool first: relu and max commute)
            nn.ReLU(),  # 2
            nn.Conv2d(32, 64, kernel_size=3),  # 3
            nn.MaxPool2d(2),  # 4  (floor mode: 11 -> 5, like Keras 'valid')
            nn.ReLU(),  # 5
            nn.Flatten(),  # 6  (copies back to NCHW order, same as plain)
            nn.Linear(_FLAT_FEATURES, 64),  # 7
            nn.ReLU(),  # 8
            nn.Linear(64, NUM_CLASSES),  # 9
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(channels_last(x))


def fashion_mnist_cnn() -> nn.Module:
    """The tutorial CNN in its fastest eager CPU formulation, Keras-initialised.

    Same function, parameters and gradients as :func:`plain_fashion_mnist_cnn`
    (up to float rounding); max pooling runs before ReLU and activations are
    channels-last, which makes a batch-64 training step ~1.6-1.9x faster on CPU.
    Input: float32 ``(N, 1, 28, 28)``; output: ``(N, 10)`` logits.
    """
    return keras_init_(FashionMNISTCNN())


def fashion_mnist_optimizer(params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The main job's optimizer: Adam with Keras' defaults (``eps=1e-7``), fused where the device allows.

    ``fused=True`` runs the same Adam update as PyTorch's default implementation (up to float
    rounding) as one vectorised kernel; it needs floating-point parameters on a device with a
    fused kernel, otherwise the default implementation is used. State dicts are the same either
    way (a checkpoint loads into a plain ``torch.optim.Adam``).

    Example::

        >>> opt = fashion_mnist_optimizer(fashion_mnist_cnn().parameters())
        >>> type(opt).__name__, opt.defaults["eps"], opt.defaults["fused"]
        ('Adam', 1e-07, True)
    """
    params = [{**p, "params": list(p["params"])} if isinstance(p, dict) else p for p in params]
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    fused = bool(tensors) and all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in tensors)
    return torch.optim.Adam(params, lr=lr, eps=1e-7, fused=fused or None)


_FUSED_DEVICES = ("cpu", "cuda")


def plain_fashion_mnist_cnn() -> nn.Module:
    """The textbook ``nn.Sequential`` formulation (benchmark baseline).

    Conv -> ReLU -> MaxPool ordering in the default memory format, with the same
    Keras-like initialisation and the same layer indices as
    :func:`fashion_mnist_cnn`.
    """
    model = nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=3),  # 0
        nn.ReLU(),  # 1
        nn.MaxPool2d(2),  # 2
        nn.Conv2d(32, 64, kernel_size=3),  # 3
        nn.ReLU(),  # 4
        nn.MaxPool2d(2),  # 5
        nn.Flatten(),  # 6
        nn.Linear(_FLAT_FEATURES, 64),  # 7
        nn.ReLU(),  # 8
        nn.Linear(64, NUM_CLASSES),  # 9
    )
    return keras_init_(model)


class _CompiledOrEager(nn.Module):
    """Calls ``torch.compile(model)``; on any compile error warns once, then runs eager.

    Inductor compiles the backward graph lazily (at the first ``backward()``,
    outside this module), so the first grad-mode call also runs a throw-away
    ``autograd.grad`` through the compiled graph to surface backward-compile
    errors here, where they can still be caught.
    """

    def __init__(self, model: nn.Module, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model  # shares parameters with the caller's model
        self._compiled: Callable[..., Any] | None = compiled
        self._backward_checked = False

    @property
    def compiled(self) -> bool:
        """Whether the compiled forward and backward both ran (False once it fell back to eager)."""
        return self._compiled is not None and self._backward_checked

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            return self.model(*args, **kwargs)
        try:
            out = self._compiled(*args, **kwargs)
            if not self._backward_checked and isinstance(out, torch.Tensor) and out.requires_grad:
                params = [p for p in self.model.parameters() if p.requires_grad]
                torch.autograd.grad(out.sum(), params, retain_graph=True, allow_unused=True)
                self._backward_checked = True
            return out
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "run eager"
            self._fall_back(exc)
            return self.model(*args, **kwargs)

    def _fall_back(self, exc: BaseException) -> None:
        self._compiled = None
        msg = f"torch.compile failed ({type(exc).__name__}: {str(exc)[:300]}); running eager instead"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """Return ``torch.compile(model)`` when ``enabled`` (else ``model``); never raises.

    Compile errors (no C++ compiler, unsupported platform or Python, inductor
    bugs) are caught, reported with a ``RuntimeWarning`` and the eager model is
    used instead.  Uses automatic dynamic shapes (``dynamic=None``), so a
    shorter last batch costs one recompile, not one per batch size.  On CPU this
    was measured slower than eager for this model, so leave it off by default.
    Parameters are shared: checkpoint and optimise ``model``, call the result.
    """
    if not enabled:
        return model
    try:
        compiled = torch.compile(model)
    except Exception as exc:  # noqa: BLE001
        msg = f"torch.compile unavailable ({type(exc).__name__}: {exc}); running eager instead"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return model
    return _CompiledOrEager(model, compiled)
