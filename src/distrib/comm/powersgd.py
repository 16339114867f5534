"""PowerSGD: send a low-rank approximation of each gradient matrix, with error feedback.

The algorithm of Vogels et al., *PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization* (NeurIPS 2019), as PyTorch's
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py`` implements it (same
ideas: layer-wise compression, a warm-started power iteration, error feedback, plain
all-reduce for the first ``start_iter`` steps and for tensors not worth compressing),
written against distrib's :class:`~distrib.comm.communicator.Communicator` and with
distrib's SUM semantics. For each gradient matrix ``M_w`` (worker ``w``'s gradient,
viewed as ``shape[0] x rest``) and rank ``r``:

1. error feedback: ``M_w += E_w`` (what earlier steps failed to send);
2. ``P = sum_w M_w Q`` (one all-reduce, together with the uncompressed tensors),
   then ``P`` is orthonormalised;
3. ``Q = sum_w M_w^T P`` (a second all-reduce);
4. the result is ``P Q^T = P P^T sum_w M_w``: the projection of the **sum** over
   workers onto ``r`` directions (PyTorch divides ``Q`` by the world size to get the
   mean; distrib's losses are scaled by the global batch, so it keeps the sum);
5. ``E_w = M_w - P Q^T / W``: summed over workers, the errors are exactly what the
   approximation left out of the sum, and they are added to the next step's gradients.

``Q`` is kept for the next step (warm start), so one power iteration a step tracks
the gradients' leading subspace. ``n x m`` matrices travel as ``(n + m) r`` numbers
instead of ``n m``: the multi-worker tutorial's ``Dense(128)`` weight (128 x 21632, 11 MB) as 173 KB at
rank 2.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch.futures import Future

from distrib.comm.communicator import Communicator
from distrib.comm.hooks import DeferredFuture, GradBucket

__all__ = ["PowerSGD", "PowerSGDHook"]


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD's settings; ``CommunicationOptions(compression=PowerSGD(rank=2, start_iter=10))``.

    PowerSGD (Vogels et al., 2019; PyTorch's ``powerSGD_hook``) sends a rank-``rank`` approximation
    ``P Q^T`` of each gradient matrix instead of the matrix: two small all-reduces instead of one large one,
    and the approximation's error is carried into the next step so that nothing is lost over time. The
    instance holds settings only: :meth:`hook` makes the hook and its state.

    Attributes:
        rank: the rank of each gradient matrix's approximation (1-4 is usual; more is more accurate and costs
            more).
        start_iter: steps of plain all-reduce before compressing (the first steps are the most sensitive to
            inexact gradients; PyTorch suggests about 10 % of training).
        min_compression_rate: a matrix is compressed only if it shrinks at least this much
            (``n m > rate (n + m) rank``); the others, and every tensor of fewer than 2 dimensions, are summed
            exactly.
        error_feedback: carry each step's approximation error into the next (PowerSGD is biased without it:
            turn it off only to study that).
        warm_start: start each step's power iteration from the last step's ``Q``.
        seed: the random start of ``Q`` (the same on every worker).

    Raises:
        ValueError: ``rank`` is not an integer >= 1, ``start_iter`` not an integer >= 0, or
            ``min_compression_rate`` not a number >= 1.

    Example::

        >>> PowerSGD(rank=2, start_iter=10).hook()
        PowerSGDHook(PowerSGD(rank=2, start_iter=10, min_compression_rate=2.0, error_feedback=True, \
warm_start=True, seed=0))
    """

    rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD(rank={self.rank!r}): rank must be an integer >= 1 (1-4 is usual)")
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(
                f"PowerSGD(start_iter={self.start_iter!r}): start_iter must be an integer >= 0, the "
                "number of steps reduced exactly before compression starts"
            )
        if not isinstance(self.min_compression_rate, (int, float)) or not self.min_compression_rate >= 1:
            raise ValueError(
                f"PowerSGD(min_compression_rate={self.min_compression_rate!r}): it must be a number "
                ">= 1 (a matrix is compressed only if it shrinks at least this much)"
            )
        object.__setattr__(self, "min_compression_rate", float(self.min_compression_rate))

    def hook(self) -> PowerSGDHook:
        """A new comm hook with these settings and empty state (one per model being trained).

        Returns:
            A ``PowerSGDHook``: called with a communicator and a gradient bucket, it reduces the bucket
            (exactly for the first ``start_iter`` reductions, compressed after) and keeps each bucket's
            error feedback and ``Q``.
        """
        return PowerSGDHook(self)


