"""``ds.callbacks.TensorBoard``: Keras' TensorBoard callback over ``torch.utils.tensorboard``."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from typing import Any

import torch

from distrib import context
from distrib.keras.callback_base import Callback, Logs, user_stacklevel

__all__ = ["TensorBoard"]


class TensorBoard(Callback):
    """Write the logs as TensorBoard scalars (``epoch_loss``, ``epoch_val_loss`` → ``validation/epoch_loss``, ...).

    The chief alone writes, with ``torch.utils.tensorboard`` (needs the ``tensorboard``
    package), under ``log_dir/train`` and ``log_dir/validation`` as Keras does. With
    ``update_freq=N`` the training loss is also written every N batches (``batch_loss``).

    ``write_graph=True`` (Keras' default) writes the model's graph to ``log_dir/train``
    after the first training batch of each ``fit`` (TensorBoard's Graphs tab). PyTorch has
    no graph until one is traced: the first batch's input to the model (replica 0's, caught
    by a forward pre-hook that is removed once it fired) is given to
    ``SummaryWriter.add_graph``, which traces the model with ``torch.jit.trace`` in eval
    mode and without gradients; the random number generators are put back afterwards, so
    writing the graph changes no training result. A model that cannot be traced (data-
    dependent control flow, outputs that are not tensors) gives one warning and training
    goes on without the graph. Under ParameterServerStrategy the model runs on the workers,
    never here, so no graph is written (a warning says so).

    ``histogram_freq=N`` writes a histogram of every floating-point tensor of the model's
    ``state_dict()`` (weights and buffers, as Keras' ``layer.weights``) to ``log_dir/train``
    every N epochs, at the epoch (TensorBoard's Histograms tab). The arguments keep Keras'
    order: ``TensorBoard(log_dir, histogram_freq, write_graph, ..., update_freq)``.

    Args:
        log_dir: the folder of the event files (``train/`` and ``validation/`` under it).
        histogram_freq: write weight histograms every this many epochs; 0: none.
        write_graph: write the model's graph after the first training batch.
        update_freq: ``"epoch"``, or also write the training loss every this many batches.

    Raises:
        ValueError: ``histogram_freq`` is not a non-negative int.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        update_freq: str | int = "epoch",
    ) -> None:
        if isinstance(histogram_freq, bool) or not isinstance(histogram_freq, int) or histogram_freq < 0:
            raise ValueError(
                f"TensorBoard(histogram_freq={histogram_freq!r}): give 0 (no histograms) or a number of epochs"
            )
        self.log_dir, self.update_freq, self.write_graph = os.fspath(log_dir), update_freq, write_graph
        self.histogram_freq = histogram_freq
        self._writers: dict[str, Any] = {}
        self._step = 0
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._example: tuple[Any, ...] | None = None

    def _writer(self, kind: str) -> Any:
        if kind not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            self._writers[kind] = SummaryWriter(os.path.join(self.log_dir, kind))
        return self._writers[kind]

    # ------------------------------------------------------------------ the graph
    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.write_graph and self.loop.is_chief and self._hook is None:
            self._example = None
            self._hook = self.loop.model.register_forward_pre_hook(self._catch_input)

    def _catch_input(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """The forward pre-hook: keep replica 0's first input (the other replicas' live on other devices)."""
        replica = context.current_replica()
        if self._example is None and (replica is None or replica.local_replica_id == 0):
            self._example = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)

    def _trace_graph(self) -> None:
        """Write the graph of the model for the input caught; warn (once: the hook is gone) if it cannot be traced."""
        model = self.loop.model
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: trace the module it compiled
        example = self._example or ()
        devices = sorted({a.device.index or 0 for a in example if isinstance(a, torch.Tensor) and a.is_cuda})
        printed = io.StringIO()  # add_graph prints the tracer's error before raising it
        try:
            with (
                torch.random.fork_rng(devices=devices),
                torch.no_grad(),
                contextlib.redirect_stdout(printed),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")  # TracerWarnings about Python values: the graph is for display
                self._writer("train").add_graph(model, example[0] if len(example) == 1 else example)
        except Exception as e:  # any tracing failure: the graph is an extra, training goes on
            warnings.warn(
                f"TensorBoard(write_graph=True): the graph of {type(model).__name__} could not be traced "
                f"with torch.jit.trace, so none is written ({type(e).__name__}: {str(e).strip()[:300]}). "
                "Training goes on; pass write_graph=False to skip it.",
                UserWarning,
                stacklevel=user_stacklevel(),  # the user's fit
            )
        self._writer("train").flush()

    def _release_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ------------------------------------------------------------------ scalars
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._step += 1
        if self._hook is not None and self._example is not None:
            self._release_hook()
            self._trace_graph()
        if self.loop.is_chief and isinstance(self.update_freq, int) and self._step % self.update_freq == 0:
            for k, v in (logs or {}).items():
                self._writer("train").add_scalar(f"batch_{k}", v, self._step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.loop.is_chief:
            return
        for k, v in (logs or {}).items():
            kind, name = ("validation", k[4:]) if k.startswith("val_") else ("train", k)
            self._writer(kind).add_scalar(f"epoch_{name}", v, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            for name, tensor in self.loop.model.state_dict().items():
                if tensor.is_floating_point() and tensor.numel():
                    self._writer("train").add_histogram(name, tensor.detach().float().cpu(), epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._hook is not None:  # the model never ran in this process
            self._release_hook()
            if self.loop.scheduled:  # the executor's word: steps ran on other processes
                reason = "under ParameterServerStrategy the model runs on the workers, not in this process"
            else:
                reason = "the model was not called during training"
            warnings.warn(
                f"TensorBoard(write_graph=True): no graph is written: {reason}. Pass write_graph=False "
                "to silence this.",
                UserWarning,
                stacklevel=user_stacklevel(),  # the user's fit
            )
        for w in self._writers.values():
            w.close()
        self._writers = {}
