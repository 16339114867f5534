"""One captured CUDA graph of a ``ds.function`` signature: its buffers, its capture, its replay.

PyTorch's whole-network capture (``torch.cuda.graph``), done for the user, with what makes a replay the
same as an eager call:

* **inputs** are copied into static buffers on the device before every replay (a CPU batch too: the
  graph reads the buffer, never a host address);
* **outputs** are the graph's own tensors, overwritten by the next replay: each call returns copies,
  so a loss kept from step 3 is still step 3's (as a tf.function returns new tensors);
* **gradients**: a graph bakes in the addresses of the ``.grad`` tensors it reads and leaves behind. The
  Python side is put back after each replay (``param.grad`` is what the capture left), and a graph replays
  only when every tracked parameter's ``.grad`` is in the state it was captured in (None, or the same
  tensor): gradient accumulation over several calls, or a ``zero_grad()`` between calls, picks (or
  captures) the graph made for that state instead of replaying a wrong one;
* **no host value baked in**: a read of a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``,
  of any tensor) and a write into an optimizer's hyperparameter tensor (an LR scheduler's ``step()`` inside the
  step fills the rate with a Python number) would be the capture's value at every replay: both are refused;
* **no frozen host work**: while capturing, a dispatch mode refuses a copy from a CPU tensor to the
  device (its host address would be read at every replay, long after the CPU tensor is gone: the
  segmentation fault a hand-made capture can end in) and an in-place write to a CPU tensor (it would
  happen once, at capture, and never again). Either is a :class:`CaptureError` naming the op, and the
  signature runs eagerly instead;
* **the memory it replays into is kept alive**: a graph holds raw addresses, and a tensor freed after the
  capture (a model, an optimizer or a metric only the step's first trace could reach: a global rebound, an
  object dropped) would go back to the caching allocator while the graph still writes into it, then to another
  tensor or to the driver (an illegal memory access, or silent corruption). The capture notes every tensor an op
  is given; those still alive at its end are held by the graph, as long as it lives (the crash of a hand-made graph
  whose model and optimizer had no reference left: ``benchmarks/capture_probe.py``);
* **one memory pool for the graphs of one function** (``torch.cuda.graph_pool_handle()``, as torch's
  ``make_graphed_callables`` shares one across its graphs): the full batch's, the ragged last batch's and the
  evaluation's graphs reuse one another's temporaries instead of each reserving its own. That is safe because a
  graph's outputs are copied right after its replay and every tensor that outlives a replay (parameters, state,
  ``.grad``) is alive, hence never handed to another graph; a step that leaves *new* tensors behind (fresh
  ``.grad`` tensors: the first call of a gradient accumulation, a ``zero_grad()`` before the backward instead of
  after the update) gets private pools, since a graph captured before may use that memory for its temporaries. cuBLAS's workspace is allocated inside the pool
  (``torch_patches.clear_cublas_workspaces`` around the capture): a graph captured with a workspace from outside
  its pool writes into freed memory once a later capture empties the cache.

The device calls go through a :class:`GraphBackend` (CUDA's by default). A test can put a stand-in in its place
(:func:`use_backend`) that records and replays aten ops on the CPU, so that the guards above run without a GPU.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from distrib import torch_patches
from distrib.graphs.signature import Inputs

__all__ = ["CaptureError", "CapturedGraph", "HostWorkGuard", "GraphBackend", "backend", "use_backend", "user_line"]

_grad_of = operator.attrgetter("grad")


class CaptureError(RuntimeError):
    """The step could not be captured as a CUDA graph (the message says which op and why)."""


class GraphBackend:
    """What a capture needs from the device, in one place: CUDA's graphs, streams and memory pools.

    ``device_type`` is the type of the device a graph runs on, ``host_type`` the type of the memory a graph cannot
    read again at a replay (None: no such memory). A stand-in (tests) subclasses it to record and replay aten ops
    on the CPU; ``replays_at_capture_end`` is False where its capture already ran the ops (a CUDA capture records
    kernels without running them, so the call is completed by one replay)."""

    device_type = "cuda"
    host_type: str | None = "cpu"
    replays_at_capture_end = True

    def available(self) -> bool:
        """Whether graphs can be captured in this process."""
        return torch.cuda.is_available()

    def new_graph(self) -> Any:
        """An empty graph (``replay()`` runs it)."""
        return torch.cuda.CUDAGraph()

    def new_pool(self) -> Any:
        """A memory pool that several captures can share (torch's ``graph_pool_handle``)."""
        return torch.cuda.graph_pool_handle()

    def capturing(self, graph: Any, pool: Any) -> contextlib.AbstractContextManager[Any]:
        """The context that records the step's kernels into ``graph``, allocating from ``pool``."""
        return torch.cuda.graph(graph, pool=pool)

    def synchronize(self, device: torch.device) -> None:
        """Wait for the device's queued work."""
        torch.cuda.synchronize(device)

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` the current one."""
        return torch.cuda.device(device)

    @contextlib.contextmanager
    def side_stream(self, device: torch.device) -> Iterator[None]:
        """Run the block on a side stream (PyTorch's recipe for the warm-up calls before a capture)."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(device).wait_stream(stream)

    def clear_workspaces(self) -> None:
        """Drop cached per-stream workspaces, so that a capture allocates its own inside its pool."""
        torch_patches.clear_cublas_workspaces()


_backends: list[GraphBackend] = [GraphBackend()]


def backend() -> GraphBackend:
    """The backend captures use now (CUDA's unless a test put a stand-in in its place)."""
    return _backends[-1]


@contextlib.contextmanager
def use_backend(stand_in: GraphBackend) -> Iterator[GraphBackend]:
    """Capture through ``stand_in`` inside the block (tests: a CPU stand-in for CUDA graphs)."""
    _backends.append(stand_in)
    try:
        yield stand_in
    finally:
        _backends.remove(stand_in)


_OWN_FILES = (torch.__file__.rsplit("/", 1)[0], __file__.rsplit("/", 2)[0], contextlib.__file__.rsplit("/", 1)[0])


def user_line(skip: int = 1) -> str:
    """``file:line`` of the innermost caller outside torch, distrib and the standard library (the user's line)."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_OWN_FILES) and not frame.f_code.co_filename.startswith("<"):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "an unknown line"


#: aten ops that read a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``)
HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero")


class HostWorkGuard(torch_patches.TorchDispatchMode):
    """While capturing: refuse the ops whose effect a replay would not repeat (see the module docstring), and
    note every tensor an op reads or writes, so that :meth:`survivors` can name those that outlive the capture.

    ``host_set``: tensors the host fills before each replay (optimizers' rates and betas): a write into one inside
    the step would be the capture's value at every replay."""

    def __init__(self, host_set: Sequence[tuple[torch.Tensor, str]] = ()) -> None:
        super().__init__()
        #: id -> weak reference of each tensor an op was given (the latest, where an id was reused)
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        self._host_set = {id(t): (t, what) for t, what in host_set}
        self._host_type = backend().host_type
        self._device_type = backend().device_type

    def survivors(self) -> list[torch.Tensor]:
        """The tensors the captured ops used that are still alive: what a replay reads and writes outside its
        own memory pool (parameters, optimizer and metric state, inputs), which must live as long as the graph."""
        alive = (ref() for ref in self._seen.values())
        return [t for t in alive if t is not None]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._seen[id(leaf)] = weakref.ref(leaf)
        name = str(func)
        if name.startswith(HOST_READS):
            raise CaptureError(
                f"the step reads a tensor's value on the host at {user_line(2)} (.item(), bool(t), float(t), "
                "an `if` on a tensor): a CUDA graph would replay the value read at capture. Keep the decision "
                "on the device (torch.where) or move it out of the ds.function"
            )
        if name.startswith(("aten._to_copy", "aten.copy_", "aten.to.", "aten._copy_from")):
            self._check_copy(name, args, kwargs)
        schema = torch_patches.op_schema(func)
        for arg, value in zip(schema.arguments, args):
            if arg.alias_info is None or not arg.alias_info.is_write or not isinstance(value, torch.Tensor):
                continue
            if value.device.type == self._host_type:
                raise CaptureError(
                    f"{name} writes a CPU tensor inside the step: a CUDA graph would do it once, at capture, "
                    "and never again. Keep that state on the device (e.g. torch.zeros(..., device='cuda')) "
                    "or update it outside the ds.function"
                )
            if id(value) in self._host_set and self._host_set[id(value)][0] is value:
                raise CaptureError(
                    f"the step writes {self._host_set[id(value)][1]} at {user_line(2)} (an LR scheduler's step() "
                    "inside the ds.function?): a CUDA graph would put the captured value back at every replay "
                    "and the schedule would stop. Call scheduler.step() after the ds.function's call, outside "
                    "it: the rate stays live there"
                )
        return func(*args, **kwargs)

    def _check_copy(self, name: str, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or self._host_type is None:
            return
        if name.startswith("aten.copy_") and len(tensors) >= 2:
            dst, src = tensors[0], tensors[1]
            if src.device.type == self._host_type and dst.device.type == self._device_type and src.numel() > 0:
                raise _host_copy_error(name, src)
            return
        src = tensors[0]
        device = kwargs.get("device")
        if src.device.type == self._host_type and device is not None and torch.device(device).type == self._device_type:
            raise _host_copy_error(name, src)


def _host_copy_error(name: str, src: torch.Tensor) -> CaptureError:
    return CaptureError(
        f"{name} copies a CPU tensor of shape {list(src.shape)} to the GPU inside the step: a CUDA graph would "
        "read its host memory again at every replay, after the CPU tensor is gone. Make it on the device "
        "(torch.full((), value, device='cuda') instead of torch.tensor(value, device='cuda')), or pass it as an "
        "argument of the ds.function (arguments are copied into the graph's buffers at each call)"
    )


def _first_error(error: BaseException) -> BaseException:
    """The error that started a failed capture: an error inside ``torch.cuda.graph`` ends the capture, and ending a
    broken capture raises again ('operation failed due to a previous error during capture'), which hides the
    first error as its ``__context__``."""
    while error.__context__ is not None and error.__context__ is not error:
        error = error.__context__
    return error


def _clone_output(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class CapturedGraph:
    """One CUDA graph of one signature, in one ``.grad`` state of the tracked parameters.

    Made by :meth:`capture`, which also runs the call (a capture records kernels without running them,
    so the graph is replayed once at its end).
    """

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        static_leaves: list[Any],
        inputs: Inputs,
        params: Sequence[torch.Tensor],
        entry_grads: list[torch.Tensor | None],
        exit_grads: list[torch.Tensor | None],
        output: Any,
    ) -> None:
        self._graph = graph
        self._static_leaves = static_leaves
        self._positions = inputs.tensor_positions
        self._static_inputs = [static_leaves[i] for i in inputs.tensor_positions]
        self._params = list(params)
        self._entry = entry_grads
        self._exit = exit_grads
        #: whether the state the capture left matches too: only where it left None where it found None and a
        #: tensor where it found one (a graph that found None writes fresh gradients; one that found them adds)
        self._exit_matches = all((entry is None) == (left is None) for entry, left in zip(entry_grads, exit_grads))
        #: every tensor the capture used that outlived it (see the module docstring: memory kept alive)
        self._keep_alive: list[torch.Tensor] = []
        self._out_leaves, self._out_spec = pytree.tree_flatten(output)
        self._out_is_leaf = self._out_spec.is_leaf()
        #: how many times it was replayed (a graph replaced after a replay or none was captured in vain)
        self.replays = 0

    @classmethod
    def capture(
        cls,
        fn: Callable[..., Any],
        inputs: Inputs,
        device: torch.device,
        params: Sequence[torch.Tensor],
        pool: Any = None,
        host_set: Sequence[tuple[torch.Tensor, str]] = (),
    ) -> tuple[CapturedGraph, Any]:
        """Capture ``fn`` on ``inputs`` (copied into static buffers on ``device``), allocating from ``pool`` (None:
        a private one); returns the graph and this call's result. ``host_set``: the tensors the host fills before
        each replay (see :class:`HostWorkGuard`). Raises :class:`CaptureError` (the step's ``.grad`` state put
        back) when it cannot."""
        graphs = backend()
        static_leaves = list(inputs.leaves)
        for i in inputs.tensor_positions:
            static_leaves[i] = inputs.leaves[i].detach().to(device, copy=True)
        args, kwargs = pytree.tree_unflatten(static_leaves, inputs.spec)
        entry = [p.grad for p in params]
        graphs.synchronize(device)
        graph = graphs.new_graph()
        guard = HostWorkGuard(host_set)
        try:
            with graphs.on_device(device):
                graphs.clear_workspaces()  # the graph's matmuls get a workspace of its own pool
                try:
                    with graphs.capturing(graph, pool):
                        with guard:
                            output = fn(*args, **kwargs)
                finally:
                    graphs.clear_workspaces()  # and no eager matmul shares it afterwards
        except Exception as e:  # noqa: BLE001 - every failure to capture becomes the eager path, with its reason
            for p, g in zip(params, entry):
                p.grad = g
            graphs.synchronize(device)
            cause = _first_error(e)
            if isinstance(cause, CaptureError):
                raise cause from None
            raise CaptureError(f"{type(cause).__name__}: {cause}") from e
        exit_grads = [p.grad for p in params]
        captured = cls(graph, static_leaves, inputs, params, entry, exit_grads, output)
        captured._keep_alive = guard.survivors()
        if graphs.replays_at_capture_end:
            graph.replay()
        return captured, captured._outputs()

    def matches(self) -> bool:
        """Whether every tracked parameter's ``.grad`` is in the state this graph was captured in."""
        grads = list(map(_grad_of, self._params))
        # the common states, checked in C: every .grad as the capture found it, or as it left it
        if all(map(operator.is_, grads, self._entry)) or (
            self._exit_matches and all(map(operator.is_, grads, self._exit))
        ):
            return True
        for grad, entry, left in zip(grads, self._entry, self._exit):
            if grad is None:
                if entry is not None:
                    return False
            elif entry is None or (grad is not entry and grad is not left):
                return False
        return True

    def replay(self, leaves: list[Any]) -> Any:
        """Copy the call's tensor ``leaves`` (an :class:`Inputs`' leaves) into the buffers, replay, put the
        ``.grad`` state back; a copy of the outputs."""
        for static, i in zip(self._static_inputs, self._positions):
            static.copy_(leaves[i], non_blocking=True)
        self._graph.replay()
        self.replays += 1
        if not all(map(operator.is_, map(_grad_of, self._params), self._exit)):
            for p, left in zip(self._params, self._exit):
                if p.grad is not left:
                    p.grad = left
        return self._outputs()

    def _outputs(self) -> Any:
        if self._out_is_leaf:  # the common step returns one tensor: no tree to rebuild (a replay is ~0.3 ms)
            return _clone_output(self._out_leaves[0])
        return pytree.tree_unflatten([_clone_output(v) for v in self._out_leaves], self._out_spec)
