"""A CPU stand-in for CUDA graphs, so that ``ds.function``'s capture, guards and replay run without a GPU.

:class:`StandInBackend` takes the place of :class:`distrib.graphs.cuda_graph.GraphBackend` (``use_backend``): a
"capture" runs the step once under a dispatch mode that records every aten op with its very tensor arguments
(parameters, state, the step's own intermediates), and ``replay()`` runs that op list again on the same tensor
objects, writing each op's result into the tensor the capture got. That is a CUDA graph's semantics: fixed
memory, the host's Python values (a float rate, a ``fill_`` value, an ``.item()`` read) baked in as they were at
capture, random ops drawing anew at each replay. torch's Adam refuses ``capturable=True`` on the CPU; the fixture
lets it (the stand-in plays a device), so that ``ds.function`` makes optimizers capturable as it does on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from distrib.graphs.cuda_graph import GraphBackend, use_backend


class RecordedGraph:
    """The aten ops of one capture, replayed on the same tensors."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[Any]]] = []

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, outputs in self.ops:
                result = func(*args, **kwargs)
                for recorded, new in zip(outputs, pytree.tree_leaves(result)):
                    if isinstance(recorded, torch.Tensor) and recorded is not new:
                        recorded.copy_(new)  # the graph's fixed address for this output


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        returns = func._schema.returns
        # outputs that alias an input (views, in-place results) are that input's memory already: nothing to copy
        leaves = pytree.tree_leaves(result)
        aliased = len(returns) == len(leaves) and [r.alias_info is not None for r in returns]
        outputs = [None if aliased and aliased[i] else leaf for i, leaf in enumerate(leaves)]
        self.graph.ops.append((func, args, kwargs, outputs))
        return result


class StandInBackend(GraphBackend):
    """CUDA graphs played on the CPU (the module docstring); ``pools`` lists the pool each capture was given."""

    device_type = "cpu"
    host_type = None  # every tensor is "device" memory here
    replays_at_capture_end = False  # the recording capture ran the step already

    def __init__(self) -> None:
        self.pools: list[Any] = []
        self.graphs: list[RecordedGraph] = []

    def available(self) -> bool:
        return True

    def new_graph(self) -> RecordedGraph:
        graph = RecordedGraph()
        self.graphs.append(graph)
        return graph

    def new_pool(self) -> Any:
        return object()

    @contextlib.contextmanager
    def capturing(self, graph: Any, pool: Any) -> Iterator[None]:
        self.pools.append(pool)
        with _Recorder(graph):
            yield

    def synchronize(self, device: torch.device) -> None:
        return None

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def side_stream(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:  # type: ignore[override]
        return contextlib.nullcontext()

    def clear_workspaces(self) -> None:
        return None


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInBackend]:
    """Capture through the CPU stand-in for the test (torch's Adam family allowed ``capturable=True`` on the CPU)."""
    adam = importlib.import_module("torch.optim.adam")  # torch.optim deletes its submodules' names
    supported = adam._get_capturable_supported_devices
    monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda *a, **k: [*supported(*a, **k), "cpu"])
    with use_backend(StandInBackend()) as backend:
        yield backend  # type: ignore[misc]
