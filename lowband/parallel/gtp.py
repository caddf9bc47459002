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
  the GTP group (``avg`` in mean mode, ``sum`` in sum mode) at the end of every backward, as DDP does
  (one coalesced all-reduce, tag ``gtp:replicated``, with :func:`reduce_grads`' semantics for ``None``
  grads; not inside :meth:`GTPRuntime.no_sync`). The same all-reduce carries one *used* flag and one
  *non-finite* flag per GTP weight: a shard gradient holding inf/NaN on any rank then shows it on
  every rank, so ``torch.amp.GradScaler`` skips alike, as under DDP (:meth:`GTPRuntime.share_nonfinite`;
  without trainable replicated parameters the flags travel alone). Accumulation over backwards outside
  ``no_sync``: mean mode re-averages the whole accumulated gradient, as DDP does (averaging is linear);
  sum mode sends only what came since the last reduction (a tensor hook sets the reduced gradient aside
  when the next backward first accumulates into it; ``.grad`` becomes that reduced gradient plus the
  reduction of the new part), and nothing new for a gradient still as the last reduction wrote it (a
  parameter unused since, or already reduced by a reentrant checkpoint's inner backward); a gradient
  edited since (``zero_grad(set_to_none=False)``) or never reduced is sent whole;
* optimizer state of a shard (a torch optimizer's moments: this rank's rows) is stamped with its GTP
  rank and size; loading another rank's (nanoGPT's resume: rank 0's ``opt.state_dict()`` loaded by
  every rank) is refused at the next ``step()`` on every rank (:func:`_check_optimizer_state`);
* parameter identity: :func:`shard_linears` / :func:`shard_embeddings` keep the user's ``Parameter``
  objects (the weight's ``.data`` becomes the shard, the bias is the same object), so an optimizer
  built before sharding trains every tensor.

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
in the parameter dtype on the wire, or take ``grad_wire_dtype`` (bf16, or block-scaled ``"fp8"``/``"int8"``):
the reduce-scatters and the replicated all-reduce alike; with a block-scaled wire the replicated
gradients go through :func:`lowband.comm.codecs.codec_all_reduce` (an all-to-all and an all-gather, tag
``gtp:replicated``) and the flags, which must stay exact, through a float32 all-reduce of their own
(``gtp:replicated:flags``).

Buffers come from :class:`~lowband.parallel.gtp_cache.GTPBufferCache` keyed by
``(shape, dtype, direction, parity)`` (direction: ``fwd`` / ``bwd`` for fp8 gathers, one shared
``fwd|bwd`` pool for native and bf16 gathers, as Megatron keys direction only for quantized
layouts; ``wgrad`` and ``rs`` for gradient scratch); see there for the stable-address argument.
``torch.compile`` (of the whole model or of each block): the forward of :class:`GTPLinear` and
:class:`GTPEmbedding` is ``torch.compiler.disable``-d, so each GTP layer is a graph break and dynamo
compiles the regions between them (norms, attention, activations, residuals); the GTP forward, its
gathers, the chain bookkeeping and the buffer cache always run eagerly, once per call, exactly as
without compile. Dynamo never traces the runtime: traced, its Python state (chain position, the
cache's free lists and held set, the ledger) would be guarded on and change every step (a recompile
per step), and a frame that dynamo traces, then graph-breaks inside and resumes re-runs Python side
effects such as ``GTPBufferCache.get`` / ``release`` (the observed "buffer is not held (double
release?)"). The backward of the GTP autograd Functions runs in the eager autograd engine (compiled
autograd is off by default), as do the end-of-backward drain and the replicated-gradient all-reduce.
Every ``Comm`` collective is also opaque to dynamo (:mod:`lowband.comm.comm`).

Documented bound of live unsharded bytes (gathered weights, dequantized copies, wgrad scratch),
``G`` = the largest
gathered weight (wire buffer + dequantized copy when quantized), ``R`` = the largest padded wgrad:
forward ``<= 2 G`` (current + prefetched), backward ``<= 2 G + (finalize_depth + 1) R``. Not counted:
the ``Comm`` reduce-scatter's own receive buffer on gloo (one padded wgrad per in-flight reduce-scatter).
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from lowband.comm import Comm, CommHandle, finite_probe
from lowband.comm.codecs import DEFAULT_BLOCK_SIZE, Codec, codec_all_reduce, codec_reduce_scatter, get_codec
from lowband.comm.comm import true_div_
from lowband.comm.opaque import opaque
from lowband.parallel.dense import dense_embedding, dense_linear
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
from lowband.parallel.tp_grads import note_tp_grads
from lowband.plan import ModelPlan, tied_names
from lowband.sharding import PLACEMENT_ATTR, Placement, Split, place, placement_of

GRAD_MODES = ("mean", "sum")
TIED_POLICIES = ("replicate", "error")


class GTPCollectiveError(RuntimeError):
    """A GTP weight gather failed, typically because not every rank of the GTP group ran the forward."""


