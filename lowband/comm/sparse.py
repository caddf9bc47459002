"""Row-sparse reduce-scatter of an embedding table's gradient (modded-nanogpt PR #221, generalized).

Why it lives in ``lowband.comm``: it is a drop-in replacement for one collective
(``Comm.reduce_scatter`` of a row-owned table gradient), every byte goes through :class:`Comm` and
its ledger, and it knows nothing about optimizers; the sharded optimizer only calls it.

Layout. A table of ``rows`` x ``dim`` is owned in contiguous row ranges: with ``Vp`` = ``rows`` padded
to a multiple of ``N`` and ``R = Vp / N``, rank ``r`` owns rows ``[r*R, (r+1)*R)``; padding rows
(``>= rows``) are always zero. The result on rank ``r`` is its ``R x dim`` slice of the sum (or
average) over ranks of the local dense gradients: exactly what ``Comm.reduce_scatter`` of the padded
gradient gives.

Per step (``N`` ranks, ``U_r`` = unique rows touched on rank ``r``):

1. **Host, before/while forward.** :class:`RowTracker` collects the rows the step's microbatches
   touch straight from the input tokens (token ids, or the table's rows function of them, e.g.
   :func:`lowband.model.bigram.bigram_hash_np` for the hashed bigram table), as a ``np.unique`` union
   over microbatches. Out-of-range token ids are recorded, not raised (see *Bad input*).
2. **Counts (one tiny collective).** :meth:`SparseRowExchange.plan` all-gathers one int64 row per rank:
   ``[count to owner 0 .. count to owner N-1, touched, bad_lo, bad_hi, bad_flag]`` (``N + 4`` values,
   tag ``sparse:<table>:counts``). An all-gather rather than the speedrun's all-to-all of ``N`` counts:
   for ``N x (N + 4) x 8`` bytes (tiny) every rank learns the whole count matrix, so the
   sparse/dense choice and the bad-input verdict are computed from identical numbers on every rank
   and can never diverge. The counts live on the CPU; pass ``count_comm`` (a gloo group) when the
   main ``comm`` is NCCL, so split sizes never come from the GPU (no device-to-host sync).
3. **Choice.** ``mode="auto"`` compares, per table, the largest per-rank sparse cost
   ``sum_{o != r} C[r, o] * (row_bytes + index_bytes) + counts_bytes`` with the dense ring
   reduce-scatter ``(N-1)/N * Vp * dim * wire_bytes`` and takes the cheaper (ties go dense);
   ``"sparse"`` / ``"dense"`` force a path. Same numbers everywhere, so the same choice everywhere.
4. **Sparse exchange.** Two variable-split ``Comm.all_to_all`` calls: the row indices (int32 when
   ``Vp < 2**31``, else int64; tag ``sparse:<table>:index``) and the gathered rows in the wire dtype
   (tag ``sparse:<table>:rows``). Own rows are never sent. On CUDA the host index array is copied
   through pinned memory with a non-blocking copy.
5. **Merge (owner).** An accumulator (fp32, fp64 for fp64; the output itself when it has that dtype)
   is zeroed; in the dense reduce-scatter's summation order (:func:`summation_order`: rank order, or
   around the ring from rank ``r + 1`` where :class:`Comm` runs its ``ring``) it gets ``index_add_`` of
   this rank's own touched rows (rank ``r``) or of the rows received from rank ``s``: one dense pass (the
   zeroing) plus work proportional to the touched rows.
   Indices from one sender are unique, untouched rows are exactly zero on the sender and ``0 + x`` is
   exact, so the sum has the same arithmetic order as the dense reduce-scatter of :class:`Comm`:
   bit-equal to it in float64 and float32 (on NCCL's native reduce-scatter only up to summation order).
   ``op="avg"`` divides by ``N``.

``mode="dense"`` (or an auto choice of dense) runs ``Comm.reduce_scatter`` of the zero-padded gradient
with tag ``sparse:<table>:dense``. The ledger thus shows all of a table's traffic under the tag
prefix ``sparse:<table>``; :attr:`SparseRowExchange.last_stats` holds the step's density and bytes for
the trainer's log line.

Precondition: rows outside the touched set must have exactly zero gradient on this rank, i.e. the
table gets gradient only through lookups of the tracked tokens (not a table tied to an output head,
and no weight decay folded into the gradient). The sharded optimizer's fallback (rows read from the
gradient when no tokens were observed) has no such precondition.

Bad input: each rank sees different tokens, so an out-of-range id may exist on one rank only.
:class:`RowTracker` records the offending range instead of raising; the count all-gather carries it
to every rank, and :meth:`SparseRowExchange.plan` raises the same ``ValueError`` (naming the table,
the allowed range, and each offending rank's id range) on every rank, after the count collective
and before any row or dense collective, so no rank is left hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from lowband.comm.comm import Comm, true_div_
from lowband.comm.ledger import ring_wire_bytes
from lowband.comm.ring import ring_order

MODES = ("auto", "sparse", "dense")
RowsFn = Callable[[np.ndarray, int], np.ndarray]
"""``rows_fn(tokens, rows)``: the table rows an integer array of token ids ``(..., T)`` touches (int64, any
shape); e.g. :func:`lowband.model.bigram.bigram_hash_np`."""
REDUCE_OPS = ("sum", "avg")
_WIRE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def padded_rows(rows: int, world_size: int) -> int:
    """``rows`` rounded up to a multiple of ``world_size`` (the row-owned table height ``Vp``)."""
    return -(-rows // world_size) * world_size


def owner_bounds(rows: int, world_size: int) -> np.ndarray:
    """Row boundaries ``[0, R, 2R, ..., Vp]`` of the contiguous owner ranges (``R = Vp / N``)."""
    per = padded_rows(rows, world_size) // world_size
    return np.arange(world_size + 1, dtype=np.int64) * per


class RowTracker:
    """Host-side set of the table rows a step touches, accumulated over microbatches.

    Args:
        table: the table's name (used in error messages and ledger tags), e.g. ``"bigram"``.
        rows: table height.
        rows_fn: ``None`` (rows are the token ids themselves, an ordinary token embedding) or the function
            that maps token ids to rows (:data:`RowsFn`; a hashed bigram table: ``bigram_hash_np``, which
            hashes along the last dimension). Its rows must lie in ``[0, rows)``.
        vocab_size: valid token ids are ``[0, vocab_size)``; defaults to ``rows`` without ``rows_fn``; with
            one ``None`` means any id (a hash maps every int64 into range).

    Out-of-range ids are recorded (:attr:`bad_range`), never raised here: the error must be raised on
    all ranks alike, which :meth:`SparseRowExchange.plan` does after the count collective.
    """

    def __init__(self, table: str, rows: int, *, rows_fn: RowsFn | None = None, vocab_size: int | None = None) -> None:
        if not isinstance(table, str) or not table:
            raise ValueError(f"RowTracker: table must be a non-empty str, got {table!r}")
        if rows_fn is not None and not callable(rows_fn):
            raise TypeError(f"RowTracker({table!r}): rows_fn must be callable or None, got {type(rows_fn).__name__}")
        self.table = table
        self.rows = _check_int(rows, f"RowTracker({table!r}): rows", 1)
        self.rows_fn = rows_fn
        if vocab_size is None and rows_fn is None:
            vocab_size = self.rows
        self.vocab_size = None if vocab_size is None else _check_int(
            vocab_size, f"RowTracker({table!r}): vocab_size", 1)
        if rows_fn is None and self.vocab_size is not None and self.vocab_size > self.rows:
            raise ValueError(f"RowTracker({table!r}): vocab_size {self.vocab_size} exceeds rows {self.rows}")
        self.reset()

    def reset(self) -> None:
        """Forget the rows of the current step (called by :meth:`take`)."""
        self._parts: list[np.ndarray] = []
        self.bad_range: tuple[int, int] | None = None
        self.microbatches = 0

    def add(self, tokens: np.ndarray | torch.Tensor) -> None:
        """Record the rows touched by one microbatch of token ids (host array or CPU tensor)."""
        if isinstance(tokens, torch.Tensor):
            if tokens.device.type != "cpu":
                raise ValueError(f"RowTracker({self.table!r}).add: tokens must be on the host (CPU); "
                                 f"got device {tokens.device} (pass the loader's host copy, no device sync)")
            tokens = tokens.numpy()
        arr = np.asarray(tokens)
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"RowTracker({self.table!r}).add: tokens must be integers, got dtype {arr.dtype}")
        self.microbatches += 1
        if arr.size == 0:
            return
        lo, hi = int(arr.min()), int(arr.max())
        if self.vocab_size is not None and (lo < 0 or hi >= self.vocab_size):
            flat = arr.reshape(-1).astype(np.int64)
            bad = flat[(flat < 0) | (flat >= self.vocab_size)]
            blo, bhi = int(bad.min()), int(bad.max())
            self.bad_range = (blo, bhi) if self.bad_range is None else (
                min(self.bad_range[0], blo), max(self.bad_range[1], bhi))
            return
        if self.rows_fn is not None:
            idx = np.asarray(self.rows_fn(arr, self.rows), dtype=np.int64)
        else:
            idx = arr.astype(np.int64, copy=False)
        self._parts.append(np.unique(idx))

    def add_rows(self, rows: np.ndarray | Iterable[int]) -> None:
        """Record explicit row indices (already hashed); out-of-range rows are recorded as bad."""
        arr = np.asarray(rows, dtype=np.int64).reshape(-1)
        self.microbatches += 1
        if arr.size == 0:
            return
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.rows:
            bad = arr[(arr < 0) | (arr >= self.rows)]
            blo, bhi = int(bad.min()), int(bad.max())
            self.bad_range = (blo, bhi) if self.bad_range is None else (
                min(self.bad_range[0], blo), max(self.bad_range[1], bhi))
            return
        self._parts.append(np.unique(arr))

    def take(self) -> tuple[np.ndarray, tuple[int, int] | None]:
        """The step's sorted unique rows (int64) and the bad id range (or ``None``); then reset."""
        if not self._parts:
            rows = np.empty(0, dtype=np.int64)
        elif len(self._parts) == 1:
            rows = self._parts[0]
        else:
            rows = np.unique(np.concatenate(self._parts))
        bad = self.bad_range
        self.reset()
        return rows, bad