@dataclass
class _Matrix:
    """One compressed gradient: where it lies in the bucket and in the P / Q / error memories."""

    offset: int
    rows: int
    cols: int
    rank: int
    p_offset: int
    q_offset: int
    e_offset: int


@dataclass
class _BucketState:
    signature: str
    matrices: list[_Matrix]
    exact: list[tuple[int, int]]  # (offset, numel) of the tensors summed uncompressed
    first: torch.Tensor  # [P of every matrix | the uncompressed tensors]: the first all-reduce
    q: torch.Tensor  # Q^T of every matrix, (rank x cols) each: the second all-reduce, kept for warm start
    error: torch.Tensor | None
    reductions: int = 0  # how many times this bucket was reduced (plain or compressed)
    draws: int = 0  # random starts of Q so far
    has_q: bool = False


class PowerSGDHook:
    """The comm hook of :class:`PowerSGD`: its state (error, ``Q``, step count) lives per bucket index.

    One hook serves one set of buckets (one model's gradients): the state of bucket
    ``i`` is its error feedback and ``Q``. A bucket whose tensors change shape is an
    error. Steps are counted per bucket, one per reduction (a step that accumulates
    gradients over two backward passes reduces twice).

    Example::

        >>> from distrib.comm import LocalCommunicator
        >>> hook = PowerSGD(rank=1, start_iter=0).hook()
        >>> g = torch.outer(torch.arange(1.0, 5.0), torch.ones(6))  # rank 1: PowerSGD sends it exactly
        >>> out = hook(LocalCommunicator(), GradBucket(0, g.flatten().clone(), [g])).wait()
        >>> torch.allclose(out.view(4, 6), g)
        True
    """

    def __init__(self, settings: PowerSGD) -> None:
        self.settings = settings
        self._state: dict[int, _BucketState] = {}

    def __repr__(self) -> str:
        return f"PowerSGDHook({self.settings})"

    def steps(self, index: int) -> int:
        """How many times bucket ``index`` has been reduced (compression starts at ``start_iter``)."""
        state = self._state.get(index)
        return state.reductions if state is not None else 0

    # ------------------------------------------------------------------ layout
    def _layout(self, bucket: GradBucket) -> _BucketState:
        flat = bucket.buffer
        shapes = [tuple(t.shape) for t in bucket.parameters]
        signature = f"{flat.dtype} {flat.device} {shapes}"
        state = self._state.get(bucket.index)
        if state is not None:
            if state.signature != signature:
                raise ValueError(
                    f"PowerSGD: bucket {bucket.index} was {state.signature} and is now {signature}. A PowerSGD hook "
                    "keeps error feedback per bucket of one model: give each model (each optimizer) its own hook "
                    "(PowerSGD(...).hook()), and keep the parameters' shapes fixed"
                )
            return state
        matrices, exact = [], []
        offset = p_size = q_size = e_size = 0
        for shape in shapes:
            numel = 1
            for d in shape:
                numel *= d
            rows = shape[0] if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            rank = min(rows, cols, self.settings.rank)
            if len(shape) >= 2 and rows * cols > self.settings.min_compression_rate * (rows + cols) * rank:
                matrices.append(_Matrix(offset, rows, cols, rank, p_size, q_size, e_size))
                p_size += rows * rank
                q_size += cols * rank
                e_size += numel
            else:
                exact.append((offset, numel))
            offset += numel
        if offset != flat.numel():
            raise ValueError(
                f"PowerSGD: bucket {bucket.index} holds {flat.numel()} numbers but its tensors {shapes} have {offset}"
            )
        exact_size = sum(n for _, n in exact)
        new = _BucketState(
            signature,
            matrices,
            exact,
            first=torch.zeros(p_size + exact_size, dtype=flat.dtype, device=flat.device),
            q=torch.zeros(q_size, dtype=flat.dtype, device=flat.device),
            error=(torch.zeros(e_size, dtype=flat.dtype, device=flat.device) if self.settings.error_feedback else None),
        )
        self._state[bucket.index] = new
        return new

    # ------------------------------------------------------------------ the hook
    def __call__(self, communicator: Communicator, bucket: GradBucket) -> Future[torch.Tensor]:
        state = self._layout(bucket)
        if state.reductions < self.settings.start_iter or not state.matrices:
            state.reductions += 1
            return communicator.all_reduce_async(bucket.buffer)
        flat = bucket.buffer.view(-1)
        workers = communicator.world_size
        with torch.no_grad():
            ms = [flat[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols) for m in state.matrices]
            ps = [state.first[m.p_offset : m.p_offset + m.rows * m.rank].view(m.rows, m.rank) for m in state.matrices]
            qs = [state.q[m.q_offset : m.q_offset + m.rank * m.cols].view(m.rank, m.cols) for m in state.matrices]
            es = (
                [state.error[m.e_offset : m.e_offset + m.rows * m.cols].view(m.rows, m.cols) for m in state.matrices]
                if state.error is not None
                else []
            )
            for m, e in zip(ms, es):
                m.add_(e)
            self._start_q(bucket.index, state, qs)
            for m, p, q in zip(ms, ps, qs):
                torch.mm(m, q.t(), out=p)  # Q is kept transposed (rank x cols): the fast layout for both products
            exact_out = state.first[sum(p.numel() for p in ps) :]
            at = 0
            for offset, numel in state.exact:
                exact_out[at : at + numel].copy_(flat[offset : offset + numel])
                at += numel
        first = communicator.all_reduce_async(state.first)

        def finish() -> torch.Tensor:
            communicator.wait(first)
            with torch.no_grad():
                at = 0
                for offset, numel in state.exact:
                    flat[offset : offset + numel].copy_(exact_out[at : at + numel])
                    at += numel
                for p in ps:
                    _orthonormalize_rows(p.t())
                for m, p, q in zip(ms, ps, qs):
                    torch.mm(p.t(), m, out=q)
            communicator.wait(communicator.all_reduce_async(state.q))
            with torch.no_grad():
                for i, (m, p, q) in enumerate(zip(ms, ps, qs)):
                    if es:  # E_w = M_w - P Q^T / W: what the sum's approximation left out, this worker's share
                        es[i].copy_(m)
                    torch.mm(p, q, out=m)
                    if es:
                        # not addmm(m, p, q, alpha=-1/W, out=e): on CPU that takes 15x longer than these two
                        # passes (18 ms against 1.3 + 1.3 ms for a 128 x 21632 matrix, 1 thread)
                        es[i].sub_(m, alpha=1.0 / workers)
            state.has_q = self.settings.warm_start
            state.reductions += 1
            return bucket.buffer

        return DeferredFuture(finish)

    def _start_q(self, index: int, state: _BucketState, qs: list[torch.Tensor]) -> None:
        """Orthonormalise last step's Q (warm start), or draw a new one; the same on every worker.

        A Q that has lost a direction (a gradient that was exactly 0, so P and then Q
        were 0) is drawn again: a zero Q would stop that matrix from ever being sent.
        """
        if state.has_q and all(_orthonormalize_rows(q) for q in qs):
            return
        state.draws += 1
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.settings.seed} {index} {state.draws}".encode()))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=generator, dtype=q.dtype))
            _orthonormalize_rows(q)


def _orthonormalize_rows(a: torch.Tensor) -> bool:
    """Make the rows of ``a`` (rank x n, in place) orthonormal by modified Gram-Schmidt.

    Returns False if a row had (numerically) no length left; it is then left at 0
    rather than divided by 0 (PyTorch's hook would produce NaN there).
    """
    tiny = torch.finfo(a.dtype).tiny
    full = True
    for i in range(a.shape[0]):
        row = a[i]
        norm = torch.linalg.vector_norm(row)
        if float(norm) <= tiny**0.5:
            row.zero_()
            full = False
        else:
            row.div_(norm)
        if i + 1 < a.shape[0]:
            rest = a[i + 1 :]
            rest.sub_(torch.outer(rest @ row, row))
    return full
