"""Generalized tensor parallelism (GTP): weights sharded over a group, gathered just in time.

Layers: :class:`GTPLinear` (``nn.Linear``), :class:`GTPEmbedding` (plain ``nn.Embedding``, no backward
gather); :func:`shard_linears` / :func:`shard_embeddings` convert a model in place; one
:class:`GTPRuntime` per model holds the chain, the buffer pool and the reduce-scatter FIFO.

State layout (per rank, GTP group of N ranks):

* each opted-in weight ``W [out, in]`` is tail-padded on dim 0 to ``padded_out`` (a multiple of
  ``align * N``; ``align`` = fp8 block rows for fp8 gathers, else 1) and cut into N equal shards of
  ``shard_rows = padded_out / N`` rows; rank ``r`` holds rows ``[r * shard_rows, (r+1) * shard_rows)``
  as an ordinary ``nn.Parameter`` (so any elementwise optimizer runs on it). Pad rows are structural
  zeros forever: their gradient is zero, so weights and optimizer state there stay exactly zero;
* the shard's gradient is accumulated into ``param.grad`` (shard-sized) by the deferred finalize;
* small parameters (biases, norms) are plain replicated parameters; their grads are all-reduced over
  the GTP group (``avg`` in mean mode, ``sum`` in sum mode) by :func:`reduce_grads`.

Communication pattern per microbatch, all through ``Comm`` on the GTP group (ledger tags in quotes):

* forward, consume of ``W_i``: wait for its prefetched all-gather (or gather synchronously: chain
  head, first step, extra consumes), then issue the async all-gather of ``W_{i+1}`` ("gtp:ag:fwd"),
  then the GEMM. Nothing of full weight shape is saved for backward: only ``x`` and the shard;
* backward, at ``W_i``: re-gather (prefetched by ``W_{i+1}``'s backward, else sync), issue the async
  all-gather of ``W_{i-1}`` ("gtp:ag:bwd"), dgrad, full wgrad into a pooled scratch buffer, pre-scale
  by ``1/N`` (mean mode), async reduce-scatter ("gtp:rs") into a pooled shard-sized output. The
  reduce-scatter is pushed on a FIFO; while the FIFO is longer than ``finalize_depth`` the oldest is
  waited and added into its shard's ``.grad``. The chain head (last in backward) reduces
  synchronously. A layer whose input needs no gradient skips its backward gather (then ``L-1``
  backward gathers);
* the FIFO is drained by a callback queued on the autograd engine at the end of every backward, and
  by :meth:`GTPRuntime.finalize_all`, so nothing is pending when ``backward()`` returns and any
  data-parallel reduction starts after every shard grad is complete.

The chain is the order of first consumes in the first forward (recorded, not configured); it freezes
at the end of the first backward, after which prefetch is on. The first step is fully synchronous.
A weight consumed more than once in one forward (tied or repeated layer) gets its later consumes as
*extra* consumes: on-demand synchronous gathers in both directions, each with its own reduce-scatter;
all of them add into the same ``.grad``, so the gradient is correct. A forward pass ends when its
backward ends (or at :meth:`GTPRuntime.end_pass`); a second forward before the first's backward is
correct but unprefetched (every consume is an extra). Forwards under ``torch.no_grad`` gather on
demand and touch no chain state.

Gathers may travel quantized (``gather_format``): ``bf16``, or ``fp8`` e4m3 with per-block fp32
scales whose blocks never straddle a shard (see :mod:`lowband.parallel.gtp_quant`); the shard is
quantized at every gather, or once per optimizer step with ``cache_wire_shard``. Gradients stay
in the parameter dtype on the wire (or ``grad_wire_dtype=torch.bfloat16``).

Buffers come from :class:`~lowband.parallel.gtp_cache.GTPBufferCache` keyed by
``(shape, dtype, direction, parity)`` (direction: ``fwd`` / ``bwd`` for fp8 gathers, one shared
``fwd|bwd`` pool for native and bf16 gathers, as Megatron keys direction only for quantized
layouts; ``wgrad`` and ``rs`` for gradient scratch); see there for the stable-address argument.
Documented bound of live unsharded bytes (gathered weights, dequantized copies, wgrad scratch),
``G`` = the largest
gathered weight (wire buffer + dequantized copy when quantized), ``R`` = the largest padded wgrad:
forward ``<= 2 G`` (current + prefetched), backward ``<= 2 G + (finalize_depth + 1) R``. Not counted:
the ``Comm`` reduce-scatter's own receive buffer on gloo (one padded wgrad per in-flight reduce-scatter).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm, CommHandle
from lowband.parallel.gtp_cache import GTPBufferCache
from lowband.parallel.gtp_quant import (
    BlockSpec,
    check_block_rule,
    check_format,
    fp8_pack,
    fp8_packet_bytes,
    fp8_unpack_gathered,
    row_alignment,
)
from lowband.parallel.init_sync import check_module_state, sync_module_state
from lowband.plan import ModelPlan, tied_names

GRAD_MODES = ("mean", "sum")
TIED_POLICIES = ("replicate", "error")


class GTPCollectiveError(RuntimeError):
    """A GTP weight gather failed, typically because not every rank of the GTP group ran the forward."""


class GTPStateError(RuntimeError):
    """``state_dict()`` / ``load_state_dict()`` of a GTP module outside :meth:`GTPRuntime.local_state`.

    A GTP parameter is one rank's row shard stored under the logical weight's name, so a plain state
    dict would label ``1/N`` of a weight as the whole (torch DCP would write rank 0's shard as the
    replicated tensor). Use :class:`lowband.parallel.gtp_state.GTPStateLayout` (gathered, reshardable,
    works with ``torch.distributed.checkpoint``) or :func:`lowband.parallel.unsharded_copy`.
    """


@dataclass
class GTPOptions:
    """Knobs of a :class:`GTPRuntime`.

    Attributes:
        gather_format: ``native`` (parameter dtype), ``bf16`` or ``fp8``.
        fp8_block: fp8 scaling block (rows x cols); shards are padded to a multiple of ``rows``.
        prefetch: issue the next weight's gather before the current GEMM (from the second step on).
        async_reduction: reduce-scatter asynchronously with a deferred finalize.
        finalize_depth: reduce-scatters left in flight before the oldest is finalized (>= 0).
        grad_mode: ``mean`` (pre-scale wgrad by 1/N, replicated grads averaged) or ``sum``.
        grad_wire_dtype: wire dtype of the reduce-scatter (``None``: the parameter dtype, or bf16).
        record_events: keep an event log (issue/ready/GEMM order) in :attr:`GTPRuntime.events`.
        cache_wire_shard: for ``bf16``/``fp8``, keep each shard's quantized copy until the parameter
            changes (quantize once per optimizer step instead of at every gather; costs 1/2 resp.
            ~1/4 of the shard bytes per weight, held all step). Default off: re-quantize per gather,
            as FSDP2's mixed-precision cast does.
    """

    gather_format: str = "native"
    fp8_block: BlockSpec = field(default_factory=BlockSpec)
    prefetch: bool = True
    async_reduction: bool = True
    finalize_depth: int = 2
    grad_mode: str = "mean"
    grad_wire_dtype: torch.dtype | None = None
    record_events: bool = False
    cache_wire_shard: bool = False

    def __post_init__(self) -> None:
        check_format(self.gather_format)
        if not isinstance(self.fp8_block, BlockSpec):
            if (isinstance(self.fp8_block, (tuple, list)) and len(self.fp8_block) == 2):
                self.fp8_block = BlockSpec(*self.fp8_block)
            else:
                raise TypeError(f"GTPOptions.fp8_block must be a BlockSpec or (rows, cols), got "
                                f"{self.fp8_block!r}")
        for name in ("prefetch", "async_reduction", "record_events", "cache_wire_shard"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GTPOptions.{name} must be a bool, got {getattr(self, name)!r}")
        d = self.finalize_depth
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"GTPOptions.finalize_depth must be an int >= 0, got {d!r}")
        if self.grad_mode not in GRAD_MODES:
            raise ValueError(f"GTPOptions.grad_mode {self.grad_mode!r} not in {GRAD_MODES}")
        if self.grad_wire_dtype not in (None, torch.float32, torch.float64, torch.bfloat16):
            raise ValueError(f"GTPOptions.grad_wire_dtype {self.grad_wire_dtype} not in "
                             "(None, torch.float32, torch.float64, torch.bfloat16)")


class GTPWeight:
    """Metadata and per-step state of one sharded weight (the shard itself is :attr:`param`)."""

    def __init__(self, runtime: GTPRuntime, uid: int, name: str, param: nn.Parameter,
                 out_features: int, in_features: int, padded_out: int) -> None:
        self.runtime = runtime
        self.uid = uid
        self.name = name
        self.param = param
        self.out_features = out_features
        self.in_features = in_features
        self.padded_out = padded_out
        self.shard_rows = padded_out // runtime.size
        self.index: int | None = None  # position in the forward chain
        self.fwd_pending: _Gather | None = None
        self.bwd_pending: _Gather | None = None
        self.needs_bwd_gather = True
        self._wire_key: tuple[int, int] | None = None
        self._wire_src: torch.Tensor | None = None

    @property
    def pad(self) -> int:
        return self.padded_out - self.out_features

    @property
    def shard_slice(self) -> slice:
        """Rows of the padded full weight this rank holds."""
        r = self.runtime.rank
        return slice(r * self.shard_rows, (r + 1) * self.shard_rows)

    def __repr__(self) -> str:
        return (f"GTPWeight({self.name!r}, out={self.out_features}, in={self.in_features}, "
                f"padded_out={self.padded_out}, shard_rows={self.shard_rows}, index={self.index})")


@dataclass
class _Gather:
    gw: GTPWeight
    direction: str
    consume: Hashable
    ticket: Hashable
    parity: int
    buf: torch.Tensor
    handle: CommHandle


@dataclass
class _PendingRS:
    gw: GTPWeight
    handle: CommHandle
    wbuf: torch.Tensor
    out: torch.Tensor


class GTPRuntime:
    """Shared state of all GTP weights of one model on one GTP group: chain, cache, FIFO, log.

    Args:
        comm: the GTP group (e.g. ``build_mesh(...).gtp``).
        options: :class:`GTPOptions` (keyword overrides are also accepted).
    """

    def __init__(self, comm: Comm, options: GTPOptions | None = None, **overrides) -> None:
        if options is None:
            options = GTPOptions(**overrides)
        elif overrides:
            raise TypeError("GTPRuntime: pass either options or keyword overrides, not both")
        self.comm = comm
        self.options = options
        self.size = comm.size
        self.rank = comm.rank
        self.weights: list[GTPWeight] = []
        self.order: list[GTPWeight] = []
        self.frozen = False
        self.cache = GTPBufferCache()
        self.events: list[tuple] = []
        self._fifo: deque[_PendingRS] = deque()
        self._fwd_seen: set[int] = set()
        self._bwd_done: set[int] = set()
        self._extra: dict[tuple[int, str], int] = {}
        self._callback_queued = False
        self._post_drain_hooks: list[Callable[[], None]] = []
        self.passes = 0
        self._local_state_depth = 0

    @contextlib.contextmanager
    def local_state(self) -> Iterator[None]:
        """Allow ``state_dict()`` / ``load_state_dict()`` of this runtime's GTP modules to see the raw
        per-rank shards (padded, this rank's rows) while the context is open. For state layouts that
        gather or slice the shards themselves (:class:`~lowband.parallel.gtp_state.GTPStateLayout`);
        outside it those calls raise :class:`GTPStateError` on a multi-rank group."""
        self._local_state_depth += 1
        try:
            yield
        finally:
            self._local_state_depth -= 1

    def check_state_access(self, module: nn.Module, what: str) -> None:
        """Raise :class:`GTPStateError` for a plain ``state_dict``/``load_state_dict`` of a sharded module."""
        if self.size > 1 and not self._local_state_depth:
            raise GTPStateError(
                f"{what} of a GTP module ({type(module).__name__} {getattr(module.gtp, 'name', '')!r}) would "
                f"label this rank's 1/{self.size} row shard as the whole weight (a mislabeled checkpoint, "
                "e.g. with torch.distributed.checkpoint's get_state_dict); use "
                "lowband.parallel.gtp_state.GTPStateLayout(model, optimizer) for checkpoints (DCP-ready, "
                "reshards across GTP sizes) or lowband.parallel.unsharded_copy(model) for a plain model")

    # ------------------------------------------------------------------------------ registration
    def register(self, full_weight: torch.Tensor, name: str) -> GTPWeight:
        """Shard ``full_weight [out, in]`` (same value on every rank) and return its :class:`GTPWeight`.

        No collective. Raises ``ValueError`` if the shape breaks the fp8 block rule.
        """
        if full_weight.dim() != 2:
            raise ValueError(f"GTP weight {name!r}: expected a 2-D [out, in] weight, got shape "
                             f"{tuple(full_weight.shape)}")
        out, inp = full_weight.shape
        opts = self.options
        check_block_rule(opts.gather_format, opts.fp8_block, inp, f"GTP weight {name!r}")
        align = row_alignment(opts.gather_format, opts.fp8_block) * self.size
        padded_out = -(-out // align) * align
        shard_rows = padded_out // self.size
        shard = torch.zeros(shard_rows, inp, dtype=full_weight.dtype, device=full_weight.device)
        lo = self.rank * shard_rows
        hi = min(lo + shard_rows, out)
        if hi > lo:
            shard[: hi - lo].copy_(full_weight.detach()[lo:hi])
        param = nn.Parameter(shard, requires_grad=full_weight.requires_grad)
        gw = GTPWeight(self, len(self.weights), name, param, out, inp, padded_out)
        param.gtp = gw  # marks the parameter as a GTP shard
        self.weights.append(gw)
        return gw

    def sharded_params(self) -> list[nn.Parameter]:
        return [gw.param for gw in self.weights]

    # ------------------------------------------------------------------------------ events / hooks
    def _log(self, event: str, direction: str, gw: GTPWeight, *extra: object) -> None:
        if self.options.record_events:
            self.events.append((event, direction, gw.index if gw.index is not None else -1, gw.uid,
                                *extra))

    def register_post_drain_hook(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the end of every backward, after every shard grad has been finalized."""
        self._post_drain_hooks.append(fn)

    # ------------------------------------------------------------------------------ gathers
    def _wire_source(self, gw: GTPWeight) -> torch.Tensor:
        fmt = self.options.gather_format
        p = gw.param.detach()
        if fmt == "native":
            return p
        key = (gw.param._version, p.data_ptr())
        if gw._wire_key == key and gw._wire_src is not None:
            return gw._wire_src
        src = p.to(torch.bfloat16) if fmt == "bf16" else fp8_pack(p, self.options.fp8_block)
        if self.options.cache_wire_shard:
            gw._wire_src, gw._wire_key = src, key
        return src

    def _key_direction(self, direction: str) -> str:
        """Direction part of a gather buffer's cache key.

        As in Megatron's ``GTPWeightCache``, forward and backward buffers get separate keys only for the
        quantized format (``fp8``); unquantized gathers (``native``, ``bf16``) have the same layout in
        both directions and are never live across the forward/backward boundary, so they share one
        pool (``"fwd|bwd"``), which halves the persistent gather buffers. ``eval`` gathers (no-grad
        forwards) always have their own key.
        """
        if direction == "eval" or self.options.gather_format == "fp8":
            return direction
        return "fwd|bwd"

    def _issue_gather(self, gw: GTPWeight, direction: str, consume: Hashable, async_op: bool) -> _Gather:
        fmt = self.options.gather_format
        p = gw.param
        main = consume == "main" and gw.index is not None
        parity = gw.index % 2 if main else 2
        ticket = (gw.uid, direction, consume)
        src = self._wire_source(gw)
        if fmt == "native":
            shape, dtype = (gw.padded_out, gw.in_features), p.dtype
        elif fmt == "bf16":
            shape, dtype = (gw.padded_out, gw.in_features), torch.bfloat16
        else:
            per = fp8_packet_bytes(gw.shard_rows, gw.in_features, self.options.fp8_block)
            shape, dtype = (self.size * per,), torch.uint8
        buf = self.cache.get(ticket, shape, dtype, self._key_direction(direction), parity, p.device, "gather")
        self._log("ag_issue", direction, gw, async_op)
        try:
            handle = self.comm.all_gather(buf, src, async_op=async_op, tag=f"gtp:ag:{direction}")
        except RuntimeError as e:
            raise GTPCollectiveError(self._collective_message(gw, direction, e)) from e
        return _Gather(gw, direction, consume, ticket, parity, buf, handle)

    def _collective_message(self, gw: GTPWeight, direction: str, err: BaseException) -> str:
        return (f"GTP: the all-gather of weight {gw.name!r} ({direction}) over group {self.comm.name!r} "
                f"(size {self.size}) failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}. "
                "Every rank of the GTP group must run every forward and backward of a GTP model together; "
                "a forward on a subset of ranks (e.g. evaluation on rank 0 only) cannot gather sharded "
                "weights. Evaluate on every rank, or build a plain model with "
                "lowband.parallel.unsharded_copy(model) (called on every rank) and evaluate that alone")

    def _complete(self, g: _Gather) -> tuple[torch.Tensor, Callable[[], None]]:
        """Wait for a gather; return the logical ``[out, in]`` weight and its release function."""
        gw = g.gw
        try:
            g.handle.wait()
        except RuntimeError as e:
            raise GTPCollectiveError(self._collective_message(gw, g.direction, e)) from e
        self._log("ag_ready", g.direction, gw)
        fmt = self.options.gather_format
        if fmt == "native":
            buf = g.buf
        else:
            buf = self.cache.get((*g.ticket, "deq"), (gw.padded_out, gw.in_features), gw.param.dtype,
                                 self._key_direction(g.direction), g.parity, gw.param.device, "gather")
            if fmt == "bf16":
                buf.copy_(g.buf)
            else:
                fp8_unpack_gathered(g.buf, self.size, gw.shard_rows, gw.in_features,
                                    self.options.fp8_block, out=buf)
            self.cache.release(g.buf)
        return buf[: gw.out_features], lambda: self.cache.release(buf)

    def _drop_pending(self, gw: GTPWeight) -> None:
        for attr in ("fwd_pending", "bwd_pending"):
            g = getattr(gw, attr)
            if g is not None:
                g.handle.wait()
                self.cache.release(g.buf)
                setattr(gw, attr, None)

    def gather_for_inference(self, gw: GTPWeight) -> tuple[torch.Tensor, Callable[[], None]]:
        """On-demand synchronous gather outside the chain (``torch.no_grad`` forwards)."""
        return self._complete(self._issue_gather(gw, "eval", "eval", async_op=False))

    def full_weight(self, gw: GTPWeight) -> torch.Tensor:
        """The logical (unpadded) full weight in the parameter dtype (a collective; tag "gtp:state")."""
        p = gw.param.detach()
        out = torch.empty(gw.padded_out, gw.in_features, dtype=p.dtype, device=p.device)
        self.comm.all_gather(out, p.contiguous(), tag="gtp:state")
        return out[: gw.out_features].clone()

    # ------------------------------------------------------------------------------ forward
    def acquire_forward(self, gw: GTPWeight, x_requires_grad: bool
                        ) -> tuple[torch.Tensor, Callable[[], None], Hashable]:
        """Materialize ``gw`` for a forward GEMM and prefetch the next weight of the chain.

        Returns ``(weight [out, in], release, consume)``; ``consume`` is ``"main"`` for the first
        consume of ``gw`` in this pass, ``("x", k)`` for the k-th extra one.
        """
        self.cache.phase = "fwd"
        if gw.uid not in self._fwd_seen:
            self._fwd_seen.add(gw.uid)
            if not self.frozen and gw.index is None:
                gw.index = len(self.order)
                self.order.append(gw)
            gw.needs_bwd_gather = x_requires_grad
            consume: Hashable = "main"
        else:
            k = self._extra.get((gw.uid, "fwd"), 0)
            self._extra[(gw.uid, "fwd")] = k + 1
            consume = ("x", k)
        chained = consume == "main" and gw.index is not None
        if chained and gw.fwd_pending is not None:
            g, gw.fwd_pending = gw.fwd_pending, None
        else:
            g = self._issue_gather(gw, "fwd", consume, async_op=False)
        weight, release = self._complete(g)
        if chained and self.frozen and self.options.prefetch and gw.index + 1 < len(self.order):
            nxt = self.order[gw.index + 1]
            if nxt.fwd_pending is None and nxt.uid not in self._fwd_seen:
                nxt.fwd_pending = self._issue_gather(nxt, "fwd", "main", async_op=True)
        return weight, release, consume

    # ------------------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """Called at the start of every GTP backward: queue the end-of-backward drain once."""
        self.cache.phase = "bwd"
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True

    def acquire_backward(self, gw: GTPWeight, consume: Hashable
                         ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Re-materialize ``gw`` for its dgrad (prefetched by its successor, else synchronously)."""
        chained = consume == "main" and gw.index is not None
        if chained and gw.bwd_pending is not None:
            g, gw.bwd_pending = gw.bwd_pending, None
        else:
            g = self._issue_gather(gw, "bwd", consume, async_op=False)
        return self._complete(g)

    def prefetch_backward(self, gw: GTPWeight, consume: Hashable) -> None:
        """Issue the async gather of the chain predecessor of ``gw`` (its backward comes next)."""
        if consume != "main":
            return
        self._bwd_done.add(gw.uid)
        if gw.index is None or not (self.frozen and self.options.prefetch) or gw.index == 0:
            return
        prev = self.order[gw.index - 1]
        if (prev.bwd_pending is None and prev.needs_bwd_gather and prev.uid in self._fwd_seen
                and prev.uid not in self._bwd_done):
            prev.bwd_pending = self._issue_gather(prev, "bwd", "main", async_op=True)

    def reduce_weight_grad(self, gw: GTPWeight, fill: Callable[[torch.Tensor], object],
                           consume: Hashable) -> None:
        """Full wgrad into pooled scratch (``fill(rows)`` writes the logical rows), pre-scale by 1/N,
        reduce-scatter, defer the finalize."""
        p = gw.param
        main = consume == "main" and gw.index is not None
        parity = gw.index % 2 if main else 2
        wbuf = self.cache.get((gw.uid, "wgrad", consume), (gw.padded_out, gw.in_features), p.dtype,
                              "wgrad", parity, p.device, "wgrad")
        fill(wbuf[: gw.out_features])
        if gw.pad:
            wbuf[gw.out_features:].zero_()
        if self.options.grad_mode == "mean" and self.size > 1:
            wbuf.div_(self.size)
        out = self.cache.get((gw.uid, "rs", consume), (gw.shard_rows, gw.in_features), p.dtype, "rs",
                             parity, p.device, "rs_out")
        is_head = main and gw.index == 0
        async_op = self.options.async_reduction and self.frozen and not is_head
        self._log("rs_issue", "bwd", gw, async_op)
        handle = self.comm.reduce_scatter(out, wbuf, wire_dtype=self.options.grad_wire_dtype,
                                          async_op=async_op, tag="gtp:rs")
        self._fifo.append(_PendingRS(gw, handle, wbuf, out))
        limit = self.options.finalize_depth if async_op else 0
        while len(self._fifo) > limit:
            self._finalize(self._fifo.popleft())

    def _finalize(self, pend: _PendingRS) -> None:
        pend.handle.wait()
        p = pend.gw.param
        if p.grad is None:
            p.grad = pend.out.clone()
        else:
            p.grad.add_(pend.out)
        self.cache.release(pend.wbuf)
        self.cache.release(pend.out)
        self._log("rs_finalize", "bwd", pend.gw)

    # ------------------------------------------------------------------------------ drain
    def pending(self) -> dict[str, int]:
        """Outstanding work: reduce-scatters in the FIFO, prefetched gathers, held buffers."""
        return {"reduce_scatters": len(self._fifo),
                "gathers": sum((gw.fwd_pending is not None) + (gw.bwd_pending is not None)
                               for gw in self.weights),
                "held_buffers": self.cache.held()}

    def finalize_all(self) -> None:
        """Finalize every in-flight reduce-scatter and drop unused prefetches (no new collective)."""
        while self._fifo:
            self._finalize(self._fifo.popleft())
        for gw in self.weights:
            self._drop_pending(gw)

    def end_pass(self) -> None:
        """Drain and forget this forward pass's consume bookkeeping (called after each backward)."""
        self.finalize_all()
        self._fwd_seen.clear()
        self._bwd_done.clear()
        self._extra.clear()
        if not self.frozen and self.order:
            self.frozen = True
        self.passes += 1

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self.end_pass()
        for fn in self._post_drain_hooks:
            fn()

    def reset(self) -> None:
        """Forget the chain and all buffers (before rebuilding the model in-process)."""
        self.finalize_all()
        self._fwd_seen.clear()
        self._bwd_done.clear()
        self._extra.clear()
        for gw in self.weights:
            gw.index = None
        self.order = []
        self.frozen = False
        self.cache.clear()


class _GTPLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` gathered just in time; saves only ``x`` and the shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, bias: torch.Tensor | None,
                gw: GTPWeight, x_requires_grad: bool) -> torch.Tensor:
        rt = gw.runtime
        weight, release, consume = rt.acquire_forward(gw, x_requires_grad)
        try:
            y = F.linear(x, weight, bias)
        finally:
            release()
        rt._log("gemm_done", "fwd", gw)
        ctx.save_for_backward(x, shard)
        ctx.gw = gw
        ctx.consume = consume
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, _shard = ctx.saved_tensors
        gw: GTPWeight = ctx.gw
        rt = gw.runtime
        rt.begin_backward()
        dy2 = dy.reshape(-1, gw.out_features)
        x2 = x.reshape(-1, gw.in_features)
        dx = None
        if ctx.needs_input_grad[0]:
            weight, release = rt.acquire_backward(gw, ctx.consume)
            rt.prefetch_backward(gw, ctx.consume)
            try:
                dx = dy2.mm(weight).view(x.shape)
            finally:
                release()
            rt._log("dgrad_done", "bwd", gw)
        else:
            rt.prefetch_backward(gw, ctx.consume)
        db = dy2.sum(0) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            rt.reduce_weight_grad(gw, lambda rows: torch.mm(dy2.t(), x2, out=rows), ctx.consume)
        return dx, None, db, None, None


class _GTPEmbeddingFunction(torch.autograd.Function):
    """``y = W[idx]`` with ``W`` gathered just in time; saves only ``idx``; no backward gather
    (the wgrad is a scatter-add of ``dy`` rows, and integer ids have no gradient)."""

    @staticmethod
    def forward(ctx, idx: torch.Tensor, shard: torch.Tensor, gw: GTPWeight) -> torch.Tensor:
        rt = gw.runtime
        weight, release, consume = rt.acquire_forward(gw, False)
        try:
            y = F.embedding(idx, weight)
        finally:
            release()
        rt._log("gemm_done", "fwd", gw)
        ctx.save_for_backward(idx)
        ctx.gw = gw
        ctx.consume = consume
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (idx,) = ctx.saved_tensors
        gw: GTPWeight = ctx.gw
        rt = gw.runtime
        rt.begin_backward()
        rt.prefetch_backward(gw, ctx.consume)
        dy2 = dy.reshape(-1, gw.in_features)

        def fill(rows: torch.Tensor) -> None:
            rows.zero_()
            rows.index_add_(0, idx.reshape(-1), dy2)

        if ctx.needs_input_grad[1]:
            rt.reduce_weight_grad(gw, fill, ctx.consume)
        return None, None, None


def _guard_state(module: nn.Module) -> None:
    """Make plain ``state_dict``/``load_state_dict`` of a GTP module raise (see :class:`GTPStateError`)."""

    def on_save(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        mod.runtime.check_state_access(mod, "state_dict()")

    def on_load(mod: nn.Module, *args: Any) -> None:
        mod.runtime.check_state_access(mod, "load_state_dict()")

    module.register_state_dict_pre_hook(on_save)
    module.register_load_state_dict_pre_hook(on_load)


class GTPLinear(nn.Module):
    """A linear layer whose weight is a GTP shard (see the module docstring); the bias is replicated.

    Args:
        in_features, out_features: logical shape.
        runtime: the :class:`GTPRuntime` of the model.
        bias: add a replicated bias.
        name: name of the weight in logs and errors.
        weight: the full initial weight ``[out, in]``, identical on every rank (default: the
            ``nn.Linear`` initialization drawn from the current RNG, which must be in the same state
            on every rank).
        bias_init: the initial bias (default: ``nn.Linear``'s).
    """

    def __init__(self, in_features: int, out_features: int, runtime: GTPRuntime, bias: bool = True, *,
                 name: str = "", weight: torch.Tensor | None = None, bias_init: torch.Tensor | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.runtime = runtime
        if weight is None:
            weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        elif tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"GTPLinear {name!r}: weight shape {tuple(weight.shape)} != "
                             f"({out_features}, {in_features})")
        self.gtp = runtime.register(weight, name or f"gtp{len(runtime.weights)}")
        self.weight = self.gtp.param
        _guard_state(self)
        if bias:
            if bias_init is None:
                bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                bias_init = torch.empty(out_features, device=weight.device,
                                        dtype=weight.dtype).uniform_(-bound, bound)
            self.bias = nn.Parameter(bias_init.detach().clone())
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, runtime: GTPRuntime, name: str = "") -> GTPLinear:
        """A GTP copy of ``linear`` (same values; ``linear`` itself is left untouched)."""
        mod = cls(linear.in_features, linear.out_features, runtime, bias=linear.bias is not None,
                  name=name, weight=linear.weight.detach(),
                  bias_init=None if linear.bias is None else linear.bias.detach())
        mod.weight.requires_grad_(linear.weight.requires_grad)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            return _GTPLinearFunction.apply(x, self.weight, self.bias, self.gtp, x.requires_grad)
        weight, release = self.runtime.gather_for_inference(self.gtp)
        try:
            return F.linear(x, weight, self.bias)
        finally:
            release()

    def extra_repr(self) -> str:
        g = self.gtp
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"shard_rows={g.shard_rows}, gtp={self.runtime.size}, bias={self.bias is not None}")


class GTPEmbedding(nn.Module):
    """An embedding table ``[num_embeddings, embedding_dim]`` sharded by rows (vocabulary) over GTP.

    Forward gathers the table just in time (it is usually the chain head); backward needs no gather:
    the full-shape wgrad scratch gets ``index_add`` of the output grads and is reduce-scattered like a
    linear weight's. Plain embeddings only (no ``padding_idx``, ``max_norm``, sparse or frequency
    scaling).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, runtime: GTPRuntime, *, name: str = "",
                 weight: torch.Tensor | None = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.runtime = runtime
        if weight is None:
            weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            nn.init.normal_(weight)
        elif tuple(weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"GTPEmbedding {name!r}: weight shape {tuple(weight.shape)} != "
                             f"({num_embeddings}, {embedding_dim})")
        self.gtp = runtime.register(weight, name or f"gtp{len(runtime.weights)}")
        self.weight = self.gtp.param
        _guard_state(self)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, runtime: GTPRuntime, name: str = "") -> GTPEmbedding:
        """A GTP copy of a plain ``emb`` (raises ``ValueError`` for the unsupported options)."""
        if (emb.padding_idx is not None or emb.max_norm is not None or emb.sparse
                or emb.scale_grad_by_freq):
            raise ValueError(f"GTPEmbedding {name!r}: padding_idx, max_norm, sparse and "
                             "scale_grad_by_freq are not supported; leave this embedding replicated")
        mod = cls(emb.num_embeddings, emb.embedding_dim, runtime, name=name, weight=emb.weight.detach())
        mod.weight.requires_grad_(emb.weight.requires_grad)
        return mod

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _GTPEmbeddingFunction.apply(idx, self.weight, self.gtp)
        weight, release = self.runtime.gather_for_inference(self.gtp)
        try:
            return F.embedding(idx, weight)
        finally:
            release()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, shard_rows={self.gtp.shard_rows}, "
                f"gtp={self.runtime.size}")


def tied_outside(model: nn.Module, path: str, module: nn.Module) -> list[str]:
    """Names under which a parameter of ``module`` (at ``path``) is also reachable *outside* that module.

    A module registered under several names (a repeated layer) is not tied to anything: its aliases
    are the same module. A weight shared with another module (an output head tied to the token
    embedding) is; GTP cannot shard one side and keep the other, so :func:`shard_linears` leaves such
    a module replicated (or refuses, ``tied="error"``). No collective.
    """
    aliases = {n for n, m in model.named_modules(remove_duplicate=False) if m is module}
    own = {f"{a}.{pn}" if a else pn for a in aliases for pn, _ in module.named_parameters(remove_duplicate=False)}
    groups = tied_names(model)
    outside: list[str] = []
    for pn, _ in module.named_parameters(remove_duplicate=False):
        for other in groups.get(f"{path}.{pn}" if path else pn, []):
            if other not in own and other not in outside:
                outside.append(other)
    return outside


def _replace_modules(model: nn.Module, kind: type, make: Callable[[Any, str], Any],
                     include: Callable[[str, Any], bool] | None, tied: str, what: str,
                     check: Callable[[Any, str], None], agree: Callable[[], None]) -> dict:
    """Replace every module of exactly type ``kind`` (in place) by ``make(module, name)``.

    A module under several names becomes one replacement; a module whose parameter is tied to one
    outside it stays as it is (``tied="replicate"``) or raises ``ValueError`` naming it
    (``tied="error"``). Order: select and ``check(module, name)`` every candidate (no collective,
    raises before anything changes), then ``agree()`` (the initial-weight collective), then replace.
    Returns ``{first name: replacement}``.
    """
    if tied not in TIED_POLICIES:
        raise ValueError(f"{what}: tied must be one of {TIED_POLICIES}, got {tied!r}")
    chosen: dict[int, str] = {}
    skip: set[int] = set()
    sites: list[tuple[nn.Module, str, Any]] = []
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            if type(child) is not kind or id(child) in skip:
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if include is not None and not include(full, child):
                continue
            if id(child) not in chosen:
                others = tied_outside(model, full, child)
                if others:
                    if tied == "error":
                        raise ValueError(f"{what}: {full!r} shares a parameter with {others} (tied weights); "
                                         "GTP would untie them. Pass tied='replicate' to keep it replicated "
                                         "(its gradient is then averaged like a data-parallel one), or "
                                         "exclude it with include=")
                    skip.add(id(child))
                    continue
                check(child, full)
                chosen[id(child)] = full
            sites.append((parent, child_name, child))
    agree()
    memo: dict[int, Any] = {}
    done: dict[str, Any] = {}
    for parent, child_name, child in sites:
        if id(child) not in memo:
            memo[id(child)] = make(child, chosen[id(child)])
            done[chosen[id(child)]] = memo[id(child)]
        setattr(parent, child_name, memo[id(child)])
    return done


def _agree(model: nn.Module, runtime: GTPRuntime, init_sync: bool, sync_comm: Comm | None) -> Callable[[], None]:
    comm = sync_comm if sync_comm is not None else runtime.comm

    def run() -> None:
        if init_sync:
            sync_module_state(model, comm)
        else:
            check_module_state(model, comm)

    return run


def _check_weight(runtime: GTPRuntime, weight: torch.Tensor, name: str) -> None:
    opts = runtime.options
    check_block_rule(opts.gather_format, opts.fp8_block, weight.shape[1], f"GTP weight {name!r}")


def _check_embedding(runtime: GTPRuntime, emb: nn.Embedding, name: str) -> None:
    if emb.padding_idx is not None or emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
        raise ValueError(f"GTPEmbedding {name!r}: padding_idx, max_norm, sparse and "
                         "scale_grad_by_freq are not supported; leave this embedding replicated")
    _check_weight(runtime, emb.weight, name)


def shard_embeddings(model: nn.Module, runtime: GTPRuntime,
                     include: Callable[[str, nn.Embedding], bool] | None = None, *, tied: str = "replicate",
                     init_sync: bool = True, sync_comm: Comm | None = None) -> dict[str, GTPEmbedding]:
    """Replace every plain ``nn.Embedding`` of ``model`` (in place) by a :class:`GTPEmbedding` copy.

    Arguments, tied-weight handling and the initial-weight agreement (after every check, before the
    first replacement) as for :func:`shard_linears`.
    """
    return _replace_modules(model, nn.Embedding, lambda m, name: GTPEmbedding.from_embedding(m, runtime, name=name),
                            include, tied, "shard_embeddings", lambda m, name: _check_embedding(runtime, m, name),
                            _agree(model, runtime, init_sync, sync_comm))


def shard_linears(model: nn.Module, runtime: GTPRuntime,
                  include: Callable[[str, nn.Linear], bool] | None = None, *, tied: str = "replicate",
                  init_sync: bool = True, sync_comm: Comm | None = None) -> dict[str, GTPLinear]:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`GTPLinear` copy.

    A module that appears under several names (a repeated layer) becomes one ``GTPLinear``. Returns
    ``{name: GTPLinear}`` by first name. ``include(name, linear)`` may exclude layers (they stay
    replicated); :func:`plan_filter` builds one from a model plan's ``parallel_linears``.

    Tied weights (:func:`lowband.plan.tied_groups`): a linear whose weight or bias is shared with
    another module (e.g. an output head tied to the token embedding) is left replicated
    (``tied="replicate"``: its gradient is averaged over the GTP group with the other replicated
    parameters by :func:`sync_replicated_grads`, as data parallelism would) or refused by name
    (``tied="error"``).

    Initial weights: the shards are cut from the model each rank holds, so every rank of the group
    must hold the same model. ``init_sync=True`` (default) broadcasts every parameter and floating
    buffer from rank 0 of ``sync_comm`` (default: the GTP group; pass the world's ``Comm`` when there
    is data parallelism across GTP groups too); ``init_sync=False`` verifies them with one checksum
    exchange and raises ``ValueError`` on every rank if they differ. Every check (tied weights, fp8
    block rule) runs before that collective, on every rank alike.
    """
    return _replace_modules(model, nn.Linear, lambda m, name: GTPLinear.from_linear(m, runtime, name=name),
                            include, tied, "shard_linears", lambda m, name: _check_weight(runtime, m.weight, name),
                            _agree(model, runtime, init_sync, sync_comm))


def plan_filter(plan: ModelPlan) -> Callable[[str, nn.Module], bool]:
    """An ``include`` for :func:`shard_linears` that takes exactly the plan's ``parallel_linears``."""
    names = {pl.module for pl in plan.parallel_linears}
    return lambda name, _module: name in names


def is_gtp_param(p: torch.Tensor) -> bool:
    return getattr(p, "gtp", None) is not None


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``model`` that are not GTP shards (biases, norms, embeddings ...)."""
    return [p for p in model.parameters() if not is_gtp_param(p)]


def reduce_grads(comm: Comm, params: Iterable[torch.Tensor], op: str = "avg", *, tag: str = "grad",
                 wire_dtype: torch.dtype | None = None) -> None:
    """One coalesced all-reduce of the ``.grad`` of ``params`` over ``comm`` (``None`` grads count as 0).

    Used for replicated params over the GTP group (``avg`` in mean mode, ``sum`` in sum mode) and for
    all grads over the DP group. Every rank must pass the same parameters in the same order.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    dtypes = {p.dtype for p in params}
    for dtype in sorted(dtypes, key=str):
        group = [p for p in params if p.dtype == dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in group])
        comm.all_reduce(flat, op, wire_dtype=wire_dtype, tag=tag)
        off = 0
        for p in group:
            n = p.numel()
            g = flat[off:off + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += n


def sync_replicated_grads(runtime: GTPRuntime, model: nn.Module) -> None:
    """All-reduce the grads of ``model``'s replicated params over the GTP group (mode-dependent op)."""
    op = "avg" if runtime.options.grad_mode == "mean" else "sum"
    reduce_grads(runtime.comm, replicated_params(model), op, tag="gtp:replicated")


def gather_buffer_bytes(runtime: GTPRuntime, gw: GTPWeight) -> int:
    """Bytes of ``gw``'s gathered wire buffer (the all-gather output) in the runtime's gather format."""
    fmt = runtime.options.gather_format
    elems = gw.padded_out * gw.in_features
    if fmt == "native":
        return elems * gw.param.element_size()
    if fmt == "bf16":
        return elems * 2
    return runtime.size * fp8_packet_bytes(gw.shard_rows, gw.in_features, runtime.options.fp8_block)


def bound_live_unsharded_bytes(runtime: GTPRuntime) -> dict[str, int]:
    """The documented high-water bound of live unsharded bytes, per phase (see module docstring)."""
    fmt = runtime.options.gather_format
    gmax = rmax = 0
    for gw in runtime.weights:
        full = gw.padded_out * gw.in_features * gw.param.element_size()
        g = full if fmt == "native" else full + gather_buffer_bytes(runtime, gw)
        gmax = max(gmax, g)
        rmax = max(rmax, full)
    return {"fwd": 2 * gmax, "bwd": 2 * gmax + (runtime.options.finalize_depth + 1) * rmax}
