"""Which exception is a collective's failure, and which one the user's code raised.

:meth:`~distrib.comm.communicator.Communicator.guarded` runs code that mixes the two: a sharded
step's forward and backward run the user's model, and FSDP's all-gathers and reduce-scatters (or
DTensor's redistributions) run inside it, from torch's hooks. gloo reports a closed connection or a
timeout as a plain ``RuntimeError``, as torch reports a shape mistake, so neither the type nor the
message tells them apart. Where the exception came from does: a collective's failure surfaces in the
frame of torch's that issued the collective or waited for it, out of torch's C++ side (the call into
the process group, a work's ``wait``); a user's mistake surfaces in the user's frame, or in torch's
code that ran the user's operation (``nn.Linear``, DTensor's dispatch of a ``view``), or as a check
that torch's Python code raised itself (a ``raise`` statement: an argument refused).

:func:`is_collective_failure` applies that rule to the innermost frames of the traceback, after
skipping torch's pass-through frames (an operator's ``__call__``, a decorator's wrapper). torch's own
distributed errors (``torch.distributed.DistError`` and its subclasses: a backend's, the network's,
the store's) are collective failures wherever they come from.
"""

from __future__ import annotations

import types

from distrib.comm.communicator import CollectiveError

__all__ = ["COLLECTIVE_SITES", "PASS_THROUGH", "add_note", "is_collective_failure", "raised_at"]

#: torch's modules whose frames issue collectives or wait for them (paths under torch's package); with distrib's
#: own process-group communicator
COLLECTIVE_SITES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/c10d_logger.py",
    "torch/distributed/_functional_collectives.py",
    "torch/distributed/_functional_collectives_impl.py",
    "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
    "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py",
    "torch/distributed/tensor/_collective_utils.py",
    "torch/distributed/tensor/_redistribute.py",
    "distrib/comm/process_group.py",
)

#: torch's frames that only pass a call on (an operator overload's ``__call__``, a context-manager decorator, the
#: compiler's disabling wrapper, a pytree map, a future's wait): the frame below them decides
PASS_THROUGH = (
    "torch/_ops.py",
    "torch/utils/_contextlib.py",
    "torch/_dynamo/eval_frame.py",
    "torch/_compile.py",
    "torch/utils/_pytree.py",
    "torch/futures/__init__.py",
)

_RAISE_OPCODE = 130  # dis.opmap["RAISE_VARARGS"], stable since Python 3.0; checked by the tests


def _normalised(path: str) -> str:
    return path.replace("\\", "/")


def raised_at(error: BaseException) -> types.TracebackType | None:
    """The traceback entry of the innermost frame that is not one of :data:`PASS_THROUGH` (None: no traceback)."""
    entries = []
    tb = error.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    for entry in reversed(entries):
        if not _normalised(entry.tb_frame.f_code.co_filename).endswith(PASS_THROUGH):
            return entry
    return entries[-1] if entries else None


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure (a timeout, a closed connection, a broken group), not an error
    of the code that ran around the collectives.

    Args:
        error: an exception caught from code that runs the user's model and torch's collectives.

    Returns:
        True for torch's distributed errors, and for an error that a collective's frame received from torch's
        C++ side; False for everything else (the user's error, torch's checks of the user's code).
    """
    if isinstance(error, CollectiveError):
        return True  # distrib's own verdict on a collective
    import torch.distributed as dist  # here: importing distrib does not import torch.distributed

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    if not isinstance(error, RuntimeError):
        return False  # gloo and NCCL fail with RuntimeError; a ValueError, KeyError, ... is the code's own
    entry = raised_at(error)
    if entry is None or not _normalised(entry.tb_frame.f_code.co_filename).endswith(COLLECTIVE_SITES):
        return False
    code = entry.tb_frame.f_code.co_code
    return not (0 <= entry.tb_lasti < len(code) and code[entry.tb_lasti] == _RAISE_OPCODE)


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` under ``error``'s message in its traceback (Python 3.11's ``add_note``; nothing on 3.10)."""
    adder = getattr(error, "add_note", None)
    if adder is not None and note not in getattr(error, "__notes__", ()):
        adder(note)