@dataclass
class SparseStats:
    """One step of one table: what was chosen and what it cost (bytes per rank, ring model)."""

    table: str
    mode: str  # "sparse" or "dense" (what ran)
    touched_rows: int  # unique rows touched on this rank
    density: float  # touched_rows / rows on this rank
    mean_density: float  # mean over ranks
    sparse_bytes: int  # predicted sparse bytes of the costliest rank (rows + indices + counts)
    dense_bytes: int  # dense reduce-scatter bytes per rank
    wire_bytes: int  # bytes this rank actually put on the wire for the table (counts included)

    def as_dict(self) -> dict:
        return asdict(self)


def choose_mode(counts: np.ndarray, *, row_bytes: int, index_bytes: int, counts_bytes: int,
                dense_bytes: int, mode: str = "auto") -> tuple[str, int]:
    """Pick ``"sparse"`` or ``"dense"`` from the global ``N x N`` count matrix.

    ``counts[r, o]`` = rows rank ``r`` touches in owner ``o``'s range. The sparse cost of rank ``r`` is
    ``sum_{o != r} counts[r, o] * (row_bytes + index_bytes) + counts_bytes``; the predicted sparse
    cost is the max over ranks (the slowest rank sets the pace). ``auto`` takes sparse iff it is
    strictly cheaper than ``dense_bytes``.

    Returns:
        (chosen mode, predicted sparse bytes).
    """
    if mode not in MODES:
        raise ValueError(f"sparse mode {mode!r} is not allowed; allowed: {list(MODES)}")
    c = np.asarray(counts, dtype=np.int64)
    off = c.sum(axis=1) - np.diag(c)
    sparse = int(off.max()) * (row_bytes + index_bytes) + counts_bytes if c.size else counts_bytes
    if mode != "auto":
        return mode, sparse
    return ("sparse" if sparse < dense_bytes else "dense"), sparse