class GTPDirectReadError(ValueError):
    """A GTP shard was read outside its layer's forward (``module.weight[:T]``, ``F.linear(x, module.weight)``):
    that forward saw this rank's rows only. Raised at the end of the backward, on every rank of the group."""


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
        grad_wire_dtype: wire of every gradient collective (reduce-scatters and the replicated all-reduce;
            ``None``: the parameter dtype, or bf16), or
            ``"fp8"`` / ``"int8"``: block-scaled (one fp32 scale per ``grad_block_size`` elements of each
            rank's shard rows, :func:`lowband.comm.codecs.codec_reduce_scatter`: one all-to-all, fp32 sums
            in rank order at the owner).
        grad_block_size: elements per fp32 scale of an ``"fp8"``/``"int8"`` gradient (a multiple of 4).
        record_events: keep an event log (issue/ready/GEMM order) in :attr:`GTPRuntime.events`.
        cache_wire_shard: for ``bf16``/``fp8``, keep the shard's quantized copy a grad-enabled forward
            made for the backward re-gather of the same pass (quantize once per forward/backward pass
            instead of at every gather; costs 1/2 resp. ~1/4 of the shard bytes per weight, held from
            the forward to the end of its backward). Every forward quantizes what the parameter holds
            then, so any write to the parameters between passes is seen. Default off: re-quantize per
            gather, as FSDP2's mixed-precision cast does.
        state_timeout: seconds a state collective (:meth:`GTPRuntime.full_weight`,
            :func:`~lowband.parallel.unsharded_copy`, :class:`~lowband.parallel.gtp_state.GTPStateLayout`)
            waits for the other ranks before it fails with :class:`GTPCollectiveError` (they run on a
            private group of their own, ``gtp_state``, with this timeout).
        check_grad_edits: refuse, at the next ``optimizer.step()``, gradients that code outside lowband
            changed after GTP reduced them (``torch.nn.utils.clip_grad_norm_`` clips each rank by the
            norm of its own shards). Elementwise edits that are the same on every rank
            (``clip_grad_value_``, a scale) are exact: pass ``False`` to allow them.
        share_nonfinite: make a shard gradient that holds inf/NaN on one rank show it on every rank
            (see :meth:`GTPRuntime.share_nonfinite`), so ``torch.amp.GradScaler`` skips the step and
            backs off on every rank alike, as under DDP. Costs one inf-norm scan of each shard gradient
            (when its reduce-scatter is finalized) and one flag per GTP weight in the replicated-gradient
            all-reduce; ``False`` skips both (then an overflow confined to one rank's shards makes ranks
            step differently under a GradScaler).
    """

    gather_format: str = "native"
    fp8_block: BlockSpec = field(default_factory=BlockSpec)
    prefetch: bool = True
    async_reduction: bool = True
    finalize_depth: int = 2
    grad_mode: str = "mean"
    grad_wire_dtype: torch.dtype | str | None = None
    grad_block_size: int = DEFAULT_BLOCK_SIZE
    record_events: bool = False
    cache_wire_shard: bool = False
    state_timeout: float = 60.0
    check_grad_edits: bool = True
    share_nonfinite: bool = True

    def __post_init__(self) -> None:
        check_format(self.gather_format)
        if not isinstance(self.fp8_block, BlockSpec):
            if (isinstance(self.fp8_block, (tuple, list)) and len(self.fp8_block) == 2):
                self.fp8_block = BlockSpec(*self.fp8_block)
            else:
                raise TypeError(f"GTPOptions.fp8_block must be a BlockSpec or (rows, cols), got "
                                f"{self.fp8_block!r}")
        for name in ("prefetch", "async_reduction", "record_events", "cache_wire_shard", "check_grad_edits",
                     "share_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GTPOptions.{name} must be a bool, got {getattr(self, name)!r}")
        d = self.finalize_depth
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"GTPOptions.finalize_depth must be an int >= 0, got {d!r}")
        if self.grad_mode not in GRAD_MODES:
            raise ValueError(f"GTPOptions.grad_mode {self.grad_mode!r} not in {GRAD_MODES}")
        t = self.state_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"GTPOptions.state_timeout must be a number of seconds > 0, got {t!r}")
        if self.grad_wire_dtype not in (None, torch.float32, torch.float64, torch.bfloat16, "fp8", "int8"):
            raise ValueError(f"GTPOptions.grad_wire_dtype {self.grad_wire_dtype} not in "
                             "(None, torch.float32, torch.float64, torch.bfloat16, 'fp8', 'int8')")
        b = self.grad_block_size
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 4:
            raise ValueError(f"GTPOptions.grad_block_size must be a positive multiple of 4, got {b!r}")

    def grad_codec(self) -> Codec | None:
        """The block-scaled codec of ``"fp8"``/``"int8"`` gradients, else ``None`` (a dtype on the wire)."""
        if isinstance(self.grad_wire_dtype, str):
            return get_codec(self.grad_wire_dtype, block_size=self.grad_block_size)
        return None


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
        self.used = False  # consumed by a grad-enabled forward since the last sync_replicated_grads
        # autograd brought a gradient to the shard itself: the shard was read outside the GTP layer
        # (module.weight[:T], F.linear(x, module.weight)); see _direct_read_hook, GTPRuntime._check_direct_reads
        self.read_direct = False
        self._wire_key: tuple[int, int, int] | None = None
        self._wire_src: torch.Tensor | None = None
        # (inf-norm of .grad, that .grad, its version) taken when a reduce-scatter was finalized into it
        self._scan: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @property
    def pad(self) -> int:
        return self.padded_out - self.out_features

    def __deepcopy__(self, memo: dict) -> GTPWeight:
        """The copy of a deep-copied GTP layer: registered with the copied runtime, its shard the copied
        parameter (marked ``.gtp``), no per-step state."""
        runtime = copy.deepcopy(self.runtime, memo)
        param = copy.deepcopy(self.param, memo)
        new = GTPWeight(runtime, len(runtime.weights), self.name, param, self.out_features, self.in_features,
                        self.padded_out)
        memo[id(self)] = new
        param.gtp = new
        pl = placement_of(self.param)
        if pl is not None:  # a Parameter's deep copy drops attributes; the copy shares the groups
            setattr(param, PLACEMENT_ATTR, pl)
        runtime.weights.append(new)
        return new

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
        comm: the GTP group (e.g. ``build_mesh(...).gtp``). The runtime runs every collective on
            ``comm.private("gtp")``, a process group of its own with the same members and ledger
            name (created here, among the members: every rank of the group must construct the
            runtime), so no collective the user issues on ``comm``'s group can pair with a GTP
            gather or reduce-scatter.
        options: :class:`GTPOptions` (keyword overrides are also accepted).
    """

    def __init__(self, comm: Comm, options: GTPOptions | None = None, **overrides) -> None:
        if options is None:
            options = GTPOptions(**overrides)
        elif overrides:
            raise TypeError("GTPRuntime: pass either options or keyword overrides, not both")
        self.comm = comm.private("gtp")
        # state collectives (unsharded_copy, checkpoints) on a group of their own with a bounded
        # timeout: a rank that enters one alone fails within options.state_timeout, not 30 minutes
        self.state_comm = comm.private("gtp_state", timeout=timedelta(seconds=options.state_timeout))
        self.options = options
        self._grad_codec = options.grad_codec()
        self.size = comm.size
        self.rank = comm.rank
        # stamped on the optimizer state tensors of this runtime's shards (see _check_optimizer_state);
        # this very object marks a tensor as checked in this process
        self._optim_stamp: tuple[int, int] = (self.rank, self.size)
        self._models: list[nn.Module] = []  # attached models: their replicated grads are reduced in backward
        self._hooked: set[int] = set()
        self._no_sync_depth = 0
        self._grad_records: list[tuple[nn.Parameter, torch.Tensor, int]] = []
        self._new_windows()
        _RUNTIMES.add(self)
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

    # ------------------------------------------------------------------------------ replicated grads
    def attach(self, model: nn.Module) -> None:
        """Average (sum mode: sum) ``model``'s replicated gradients over the GTP group at the end of every
        backward. Registers two hooks on each trainable replicated parameter: a post-accumulate-grad hook
        that queues the end-of-backward reduction, and a tensor hook that, in sum mode, sets an already reduced
        gradient aside so that only new contributions are summed (see the module docstring).

        :func:`shard_linears` / :func:`shard_embeddings` attach the model they convert; call it
        yourself for a model built from :class:`GTPLinear` layers directly (or call
        :func:`sync_replicated_grads` once, which attaches it). Idempotent, no collective.
        """
        if not any(m is model for m in self._models):
            self._models.append(model)
        for p in model.parameters():
            if not is_gtp_param(p) and p.requires_grad and id(p) not in self._hooked:
                self._hooked.add(id(p))
                p.register_hook(_window_hook(self, p))
                p.register_post_accumulate_grad_hook(_queue_hook(self))

    def attached_replicated(self) -> list[nn.Parameter]:
        """The replicated (non-GTP) parameters of the attached models, deduplicated, in model order."""
        seen: set[int] = set()
        out = []
        for m in self._models:
            for p in m.parameters():
                if not is_gtp_param(p) and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As ``DistributedDataParallel.no_sync``: backwards inside accumulate the replicated gradients
        locally (no all-reduce); the first backward after the context averages (sum mode: sums) the
        accumulated sum (in sum mode only what came since the last reduction travels, see the module
        docstring; inside the context ``.grad`` then holds that part alone, the earlier reduction is added
        back by the reducing backward).
        GTP shard gradients are reduce-scattered in every backward regardless (that is how they are
        computed; the sum is the same)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # Sum mode sends each backward's new contributions only (see _reduce_replicated): per replicated parameter,
    # _reduced: (weak reference to the .grad the last reduction wrote, its _version); _base: that reduced
    # gradient, set aside (strong reference) while .grad collects a window's new contributions; _fresh: (weak
    # reference to that .grad, its _version after autograd's last accumulation into it).
    def _new_windows(self) -> None:
        self._reduced: Any = WeakIdKeyDictionary()
        self._base: Any = WeakIdKeyDictionary()
        self._fresh: Any = WeakIdKeyDictionary()

    @staticmethod
    def _is(rec: tuple[weakref.ref, int] | None, g: torch.Tensor | None) -> bool:
        return rec is not None and g is not None and rec[0]() is g and g._version == rec[1]

    def _before_accumulate(self, p: nn.Parameter) -> None:
        """Tensor hook of an attached replicated parameter, before autograd accumulates into ``p.grad``
        (sum mode): if ``p.grad`` is still the gradient the last reduction wrote, set it aside so that
        ``.grad`` collects this window's new contributions alone (exactly what the next reduction sends)."""
        if self.options.grad_mode != "sum":
            return
        g = p.grad
        if p in self._base:
            if not self._is(self._fresh.get(p), g):  # replaced or edited since autograd wrote it: local now
                del self._base[p]
                self._fresh.pop(p, None)
            return
        if self._is(self._reduced.get(p), g):
            self._base[p] = g
            p.grad = None

    def _after_accumulate(self, p: nn.Parameter) -> None:
        """Post-accumulate hook of an attached replicated parameter: queue the end-of-backward reduction;
        remember the version autograd left a window's gradient at (a later edit is then seen)."""
        self._queue_end()
        if p in self._base and p.grad is not None:
            self._fresh[p] = (weakref.ref(p.grad), p.grad._version)

    def _sum_plan(self, params: list[nn.Parameter]) -> dict[int, tuple[torch.Tensor | None, torch.Tensor]]:
        """Per parameter whose ``.grad`` holds an earlier reduction's result: ``(what to send, that result)``.
        A window of new contributions sends them; a reduced gradient nothing new got into sends nothing
        (used flag 0); a parameter left out (never reduced, or its gradient edited since) sends its ``.grad``."""
        plan: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        for p in params:
            if not p.requires_grad:
                continue
            g = p.grad
            base = self._base.pop(p, None)
            fresh = self._fresh.pop(p, None)
            if base is not None:
                if self._is(fresh, g):
                    plan[id(p)] = (g, base)
            elif self._is(self._reduced.get(p), g):
                plan[id(p)] = (None, g)
        return plan

    def _queue_end(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True

    def _reduce_replicated(self, params: list[nn.Parameter]) -> None:
        op = "avg" if self.options.grad_mode == "mean" else "sum"
        plan = self._sum_plan(params) if op == "sum" else None
        weights = self.weights
        local = self._nonfinite_local() if self.options.share_nonfinite and self.size > 1 and weights else None
        try:
            codec = self._grad_codec  # every gradient GTP sends takes the wire of options.grad_wire_dtype
            wire = None if codec is not None else self.options.grad_wire_dtype
            direct = [gw.read_direct for gw in weights]
            res = _reduce_grads(self.comm, params, op, tag="gtp:replicated", wire_dtype=wire,  # type: ignore[arg-type]
                                extra_flags=[gw.used for gw in weights] + direct, extra_tensor=local,
                                codec=codec, plan=plan)
        except RuntimeError as e:
            raise GTPCollectiveError(
                f"GTP: the all-reduce of the replicated gradients over group {self.comm.name!r} (size "
                f"{self.size}) failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}. Every rank "
                "of the GTP group must run the same forwards and backwards of a GTP model, using the same "
                "GTP layers") from e
        if op == "sum":  # what this reduction wrote: a later backward adds to it (see _before_accumulate)
            for p in params:
                if p.requires_grad and p.grad is not None:
                    self._reduced[p] = (weakref.ref(p.grad), p.grad._version)
                else:
                    self._reduced.pop(p, None)
        if res is None:  # no trainable replicated parameter and no flags to share: nothing sent
            self._check_direct_reads(direct)
            return
        mixed, anywhere, set_anywhere = res
        for gw in weights:
            gw.used = False
        self._check_direct_reads(set_anywhere[len(weights):])
        mixed = mixed[:len(weights)]
        if any(mixed):
            names = [gw.name for gw, m in zip(weights, mixed, strict=True) if m]
            raise GTPCollectiveError(
                f"GTP: weights {names} were used in this step's forward by some ranks of group "
                f"{self.comm.name!r} (size {self.size}) but not by all; a GTP weight is gathered and "
                "reduce-scattered collectively, so its collectives paired with other weights' collectives "
                "of the other ranks and this step's gradients are wrong. Keep conditionally used layers "
                "replicated (shard_linears(..., include=...)) or run every GTP layer on every rank")
        if local is not None and any(anywhere):
            self.share_nonfinite(anywhere, local)

    def _check_direct_reads(self, flags: list[bool]) -> None:
        """Raise :class:`GTPDirectReadError` naming the GTP weights flagged in ``flags`` (one per weight: this
        rank's own, or agreed over the group by :meth:`_reduce_replicated`); clear every weight's flag."""
        for gw in self.weights:
            gw.read_direct = False
        names = [gw.name for gw, f in zip(self.weights, flags, strict=True) if f]
        if names:
            raise GTPDirectReadError(
                f"GTP: weights {names} were read outside their GTP layer's forward in this step (e.g. "
                "module.weight[:T], or module.weight passed to F.linear), on at least one rank of group "
                f"{self.comm.name!r} (size {self.size}): there the parameter holds only this rank's rows of the "
                "weight, so that forward used the wrong values. Call the layer itself, or keep the weight "
                "replicated (shard_linears / shard_embeddings(..., include=...), or leave it out of the plan's "
                "parallel layers)")

    @torch.no_grad()
    def _nonfinite_local(self) -> torch.Tensor:
        """Per GTP weight, ``1.0`` where this rank's shard gradient holds inf/NaN (float32, on the
        shards' device; no host sync). Uses the scan taken when the weight's last reduce-scatter was
        finalized if ``.grad`` is still that tensor at that version, else scans ``.grad`` now."""
        weights = self.weights
        flags = torch.zeros(len(weights), dtype=torch.float32, device=weights[0].param.device)
        idx: list[int] = []
        bad: list[torch.Tensor] = []
        for i, gw in enumerate(weights):
            scan, gw._scan = gw._scan, None  # never keep a reference to a gradient past this point
            g = gw.param.grad
            if g is None:
                continue
            if scan is not None and scan[1] is g and scan[2] == g._version:
                norm = scan[0]
            else:  # edited or zeroed since its finalize, or not reduced in this window
                norm = finite_probe(g)
            idx.append(i)
            bad.append(~torch.isfinite(norm))  # before any cast: a finite float64 norm may overflow float32
        if idx:
            flags[idx] = torch.stack(bad).to(device=flags.device, dtype=flags.dtype)
        return flags

    @torch.no_grad()
    def share_nonfinite(self, anywhere: list[bool], local: torch.Tensor) -> None:
        """Make every GTP weight whose shard gradient holds inf/NaN on some rank show it on this rank too.

        Under DDP an inf/NaN anywhere in a gradient reaches every rank through the all-reduce, so
        ``torch.amp.GradScaler.unscale_`` finds it on every rank and every rank skips the step and backs
        off its scale. A GTP shard gradient is only this rank's rows, so an overflow confined to rows
        another rank owns would be seen there only (one rank skips, another steps: silently wrong). At
        the end of every synchronizing backward each rank flags its non-finite shard gradients in the
        replicated-gradient all-reduce (tag ``gtp:replicated``, one element per GTP weight, no extra
        collective); a weight flagged by any rank and finite here gets NaN written into the first
        element of its shard gradient, so every optimizer holding that weight finds inf/NaN on every
        rank, exactly where DDP's would (per weight, so with several optimizers the same ones skip).

        Cost per synchronizing backward: one inf-norm of each shard gradient when its reduce-scatter
        is finalized (a read of the shard gradients, ``1/N`` of the full ones, overlapped with the
        reduce-scatters still in flight; the chain head's is the last), a re-scan of any gradient
        edited since, and ``len(weights)`` more elements in the existing all-reduce. Nothing waits
        longer than before: the all-reduce already followed the last reduce-scatter.

        Without a GradScaler, a skipped step was never going to happen: an inf/NaN gradient makes DDP's
        update non-finite too; this rank's NaN element then lands in one more element of the update.
        A weight with no ``.grad`` on this rank is left as it is (every reduce-scatter gives every rank
        its shard gradient: only code clearing ``.grad`` on some ranks alone gets there)."""
        mine = local.tolist()
        changed = []
        for gw, any_rank, here in zip(self.weights, anywhere, mine, strict=True):
            g = gw.param.grad
            if any_rank and not here and g is not None:
                g[(0,) * g.dim()] = math.nan
                changed.append(gw.param)
        if changed:
            self.record_grads(changed)

    # ------------------------------------------------------------------------------ grad edits
    def record_grads(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Remember the gradients GTP (or lowband) wrote, to notice a later edit by code outside lowband.

        ``params=None``: every shard and attached replicated parameter (replacing the records); else
        refresh the records of ``params`` only (lowband code that rewrote those gradients)."""
        if params is None:
            ps: list[torch.Tensor] = [gw.param for gw in self.weights] + self.attached_replicated()
            self._grad_records = [(p, p.grad, p.grad._version) for p in ps if p.grad is not None]
            return
        ids = {id(p) for p in params}
        self._grad_records = [(p, p.grad, p.grad._version) if id(p) in ids and p.grad is not None else (p, g, v)
                              for p, g, v in self._grad_records]

    def check_unfrozen(self, params: set[int]) -> None:
        """Raise :class:`GTPStateError` if a replicated parameter of an attached model (of ``params``) is
        trainable now but was frozen when the model was attached: GTP has no hook on it, so its gradient was
        not averaged over the group and the ranks would step apart. Same verdict on every rank (it depends
        on ``requires_grad`` alone). No collective."""
        if self.size == 1:
            return
        names = [n for m in self._models for n, p in m.named_parameters()
                 if id(p) in params and p.requires_grad and not is_gtp_param(p) and id(p) not in self._hooked]
        if names:
            raise GTPStateError(
                f"GTP: replicated parameters {sorted(set(names))[:5]} are trainable now but were not when GTP "
                "attached the model (frozen then, or added since, e.g. an adapter): GTP has no hook on them, so their "
                "gradients were not averaged over the GTP group and the ranks would step apart. Call "
                "runtime.attach(model) after unfreezing or adding them (before the backward), or do either before "
                "shard_linears / shard_embeddings")

    def check_grad_edits(self, params: set[int] | None = None) -> None:
        """Raise :class:`GTPStateError` if a recorded gradient (of ``params``, default all) was changed
        in place or replaced since GTP wrote it (``None``, i.e. ``zero_grad()``, is fine). No collective."""
        if not self.options.check_grad_edits or self.size == 1:
            return
        for p, g, v in self._grad_records:
            if params is not None and id(p) not in params:
                continue
            if p.grad is None:
                continue
            if p.grad is not g or g._version != v:
                gw = getattr(p, "gtp", None)
                what = f"GTP weight {gw.name!r}" if gw is not None else "a replicated parameter"
                raise GTPStateError(
                    f"GTP: the gradient of {what} was changed after backward by code outside lowband "
                    "(e.g. torch.nn.utils.clip_grad_norm_, which clips each rank by the norm of its own "
                    "shards, so ranks step differently); use lowband.parallel.clip_grad_norm_(model, "
                    "max_norm) (the global norm, as under DDP), or GTPOptions(check_grad_edits=False) for "
                    "elementwise edits that are the same on every rank (clip_grad_value_, a scale)")

    def __deepcopy__(self, memo: dict) -> GTPRuntime:
        """A copy for a deep-copied model (an EMA copy): same groups and options, its own chain, buffer
        pool and weights (filled as the copied layers' :class:`GTPWeight` are copied). The copy's
        forwards gather the copy's shards, so every rank of the group must run them, as for the original."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, v)
        new.weights, new.order, new.frozen = [], [], False
        new.cache, new.events, new._fifo = GTPBufferCache(), [], deque()
        new._fwd_seen, new._bwd_done, new._extra = set(), set(), {}
        new._callback_queued, new._post_drain_hooks, new.passes = False, [], 0
        new._models, new._hooked, new._grad_records = [], set(), []
        new._no_sync_depth, new._local_state_depth = 0, 0
        new._new_windows()
        _RUNTIMES.add(new)
        for m in self._models:
            if id(m) in memo:
                new._attach_later = [*getattr(new, "_attach_later", []), memo[id(m)]]
        return new

    def _finish_copy(self) -> None:
        for m in self.__dict__.pop("_attach_later", []):
            self.attach(m)

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
        """Raise :class:`GTPStateError` for a plain ``state_dict``/``load_state_dict`` of a sharded module (on a
        group of one too when fp8 gathers pad the weight's rows: the shard is not the weight's shape)."""
        if self._local_state_depth:
            return
        gw = getattr(module, "gtp", None)
        if self.size == 1 and gw is not None and gw.pad:
            raise GTPStateError(
                f"{what} of a GTP module ({type(module).__name__} {gw.name!r}) would label its fp8-block padded "
                f"shard ({gw.padded_out} rows) as the weight of {gw.out_features} rows; use "
                "lowband.parallel.gtp_state.GTPStateLayout(model, optimizer) for checkpoints or "
                "lowband.parallel.unsharded_copy(model) for a plain model")
        if self.size > 1:
            raise GTPStateError(
                f"{what} of a GTP module ({type(module).__name__} {getattr(module.gtp, 'name', '')!r}) would "
                f"label this rank's 1/{self.size} row shard as the whole weight (a mislabeled checkpoint, "
                "e.g. with torch.distributed.checkpoint's get_state_dict); use "
                "lowband.parallel.gtp_state.GTPStateLayout(model, optimizer) for checkpoints (DCP-ready, "
                "reshards across GTP sizes) or lowband.parallel.unsharded_copy(model) for a plain model")

    # ------------------------------------------------------------------------------ registration
    def register(self, full_weight: torch.Tensor, name: str, *, adopt: nn.Parameter | None = None) -> GTPWeight:
        """Shard ``full_weight [out, in]`` (same value on every rank) and return its :class:`GTPWeight`.

        ``adopt``: a user's ``nn.Parameter`` to become the shard (its ``.data`` re-pointed to the shard,
        its ``.grad`` dropped), so an optimizer built before sharding holds the shard. No collective.
        Raises ``ValueError`` if the shape breaks the fp8 block rule.
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
        if adopt is not None:
            param = adopt
            param.grad = None
            param.data = shard
        else:
            param = nn.Parameter(shard, requires_grad=full_weight.requires_grad)
        gw = GTPWeight(self, len(self.weights), name, param, out, inp, padded_out)
        if param.requires_grad:
            param.register_hook(_direct_read_hook(gw))
        param.gtp = gw  # GTP's own per-weight state (gather chain, buffers); the layout is the placement:
        place(param, Placement((out, inp), (Split("gtp", 0, self.size, self.rank, pad=padded_out - out,
                                                  group=self.comm),), name=name))
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
    def _wire_source(self, gw: GTPWeight, direction: str) -> torch.Tensor:
        """The shard as it goes on the wire. With ``cache_wire_shard`` a grad-enabled forward's quantized
        copy is kept for the backward re-gathers of the same pass (same parameter version and storage) and
        dropped at the pass's end (:meth:`end_pass`): a forward always quantizes what the parameter holds
        now, so writes the version counter does not see (``p.data.copy_(...)``, an optimizer that updates a
        flat buffer the parameter views, an EMA swap) are never missed."""
        fmt = self.options.gather_format
        p = gw.param.detach()
        if fmt == "native":
            return p
        key = (gw.param._version, p.data_ptr(), self.passes)
        if direction == "bwd" and gw._wire_key == key and gw._wire_src is not None:
            return gw._wire_src
        src = p.to(torch.bfloat16) if fmt == "bf16" else fp8_pack(p, self.options.fp8_block)
        if self.options.cache_wire_shard and direction == "fwd":
            gw._wire_src, gw._wire_key = src, key
        return src

    def _drop_wire_sources(self) -> None:
        for gw in self.weights:
            gw._wire_src, gw._wire_key = None, None

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
        src = self._wire_source(gw, direction)
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

    def _collective_message(self, gw: GTPWeight, direction: str, err: BaseException,
                            op: str = "all-gather") -> str:
        timeout = self.comm.timeout
        within = f", process-group timeout {timeout.total_seconds():g} s" if timeout is not None else ""
        return (f"GTP: the {op} of weight {gw.name!r} ({direction}) over group {self.comm.name!r} "
                f"(size {self.size}; lowband's private GTP process group{within}) failed: "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}. "
                "Every rank of the GTP group must run every forward and backward of a GTP model together; "
                "a forward on a subset of ranks (e.g. evaluation on rank 0 only while the others wait in a "
                "barrier), or a GTP layer used by some ranks only (a data-dependent branch), cannot gather "
                "sharded weights. Evaluate on every rank, or build a plain model with "
                "lowband.parallel.unsharded_copy(model) (called on every rank) and evaluate that alone; "
                "keep conditionally used layers replicated (shard_linears(..., include=...))")

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
                try:
                    g.handle.wait()
                except RuntimeError as e:
                    setattr(gw, attr, None)
                    raise GTPCollectiveError(self._collective_message(gw, g.direction, e)) from e
                self.cache.release(g.buf)
                setattr(gw, attr, None)

    def gather_for_inference(self, gw: GTPWeight) -> tuple[torch.Tensor, Callable[[], None]]:
        """On-demand synchronous gather outside the chain (``torch.no_grad`` forwards)."""
        self._finish_copy()
        gw.used = True
        return self._complete(self._issue_gather(gw, "eval", "eval", async_op=False))

    def state_gather(self, out: torch.Tensor, shard: torch.Tensor, what: str, tag: str = "gtp:state") -> None:
        """All-gather ``shard`` into ``out`` on the state group (:attr:`GTPOptions.state_timeout`); a
        rank that enters it alone gets one line of :class:`GTPCollectiveError` within that time."""
        try:
            self.state_comm.all_gather(out, shard, tag=tag)
        except RuntimeError as e:
            raise GTPCollectiveError(
                f"GTP: the state all-gather of {what} over group {self.comm.name!r} (size {self.size}) did "
                f"not complete within {self.options.state_timeout:g} s "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): unsharded_copy(model), "
                "GTPStateLayout.logical_state_dict() and full_weight() are collective, call them on every rank of "
                "the GTP group (then use the result on rank 0 alone); GTPOptions(state_timeout=...) sets "
                "the wait") from None

    def full_weight(self, gw: GTPWeight) -> torch.Tensor:
        """The logical (unpadded) full weight in the parameter dtype (a collective on the state group,
        tag "gtp:state"; fails within :attr:`GTPOptions.state_timeout` if a rank does not join)."""
        p = gw.param.detach()
        out = torch.empty(gw.padded_out, gw.in_features, dtype=p.dtype, device=p.device)
        self.state_gather(out, p.contiguous(), f"weight {gw.name!r}")
        return out[: gw.out_features].clone()

    # ------------------------------------------------------------------------------ forward
    def acquire_forward(self, gw: GTPWeight, x_requires_grad: bool
                        ) -> tuple[torch.Tensor, Callable[[], None], Hashable]:
        """Materialize ``gw`` for a forward GEMM and prefetch the next weight of the chain.

        Returns ``(weight [out, in], release, consume)``; ``consume`` is ``"main"`` for the first
        consume of ``gw`` in this pass, ``("x", k)`` for the k-th extra one.
        """
        self.cache.phase = "fwd"
        self._finish_copy()
        gw.used = True
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
        self._queue_end()

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
            true_div_(wbuf, self.size)  # true division on CUDA too (bitwise as on CPU)
        out = self.cache.get((gw.uid, "rs", consume), (gw.shard_rows, gw.in_features), p.dtype, "rs",
                             parity, p.device, "rs_out")
        is_head = main and gw.index == 0
        async_op = self.options.async_reduction and self.frozen and not is_head
        self._log("rs_issue", "bwd", gw, async_op)
        codec = self._grad_codec
        try:
            if codec is not None:  # the wgrad was pre-scaled by 1/N above: "sum" gives the mean
                handle = codec_reduce_scatter(self.comm, out, wbuf, codec, op="sum", async_op=async_op,
                                              tag="gtp:rs")
            else:
                handle = self.comm.reduce_scatter(out, wbuf, wire_dtype=self.options.grad_wire_dtype,
                                                  async_op=async_op, tag="gtp:rs")
        except RuntimeError as e:
            raise GTPCollectiveError(self._collective_message(gw, "bwd", e, "reduce-scatter")) from e
        self._fifo.append(_PendingRS(gw, handle, wbuf, out))
        limit = self.options.finalize_depth if async_op else 0
        while len(self._fifo) > limit:
            self._finalize(self._fifo.popleft())

    def _finalize(self, pend: _PendingRS) -> None:
        try:
            pend.handle.wait()
        except RuntimeError as e:
            raise GTPCollectiveError(self._collective_message(pend.gw, "bwd", e, "reduce-scatter")) from e
        p = pend.gw.param
        if p.grad is None:
            p.grad = pend.out.clone()
        else:
            p.grad.add_(pend.out)
        if self.options.share_nonfinite and self.size > 1:
            g = p.grad  # scanned now, while later reduce-scatters are in flight (see share_nonfinite)
            pend.gw._scan = (finite_probe(g), g, g._version)
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
        self._drop_wire_sources()
        self._fwd_seen.clear()
        self._bwd_done.clear()
        self._extra.clear()
        if not self.frozen and self.order:
            self.frozen = True
        self.passes += 1

    def _on_backward_end(self) -> None:
        """End of a backward: drain the reduce-scatters, then (as DDP does in every backward outside
        ``no_sync``) average the attached models' replicated gradients, with the GTP used flags, in one
        all-reduce (tag ``gtp:replicated``); record the gradients for :meth:`check_grad_edits`."""
        self._callback_queued = False
        self.end_pass()
        if self._models and not self._no_sync_depth:
            self._reduce_replicated(self.attached_replicated())
        elif not self._models:  # no end-of-backward all-reduce to carry the flags: refuse on this rank's own
            self._check_direct_reads([gw.read_direct for gw in self.weights])
        self.record_grads()
        for fn in self._post_drain_hooks:
            fn()

    def reset(self) -> None:
        """Forget the chain and all buffers (before rebuilding the model in-process)."""
        self.finalize_all()
        self._drop_wire_sources()
        self._fwd_seen.clear()
        self._bwd_done.clear()
        self._extra.clear()
        for gw in self.weights:
            gw.index = None
        self.order = []
        self.frozen = False
        self.cache.clear()


_RUNTIMES: weakref.WeakSet[GTPRuntime] = weakref.WeakSet()


def _queue_hook(runtime: GTPRuntime) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(runtime)

    def hook(p: torch.Tensor) -> None:
        rt = ref()
        if rt is not None:
            rt._after_accumulate(p)

    return hook


def _window_hook(runtime: GTPRuntime, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
    """Tensor hook of an attached replicated parameter (runs before autograd accumulates into its
    ``.grad``): :meth:`GTPRuntime._before_accumulate`. Weak references: the hook keeps neither alive."""
    rt_ref, p_ref = weakref.ref(runtime), weakref.ref(param)

    def hook(_grad: torch.Tensor) -> None:
        rt, p = rt_ref(), p_ref()
        if rt is not None and p is not None:
            rt._before_accumulate(p)

    return hook


def _direct_read_hook(gw: GTPWeight) -> Callable[[torch.Tensor | None], None]:
    """Gradient hook of a GTP shard (called with the gradient autograd is about to accumulate into it). GTP's
    own autograd functions return no gradient for the shard (the hook sees ``None``; the reduce-scattered
    gradient is added into ``.grad`` by the runtime), so a gradient here means a forward used the shard tensor
    itself: flag it, to be refused at the end of this backward."""
    ref = weakref.ref(gw)

    def hook(grad: torch.Tensor | None) -> None:
        w = ref()
        if w is not None and grad is not None:
            w.read_direct = True
            w.runtime._queue_end()

    return hook


def note_grads(params: Iterable[torch.Tensor]) -> None:
    """lowband code rewrote the ``.grad`` of ``params`` (a reduction, the global clip): refresh the
    records :meth:`GTPRuntime.check_grad_edits` and :mod:`lowband.parallel.tp_grads` compare against.
    No collective."""
    params = list(params)
    for rt in list(_RUNTIMES):
        if rt._grad_records:
            rt.record_grads(params)
    note_tp_grads(params)


_STAMP = "_lowband_gtp_shard"  # attribute of an optimizer state tensor of a GTP shard: (GTP rank, GTP size)


def _shard_states(optimizer: torch.optim.Optimizer) -> Iterator[tuple[GTPWeight, torch.Tensor]]:
    """``(weight, state tensor)`` for every tensor in ``optimizer.state`` of a GTP shard it holds."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            gw = getattr(p, "gtp", None)
            if gw is None:
                continue
            st = state.get(p)  # .get: never adds an entry to torch's defaultdict
            if isinstance(st, dict):
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        yield gw, v


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, on every rank, optimizer state of GTP shards that another GTP rank made (nanoGPT's resume).

    The state tensors of a GTP shard (AdamW's moments: this rank's rows only) carry a Python attribute
    ``_lowband_gtp_shard = (GTP rank, GTP size)``, set after each ``step()`` (and on a tensor that has
    none, e.g. from DCP / :class:`~lowband.parallel.gtp_state.GTPStateLayout`). ``opt.state_dict()``
    hands out those tensors, and ``torch.save`` / ``torch.load`` (``weights_only`` too) and
    ``copy.deepcopy`` keep the attribute; ``opt.load_state_dict`` keeps the loaded tensor when its
    dtype and device already fit. Torch optimizers never read it.

    Before a step, a tensor whose stamp is this runtime's own object was checked before: nothing to
    do (the steady state; no collective). A stamp that is only *equal* (or different) comes from a
    loaded state: its GTP group then runs one all-reduce (MAX, 3 int64: "a stamp here is another
    rank's or GTP size's", that rank + 1, that size; tag ``"gtp:optim_state"``) on the runtime's state
    group, so every rank refuses alike with :class:`GTPStateError`, before anything steps; a rank
    that loaded alone fails within :attr:`GTPOptions.state_timeout` (a
    :class:`GTPCollectiveError`). One such all-reduce per GTP group at the first step after each
    ``load_state_dict`` of a pickled or copied state; never otherwise.

    Not detected: a state whose tensors lost the attribute (``load_state_dict`` moving them to another
    device or dtype, a ``.clone()`` / ``.to()`` by the user before loading, a format other than pickle),
    and state tensors an optimizer replaces with new ones inside ``step()`` after an unstamped load.
    """
    pending: dict[int, list] = {}
    for gw, t in _shard_states(optimizer):
        rt = gw.runtime
        live = rt._optim_stamp
        stamp = t.__dict__.get(_STAMP)
        if stamp is live:
            continue
        if stamp is None:  # fresh, or loaded through DCP: nothing says it is another rank's
            setattr(t, _STAMP, live)
            continue
        entry = pending.setdefault(id(rt), [rt, None, [], gw.param.device])  # not a state's: "step" may be on CPU
        if entry[1] is None and tuple(stamp) != live:
            entry[1] = tuple(stamp)
        entry[2].append(t)
    for rt, foreign, tensors, device in pending.values():
        verdict = [0, 0, 0] if foreign is None else [1, int(foreign[0]) + 1, int(foreign[1])]
        if rt.size > 1:
            buf = torch.tensor(verdict, dtype=torch.int64, device=device)
            try:
                rt.state_comm.all_reduce(buf, "max", tag="gtp:optim_state")
            except RuntimeError as e:
                raise GTPCollectiveError(
                    f"GTP: optimizer.step() after load_state_dict: the check of the loaded optimizer state "
                    f"over group {rt.comm.name!r} (size {rt.size}) did not complete within "
                    f"{rt.options.state_timeout:g} s ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                    "every rank of the GTP group must load its optimizer state and step together; "
                    "GTPOptions(state_timeout=...) sets the wait") from None
            verdict = [int(v) for v in buf.tolist()]
        if verdict[0]:
            raise GTPStateError(
                f"GTP: optimizer.step(): the optimizer state of the GTP shards was loaded from a state_dict() "
                f"made on GTP rank {verdict[1] - 1} of {verdict[2]} by at least one rank of this group of "
                f"{rt.size} (e.g. nanoGPT's resume: rank 0 saves its opt.state_dict(), every rank loads it), "
                "so that rank would step with another rank's rows of the moments; save and load each rank's "
                "own opt.state_dict() (one file per rank, the same GTP size), or checkpoint with "
                "lowband.parallel.gtp_state.GTPStateLayout(model, opt) and torch.distributed.checkpoint "
                "(reshardable)")
        for t in tensors:
            setattr(t, _STAMP, rt._optim_stamp)


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before every ``optimizer.step()``: refuse optimizer state of GTP shards loaded from another rank's
    state dict (:func:`_check_optimizer_state`), and gradients of GTP models edited outside lowband."""
    if not _RUNTIMES:
        return
    _check_optimizer_state(optimizer)
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for rt in list(_RUNTIMES):
        rt.check_unfrozen(ids)
        if rt._grad_records:
            rt.check_grad_edits(ids)


def _step_post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After every ``optimizer.step()``: stamp the state tensors of GTP shards made by this step, and
    forget the gradient records of its parameters (they served this step; a later ``.grad`` that no
    backward wrote, e.g. the zeros of DCP's ``get_state_dict`` initializing a fresh optimizer, is not
    an edit of a reduced gradient)."""
    if not _RUNTIMES:
        return
    for gw, t in _shard_states(optimizer):
        if _STAMP not in t.__dict__:
            setattr(t, _STAMP, gw.runtime._optim_stamp)
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for rt in list(_RUNTIMES):
        if rt._grad_records:
            rt._grad_records = [r for r in rt._grad_records if id(r[0]) not in ids]


register_optimizer_step_pre_hook(_step_pre_hook)
register_optimizer_step_post_hook(_step_post_hook)


class _GTPLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` gathered just in time; saves only ``x`` and the shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, bias: torch.Tensor | None,
                gw: GTPWeight, x_requires_grad: bool, cast: torch.dtype | None = None) -> torch.Tensor:
        rt = gw.runtime
        weight, release, consume = rt.acquire_forward(gw, x_requires_grad)
        try:
            if cast is None:
                y = F.linear(x, weight, bias)
            else:  # under autocast: what F.linear does there (inputs, weight and bias in the cast dtype)
                with torch.autocast(x.device.type, enabled=False):
                    y = F.linear(x.to(cast), weight.to(cast), None if bias is None else bias.to(cast))
        finally:
            release()
        ctx.cast = cast
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
        cast = ctx.cast
        dy2 = dy.reshape(-1, gw.out_features)
        x2 = x.reshape(-1, gw.in_features)
        if cast is not None:  # the GEMMs of F.linear's backward under autocast, in the cast dtype
            dy2, x2 = dy2.to(cast), x2.to(cast)
        dx = None
        if ctx.needs_input_grad[0]:
            weight, release = rt.acquire_backward(gw, ctx.consume)
            rt.prefetch_backward(gw, ctx.consume)
            try:
                dx = dy2.mm(weight if cast is None else weight.to(cast)).view(x.shape).to(x.dtype)
            finally:
                release()
            rt._log("dgrad_done", "bwd", gw)
        else:
            rt.prefetch_backward(gw, ctx.consume)
        db = dy2.sum(0) if ctx.needs_input_grad[2] else None
        if db is not None and cast is not None:
            db = db.to(_shard.dtype)
        if ctx.needs_input_grad[1]:
            if cast is None:
                rt.reduce_weight_grad(gw, lambda rows: torch.mm(dy2.t(), x2, out=rows), ctx.consume)
            else:
                rt.reduce_weight_grad(gw, lambda rows: rows.copy_(torch.mm(dy2.t(), x2)), ctx.consume)
        return dx, None, db, None, None, None


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
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 _adopt: nn.Linear | None = None) -> None:
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
        self.gtp = runtime.register(weight, name or f"gtp{len(runtime.weights)}",
                                    adopt=None if _adopt is None else _adopt.weight)
        self.weight = self.gtp.param
        _guard_state(self)
        if _adopt is not None and _adopt.bias is not None:
            self.bias = _adopt.bias  # the user's own bias object (replicated, unchanged)
        elif bias:
            if bias_init is None:
                bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                bias_init = torch.empty(out_features, device=weight.device,
                                        dtype=weight.dtype).uniform_(-bound, bound)
            self.bias = nn.Parameter(bias_init.detach().clone())
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, runtime: GTPRuntime, name: str = "", *,
                    adopt: bool = False) -> GTPLinear:
        """A GTP copy of ``linear`` (same values and ``requires_grad`` of weight and bias; ``linear``
        itself is left untouched), or with ``adopt=True`` (what :func:`shard_linears` does) a GTP layer
        that keeps ``linear``'s own ``Parameter`` objects: the weight's ``.data`` becomes this rank's
        shard and the bias is shared, so an optimizer built before sharding trains them (``linear``
        must not be used afterwards).

        A frozen weight (``requires_grad=False``) becomes a frozen shard: its backward still gathers
        it for the input gradient (dgrad) when the input needs one, but computes no weight gradient
        and issues no reduce-scatter; it never gets a ``.grad``."""
        mod = cls(linear.in_features, linear.out_features, runtime, bias=linear.bias is not None,
                  name=name, weight=linear.weight.detach(),
                  bias_init=None if linear.bias is None else linear.bias.detach(),
                  _adopt=linear if adopt else None)
        mod.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            mod.bias.requires_grad_(linear.bias.requires_grad)
        return mod

    @opaque
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``; opaque to ``torch.compile`` (a graph break: see the module docstring)."""
        dev = x.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            with torch.autocast(dev, enabled=False):
                return _GTPLinearFunction.apply(x, self.weight, self.bias, self.gtp, x.requires_grad, cast)
        weight, release = self.runtime.gather_for_inference(self.gtp)
        try:
            return F.linear(x, weight, self.bias)
        finally:
            release()

    def lowband_dense(self) -> nn.Linear:
        """The plain ``nn.Linear`` with the whole weight (collective over the GTP group; see
        :mod:`lowband.parallel.dense`)."""
        w = self.runtime.full_weight(self.gtp)
        return dense_linear(w, None if self.bias is None else self.bias.detach(), self.weight)

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
                 dtype: torch.dtype | None = None, _adopt: nn.Parameter | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.runtime = runtime
        if weight is None:
            weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            nn.init.normal_(weight)
        elif tuple(weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"GTPEmbedding {name!r}: weight shape {tuple(weight.shape)} != "
                             f"({num_embeddings}, {embedding_dim})")
        self.gtp = runtime.register(weight, name or f"gtp{len(runtime.weights)}", adopt=_adopt)
        self.weight = self.gtp.param
        _guard_state(self)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, runtime: GTPRuntime, name: str = "", *,
                       adopt: bool = False) -> GTPEmbedding:
        """A GTP copy of a plain ``emb`` (raises ``ValueError`` for the unsupported options); with
        ``adopt=True`` (what :func:`shard_embeddings` does) ``emb.weight`` itself becomes the shard."""
        if (emb.padding_idx is not None or emb.max_norm is not None or emb.sparse
                or emb.scale_grad_by_freq):
            raise ValueError(f"GTPEmbedding {name!r}: padding_idx, max_norm, sparse and "
                             "scale_grad_by_freq are not supported; leave this embedding replicated")
        mod = cls(emb.num_embeddings, emb.embedding_dim, runtime, name=name, weight=emb.weight.detach(),
                  _adopt=emb.weight if adopt else None)
        mod.weight.requires_grad_(emb.weight.requires_grad)
        return mod

    @opaque
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``W[idx]``; opaque to ``torch.compile`` (a graph break: see the module docstring)."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _GTPEmbeddingFunction.apply(idx, self.weight, self.gtp)
        weight, release = self.runtime.gather_for_inference(self.gtp)
        try:
            return F.embedding(idx, weight)
        finally:
            release()

    def lowband_dense(self) -> nn.Embedding:
        """The plain ``nn.Embedding`` with the whole table (collective over the GTP group)."""
        return dense_embedding(self.runtime.full_weight(self.gtp), self.weight)

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
    comm = sync_comm.private("gtp") if sync_comm is not None else runtime.comm  # lowband's own group

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
    done = _replace_modules(model, nn.Embedding,
                            lambda m, name: GTPEmbedding.from_embedding(m, runtime, name=name, adopt=True),
                            include, tied, "shard_embeddings", lambda m, name: _check_embedding(runtime, m, name),
                            _agree(model, runtime, init_sync, sync_comm))
    runtime.attach(model)
    return done


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
    parameters at the end of every backward, as data parallelism would) or refused by name
    (``tied="error"``).

    Initial weights: the shards are cut from the model each rank holds, so every rank of the group
    must hold the same model. ``init_sync=True`` (default) broadcasts every parameter and floating
    buffer from rank 0 of ``sync_comm`` (default: the GTP group; pass the world's ``Comm`` when there
    is data parallelism across GTP groups too); ``init_sync=False`` verifies them with one checksum
    exchange and raises ``ValueError`` on every rank if they differ. Every check (tied weights, fp8
    block rule) runs before that collective, on every rank alike.
    """
    done = _replace_modules(model, nn.Linear, lambda m, name: GTPLinear.from_linear(m, runtime, name=name, adopt=True),
                            include, tied, "shard_linears", lambda m, name: _check_weight(runtime, m.weight, name),
                            _agree(model, runtime, init_sync, sync_comm))
    runtime.attach(model)
    return done


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
                 wire_dtype: torch.dtype | str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """One coalesced all-reduce (per dtype) of the ``.grad`` of ``params`` over ``comm``, with
    PyTorch's semantics for parameters that got no gradient.

    As ``DistributedDataParallel(find_unused_parameters=True)`` followed by a ``torch.optim``
    optimizer: a parameter whose ``.grad`` is ``None`` on some ranks contributes zeros there and every
    rank gets the reduced gradient; a parameter whose ``.grad`` is ``None`` on *every* rank keeps
    ``.grad = None``, so the optimizer skips it (no moment decay, no weight decay, no step count).
    Parameters with ``requires_grad=False`` are left out.

    Communication: one all-reduce per parameter dtype (``op``: ``avg`` or ``sum``; ``wire_dtype``
    as :meth:`Comm.all_reduce`), tag ``tag``, whose buffer is the flat gradients followed by one
    *used* flag per parameter (``1`` if this rank has a ``.grad``): ``sum(numel) + len(params)``
    elements. Every rank must pass the same parameters in the same order.

    ``wire_dtype="fp8"`` / ``"int8"``: the gradients travel block-scaled (``block_size`` elements per
    fp32 scale) through :func:`lowband.comm.codecs.codec_all_reduce` (one all-to-all and one all-gather
    of encoded chunks, fp32 sums in rank order, both tagged ``tag``; every rank decodes the same bytes, so
    the reduced gradients agree bitwise), and the used flags travel exactly, in a float32 all-reduce of
    their own (tag ``tag + ":flags"``, issued first and overlapped with the codec's exchange).
    """
    codec = get_codec(wire_dtype, block_size=block_size) if isinstance(wire_dtype, str) else None
    _reduce_grads(comm, params, op, tag=tag, wire_dtype=None if codec else wire_dtype, codec=codec)  # type: ignore[arg-type]


def _reduce_grads(comm: Comm, params: Iterable[torch.Tensor], op: str, *, tag: str,
                  wire_dtype: torch.dtype | None, extra_flags: list[bool] | None = None,
                  extra_tensor: torch.Tensor | None = None, codec: Codec | None = None,
                  plan: dict[int, tuple[torch.Tensor | None, torch.Tensor]] | None = None,
                  ) -> tuple[list[bool], list[bool], list[bool]] | None:
    """:func:`reduce_grads`; ``extra_flags`` (one bool per item, this rank's) and ``extra_tensor`` (a 1-D
    tensor of 0/1 flags, this rank's, left on its device: no host sync before the collective) travel
    in the first dtype's all-reduce too. With no trainable parameter, an ``extra_tensor`` still travels
    (with ``extra_flags``) in an all-reduce of the flags alone (float32); without one nothing is sent.
    With a ``codec`` (block-scaled, see :func:`reduce_grads`) the gradients go through
    :func:`~lowband.comm.codecs.codec_all_reduce` and every flag through an exact float32 all-reduce of its own.
    Returns ``(mixed, anywhere, set_anywhere)``: per extra flag whether it was set on some ranks but not all,
    per element of ``extra_tensor`` whether it was set on any rank, and per extra flag whether it was set on any
    rank; or ``None`` if no all-reduce ran.

    ``plan`` (GTP's sum mode, :meth:`GTPRuntime._reduce_replicated`): ``{id(p): (send, base)}`` for parameters
    whose ``.grad`` holds an earlier reduction's result ``base``: ``send`` (the contributions since, or ``None``:
    none, used flag 0) travels instead of ``.grad``, and ``.grad`` becomes ``base`` plus the reduced value
    (``base`` itself, added into in place; left as ``base`` when no rank sent anything). The collective is
    the same (the same parameters in the same order)."""
    params = [p for p in params if p.requires_grad]
    plan = plan or {}

    def sent(p: torch.Tensor) -> torch.Tensor | None:
        return plan[id(p)][0] if id(p) in plan else p.grad

    if not params and extra_tensor is None:
        return None
    dtypes = sorted({p.dtype for p in params}, key=str) or [torch.float32]
    n_tensor = 0 if extra_tensor is None else extra_tensor.numel()
    mixed: list[bool] = []
    anywhere: list[bool] = []
    set_anywhere: list[bool] = []
    for di, dtype in enumerate(dtypes):
        group = [p for p in params if p.dtype == dtype]
        first = di == 0
        extra = list(extra_flags or []) if first else []
        flags = [sent(p) is not None for p in group] + extra
        n_t = n_tensor if first else 0
        numel = sum(p.numel() for p in group)
        device = group[0].device if group else extra_tensor.device  # type: ignore[union-attr]
        flat = torch.empty(numel + len(flags) + n_t, dtype=dtype, device=device)
        off = 0
        for p in group:
            n = p.numel()
            g = sent(p)
            if g is None:
                flat[off:off + n].zero_()
            else:
                flat[off:off + n].copy_(g.reshape(-1))
            off += n
        if flags:
            flat[numel:numel + len(flags)].copy_(torch.tensor(flags, dtype=dtype))
        if n_t:
            flat[numel + len(flags):].copy_(extra_tensor)  # type: ignore[arg-type]
        if codec is None:
            comm.all_reduce(flat, op, wire_dtype=wire_dtype, tag=tag)
            wire = wire_dtype or dtype
            got = flat[numel:].tolist()
        else:  # the flags exactly, beside the codec's exchange of the gradients
            flag_buf = flat[numel:].to(torch.float32)
            pending = comm.all_reduce(flag_buf, op, async_op=True, tag=f"{tag}:flags") if flag_buf.numel() else None
            if numel:
                codec_all_reduce(comm, flat[:numel], codec, op=op, tag=tag)
            if pending is not None:
                pending.wait()
            wire = torch.float32
            got = flag_buf.tolist()
        # A flag reduces to exactly 0 when no rank set it (zeros stay zeros under any wire dtype);
        # set on every rank it reduces to N (sum) or 1 (avg), both exact in the wire dtype used here
        # when N is (bf16: N <= 256), the reduced value rounded like the flag went on the wire.
        full = float(comm.size if op == "sum" else 1)
        full = float(torch.tensor(full, dtype=torch.float64).to(wire).to(torch.float64))
        used = [g != 0.0 for g in got[: len(group)]]
        if first:
            mixed = [g != 0.0 and g != full for g in got[len(group):len(flags)]]
            set_anywhere = [g != 0.0 for g in got[len(group):len(flags)]]
            anywhere = [g != 0.0 for g in got[len(flags):]]
        off = 0
        for p, u in zip(group, used, strict=True):
            n = p.numel()
            base = plan[id(p)][1] if id(p) in plan else None
            if u:
                g = flat[off:off + n].view_as(p)
                if base is not None:  # the earlier reduction's result plus this one's
                    p.grad = base.add_(g)
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            elif base is not None:
                p.grad = base
            off += n
    note_grads(params)
    return mixed, anywhere, set_anywhere


def sync_replicated_grads(runtime: GTPRuntime, model: nn.Module) -> None:
    """Kept for existing scripts; a no-op for a model GTP already reduces in backward.

    GTP averages the replicated parameters' gradients itself at the end of every backward, as DDP does
    (see :meth:`GTPRuntime.attach`; :func:`shard_linears` / :func:`shard_embeddings` attach the model),
    so after ``backward()`` returns there is nothing left to do and this call sends nothing. For a
    model built from :class:`GTPLinear` layers directly and never attached, it attaches ``model`` (later
    backwards reduce by themselves) and reduces this backward's gradients now: one all-reduce (tag
    ``gtp:replicated``) with :func:`reduce_grads`' semantics for ``None`` grads, carrying one flag per
    GTP weight (consumed by a grad-enabled forward on this rank): a GTP weight consumed by some ranks
    of the group but not all raises :class:`GTPCollectiveError` on every rank, naming it.
    """
    covered = {id(p) for p in runtime.attached_replicated()}
    if all(id(p) in covered for p in replicated_params(model)):
        return
    runtime.attach(model)
    runtime._reduce_replicated(replicated_params(model))


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