class SparsePlan:
    """The agreed plan of one step for one table (result of :meth:`SparseRowExchange.plan`)."""

    def __init__(self, rows: np.ndarray, send_counts: list[int], counts: np.ndarray, mode: str,
                 sparse_bytes: int, dense_bytes: int, counts_bytes: int, touched: np.ndarray) -> None:
        self.rows = rows  # sorted unique rows touched on this rank, int64
        self.send_counts = send_counts  # rows this rank sends to each owner (own entry 0)
        self.counts = counts  # N x N count matrix (own entries included)
        self.mode = mode
        self.sparse_bytes = sparse_bytes
        self.dense_bytes = dense_bytes
        self.counts_bytes = counts_bytes
        self.touched = touched  # unique rows touched per rank, length N


class SparseRowExchange:
    """Row-sparse replacement of ``Comm.reduce_scatter`` for one row-owned table (module docstring).

    Args:
        table: name used in tags (``sparse:<table>:...``) and errors.
        rows: table height ``V`` (the local gradient is ``V x dim``).
        dim: row width.
        comm: the data-parallel :class:`Comm` carrying rows (and the dense fallback).
        count_comm: a CPU-capable (gloo) :class:`Comm` over the same ranks for the count all-gather;
            defaults to ``comm`` (fine on gloo; give a gloo group when ``comm`` is NCCL).
        mode: ``"auto"``, ``"sparse"`` or ``"dense"``.
        wire_dtype: dtype rows travel in (``None``: the gradient's dtype; or fp32/bf16/fp16/fp64).
        index_dtype: ``None`` (int32 when ``Vp < 2**31``, else int64), ``torch.int32`` or ``torch.int64``.
    """

    def __init__(self, table: str, rows: int, dim: int, comm: Comm, *, count_comm: Comm | None = None,
                 mode: str = "auto", wire_dtype: torch.dtype | None = None,
                 index_dtype: torch.dtype | None = None) -> None:
        if not isinstance(table, str) or not table:
            raise ValueError(f"SparseRowExchange: table must be a non-empty str, got {table!r}")
        if mode not in MODES:
            raise ValueError(f"SparseRowExchange({table!r}): mode={mode!r} is not allowed; allowed: {list(MODES)}")
        if wire_dtype is not None and wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"SparseRowExchange({table!r}): wire_dtype={wire_dtype!r} is not allowed; allowed: "
                             "None, torch.float32, torch.float64, torch.bfloat16, torch.float16")
        if index_dtype not in (None, torch.int32, torch.int64):
            raise ValueError(f"SparseRowExchange({table!r}): index_dtype={index_dtype!r} is not allowed; "
                             "allowed: None, torch.int32, torch.int64")
        self.table = table
        self.rows = _check_int(rows, f"SparseRowExchange({table!r}): rows", 1)
        self.dim = _check_int(dim, f"SparseRowExchange({table!r}): dim", 1)
        self.comm = comm
        self.count_comm = count_comm if count_comm is not None else comm
        if self.count_comm.size != comm.size or self.count_comm.rank != comm.rank:
            raise ValueError(f"SparseRowExchange({table!r}): count_comm (rank {self.count_comm.rank} of "
                             f"{self.count_comm.size}) must span the same ranks as comm (rank {comm.rank} "
                             f"of {comm.size})")
        self.mode = mode
        self.wire_dtype = wire_dtype
        n = comm.size
        self.world_size = n
        self.padded_rows = padded_rows(self.rows, n)
        self.rows_per_rank = self.padded_rows // n
        self.bounds = owner_bounds(self.rows, n)
        if index_dtype is None:
            index_dtype = torch.int32 if self.padded_rows < 2**31 else torch.int64
        elif index_dtype == torch.int32 and self.padded_rows > 2**31:
            # row indices up to padded_rows - 1 would wrap in int32 and land on other rows
            raise ValueError(f"SparseRowExchange({table!r}): index_dtype=torch.int32 cannot hold row indices of a "
                             f"table padded to {self.padded_rows} rows (> 2**31); use torch.int64 or None")
        self.index_dtype = index_dtype
        self.last_stats: SparseStats | None = None
        self.tag = f"sparse:{table}"

    # -------------------------------------------------------------------------------- sizes
    def owner_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` owned by ``rank`` (``hi`` may exceed ``rows``: padding)."""
        return int(self.bounds[rank]), int(self.bounds[rank + 1])

    def row_bytes(self, grad_dtype: torch.dtype) -> int:
        wire = self.wire_dtype or grad_dtype
        return self.dim * torch.empty((), dtype=wire).element_size()

    def index_bytes(self) -> int:
        return torch.empty((), dtype=self.index_dtype).element_size()

    def dense_bytes(self, grad_dtype: torch.dtype) -> int:
        """Ring bytes per rank of the dense reduce-scatter of the padded ``Vp x dim`` gradient."""
        return ring_wire_bytes("reduce_scatter", self.world_size, self.padded_rows * self.row_bytes(grad_dtype)) \
            if self.world_size > 1 else 0

    def counts_bytes(self) -> int:
        n = self.world_size
        return ring_wire_bytes("all_gather", n, n * (n + 4) * 8) if n > 1 else 0

    # ----------------------------------------------------------------------------------- plan
    def plan(self, rows: np.ndarray, bad_range: tuple[int, int] | None = None, *,
             grad_dtype: torch.dtype = torch.float32, mode: str | None = None,
             valid_range: tuple[int, int] | None = None) -> SparsePlan:
        """Exchange counts (one all-gather on ``count_comm``), check bad input, choose the path.

        Args:
            rows: sorted unique int64 rows touched on this rank (from :meth:`RowTracker.take`).
            bad_range: ``(lo, hi)`` of out-of-range token ids seen on this rank, or ``None``.
            grad_dtype: dtype of the gradient (for the byte prediction).
            mode: per-call override of the exchanger's mode.
            valid_range: the allowed id range named in the error (default ``[0, rows)``).

        Raises:
            ValueError: on every rank alike, if any rank saw out-of-range ids (after the count
                collective, before any row collective).
        """
        mode = self.mode if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"SparseRowExchange({self.table!r}): mode={mode!r} is not allowed; "
                             f"allowed: {list(MODES)}")
        n, rank = self.world_size, self.comm.rank
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size > 1 and not bool((rows[1:] > rows[:-1]).all()):
            rows = np.unique(rows)
        local_bad = bad_range
        if local_bad is None and rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            bad = rows[(rows < 0) | (rows >= self.rows)]
            local_bad = (int(bad.min()), int(bad.max()))
        if local_bad is None:
            send = np.diff(np.searchsorted(rows, self.bounds)).astype(np.int64)
        else:
            send = np.zeros(n, dtype=np.int64)
        mine = np.zeros(n + 4, dtype=np.int64)
        mine[:n] = send
        mine[n] = rows.size if local_bad is None else 0
        if local_bad is not None:
            mine[n + 1], mine[n + 2], mine[n + 3] = local_bad[0], local_bad[1], 1
        full = torch.empty(n * (n + 4), dtype=torch.int64)
        self.count_comm.all_gather(full, torch.from_numpy(mine), tag=f"{self.tag}:counts")
        table = full.view(n, n + 4).numpy()
        if table[:, n + 3].any():
            lo, hi = valid_range if valid_range is not None else (0, self.rows)
            offenders = "; ".join(f"rank {r}: ids in [{table[r, n + 1]}, {table[r, n + 2]}]"
                                  for r in range(n) if table[r, n + 3])
            raise ValueError(f"sparse table {self.table!r}: token ids out of range [{lo}, {hi}): {offenders}")
        counts = table[:, :n].copy()
        dense = self.dense_bytes(grad_dtype)
        cbytes = self.counts_bytes()
        chosen, sparse_bytes = choose_mode(counts, row_bytes=self.row_bytes(grad_dtype),
                                           index_bytes=self.index_bytes(), counts_bytes=cbytes,
                                           dense_bytes=dense, mode=mode)
        send_counts = [int(x) for x in send]
        send_counts[rank] = 0
        return SparsePlan(rows, send_counts, counts, chosen, sparse_bytes, dense, cbytes,
                          table[:, n].copy())

    # ----------------------------------------------------------------------------- exchange
    def reduce_scatter(self, output: torch.Tensor, grad: torch.Tensor, plan: SparsePlan, op: str = "avg", *,
                       async_op: bool = False) -> _SparseHandle:
        """``output`` (``rows_per_rank x dim``, or flat) = this rank's slice of the reduced gradient.

        Args:
            output: contiguous tensor of ``rows_per_rank * dim`` elements (any float dtype).
            grad: this rank's local dense gradient, ``rows x dim`` (untouched rows must be zero).
            plan: this step's :meth:`plan`.
            op: ``"sum"`` or ``"avg"``.
            async_op: return a handle whose ``wait()`` finishes the merge.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"SparseRowExchange({self.table!r}).reduce_scatter: op {op!r} not in {REDUCE_OPS}")
        if tuple(grad.shape) != (self.rows, self.dim):
            raise ValueError(f"SparseRowExchange({self.table!r}): grad has shape {tuple(grad.shape)}, expected "
                             f"({self.rows}, {self.dim})")
        if output.numel() != self.rows_per_rank * self.dim or not output.is_contiguous():
            raise ValueError(f"SparseRowExchange({self.table!r}): output must be contiguous with "
                             f"{self.rows_per_rank} x {self.dim} elements, got {tuple(output.shape)}")
        n, rank = self.world_size, self.comm.rank
        ledger = self.comm.ledger
        n_before = len(ledger.records)
        wire = self.wire_dtype or grad.dtype
        lo, hi = self.owner_range(rank)
        if plan.mode == "dense":
            padded = grad if self.padded_rows == self.rows else torch.cat(
                [grad, grad.new_zeros(self.padded_rows - self.rows, self.dim)])
            h = self.comm.reduce_scatter(output.view(-1), padded.contiguous().view(-1), op=op,
                                         wire_dtype=self.wire_dtype, async_op=True, tag=f"{self.tag}:dense")
            self._record_stats(plan, grad.dtype, n_before)
            dense_handle = _SparseHandle(h.wait, output, time.perf_counter())
            if not async_op:
                dense_handle.wait()
            return dense_handle
        device = grad.device
        # indices to send: this rank's touched rows outside its own range (sorted, grouped by owner)
        own_lo, own_hi = np.searchsorted(plan.rows, [lo, hi])
        send_rows_np = np.concatenate([plan.rows[:own_lo], plan.rows[own_hi:]])
        idx_np = send_rows_np.astype(np.int32 if self.index_dtype == torch.int32 else np.int64)
        send_idx_host = torch.from_numpy(idx_np)
        if device.type == "cuda":
            send_idx = send_idx_host.pin_memory().to(device, non_blocking=True)
        else:
            send_idx = send_idx_host
        recv_counts = [int(plan.counts[s, rank]) if s != rank else 0 for s in range(n)]
        n_recv = sum(recv_counts)
        recv_idx = torch.empty(n_recv, dtype=self.index_dtype, device=device)
        h_idx = self.comm.all_to_all(recv_idx, send_idx, recv_counts, plan.send_counts, async_op=True,
                                     tag=f"{self.tag}:index")
        send_vals = grad.index_select(0, send_idx.to(torch.int64)) if send_idx.numel() else \
            grad.new_empty(0, self.dim)
        if wire != grad.dtype:
            send_vals = send_vals.to(wire)
        recv_vals = torch.empty(n_recv, self.dim, dtype=wire, device=device)
        h_val = self.comm.all_to_all(recv_vals, send_vals.contiguous(), recv_counts, plan.send_counts,
                                     async_op=True, tag=f"{self.tag}:rows")
        acc_dtype = _acc_dtype(output.dtype)
        order = summation_order(self.comm, grad, output, self.wire_dtype)
        own_rows = torch.from_numpy(plan.rows[own_lo:own_hi])
        if device.type == "cuda":
            own_rows = own_rows.pin_memory().to(device, non_blocking=True)

        def finish() -> None:
            h_idx.wait()
            h_val.wait()
            out2d = output.view(self.rows_per_rank, self.dim)
            acc = out2d.zero_() if output.dtype == acc_dtype else torch.zeros(
                self.rows_per_rank, self.dim, dtype=acc_dtype, device=device)
            offsets = np.concatenate([[0], np.cumsum(recv_counts)])
            for s in order:
                if s == rank:  # own touched rows (the rest of the own slice is zero)
                    if own_rows.numel():
                        own = grad.index_select(0, own_rows)
                        if wire != grad.dtype:
                            own = own.to(wire)
                        acc.index_add_(0, own_rows - lo, own.to(acc_dtype))
                    continue
                k, off = recv_counts[s], int(offsets[s])
                if k:
                    local = recv_idx[off:off + k].to(torch.int64) - lo
                    acc.index_add_(0, local, recv_vals[off:off + k].to(acc_dtype))
            if op == "avg" and n > 1:
                true_div_(acc, n)
            if acc is not out2d:
                out2d.copy_(acc)

        handle = _SparseHandle(finish, output, time.perf_counter())
        self._record_stats(plan, grad.dtype, n_before)
        if not async_op:
            handle.wait()
        return handle

    def _record_stats(self, plan: SparsePlan, grad_dtype: torch.dtype, n_before: int) -> None:
        recs = self.comm.ledger.records[n_before:]
        wire = sum(r.wire_bytes for r in recs if r.tag.startswith(self.tag)) + plan.counts_bytes
        touched = int(plan.rows.size)
        self.last_stats = SparseStats(
            table=self.table, mode=plan.mode, touched_rows=touched, density=touched / self.rows,
            mean_density=float(plan.touched.mean()) / self.rows, sparse_bytes=plan.sparse_bytes,
            dense_bytes=plan.dense_bytes, wire_bytes=int(wire))


class _SparseHandle:
    """Completion handle of a sparse exchange: ``wait()`` waits both all-to-alls and merges."""

    def __init__(self, finish, result: torch.Tensor, t0: float) -> None:
        self._finish = finish
        self._result = result
        self._done = False
        self.t0 = t0

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._finish()
            self._done = True
        return self._result


def summation_order(comm: Comm, grad: torch.Tensor, output: torch.Tensor,
                    wire_dtype: torch.dtype | None) -> list[int]:
    """The ranks in the order :meth:`Comm.reduce_scatter` of this table's padded gradient adds them up on
    this rank: around the ring from the next rank for its ``ring`` algorithm, else rank order."""
    if comm.reduce_scatter_algorithm(grad, output, wire_dtype) == "ring":
        return ring_order(comm.rank, comm.size)
    return list(range(comm.size))


def dense_reference(grads: list[torch.Tensor], rows_per_rank: int, rank: int, op: str = "avg",
                    wire_dtype: torch.dtype | None = None, ring: bool = False) -> torch.Tensor:
    """Single-process reference: rank ``rank``'s slice of the sum of all ranks' padded gradients,
    accumulated in fp32 (fp64 for fp64), as ``Comm.reduce_scatter`` computes it: in rank order (its
    all-to-all and ``p2p`` algorithms) or, with ``ring``, from rank ``rank + 1`` around to ``rank`` (its
    ``ring`` algorithm)."""
    dim = grads[0].shape[1]
    lo = rank * rows_per_rank
    acc_dtype = _acc_dtype(grads[0].dtype)
    acc = torch.zeros(rows_per_rank, dim, dtype=acc_dtype)
    order = ring_order(rank, len(grads)) if ring else range(len(grads))
    for g in (grads[i] for i in order):
        part = g[lo:lo + rows_per_rank]
        if wire_dtype is not None:
            part = part.to(wire_dtype)
        acc[:part.shape[0]].add_(part.to(acc_dtype))
    if op == "avg" and len(grads) > 1:
        true_div_(acc, len(grads))
    return acc
