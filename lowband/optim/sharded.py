"""ZeRO-style sharded data-parallel optimizer: AdamW and Muon that reduce-scatter gradients, update
only the slice each rank owns, and all-gather the updated parameters, overlapped with backward.

Communication pattern (per step, per unit, N = data-parallel world size; see
:mod:`lowband.optim.buckets` for the layout):

0. **Construction.** One ``all_gather_object`` (``tag="validate"``) checks that shapes and settings
   agree; then ``init_sync=True`` (default) broadcasts rank 0's parameters (one broadcast per unit of
   its flat parameter buffer, one coalesced broadcast per dtype of frozen parameters and, with
   ``module=``, of the module's other parameters and buffers; ``tag="init_sync"``), or
   ``init_sync="verify"`` all-gathers one integer checksum per tensor and raises naming the first
   tensor that differs.

1. **Backward.** A post-accumulate-grad hook per parameter copies ``p.grad`` into its unit's flat
   gradient buffer. When every member of a unit has been copied, and every earlier unit has been
   launched, the unit's ``reduce_scatter(op="avg", wire_dtype=fp32|bf16, async_op=True, tag="grad:*")``
   starts, so it overlaps the rest of backward. Units launch strictly in unit order on every rank,
   so all ranks issue the same collectives in the same order whatever their gradients.
2. **step().** Units not launched yet (a member got no gradient on this rank, or gradients were
   produced under :meth:`ShardedOptimizer.no_sync`) are launched in unit order: a member's slot
   takes ``p.grad`` if it exists, zeros otherwise. Every reduce-scatter is waited for, then one
   ``all_reduce(op="max", tag="grad_used")`` of a ``uint8`` level per parameter, 8 bytes per param group (a
   4-byte digest of its hyperparameters and its complement, so MAX gives every byte's largest and smallest
   value: ranks that step with another lr or weight decay, a scheduler stepped on rank 0 only, are refused
   with ``ValueError`` on every rank before any update) plus 4 bytes (see *Missing gradients* and *Habits*
   below) agrees, before any update, on who used what and on what to refuse. Then, unit by unit in forward
   order (the unit holding the earliest parameter of ``module``'s registration order first, or of the flat
   parameter order without ``module``): update
   the owned slice (AdamW on a flat shard; Muon on whole owned matrices), launch
   ``all_gather(async_op=True, tag="param:*")`` of the updated slice straight into the flat
   parameter buffer, and move on while it is in flight. AdamW and Muon units share one loop, so
   their communication overlaps instead of running one kind after the other, and the first layers'
   parameters arrive first for the next forward.
3. **Next forward.** ``param_gather="step"`` (default) waits for every all-gather at the end of
   ``step()``. ``param_gather="forward"`` (needs ``module=``) returns from ``step()`` with the gathers
   in flight and waits per unit in a forward pre-hook of each module that owns a member directly,
   i.e. just before first use; the next ``step()``, ``state_dict()``, :meth:`wait_for_params` and
   ``module``'s (or any submodule's) ``state_dict()`` / ``load_state_dict()`` also wait. Code that reads or
   writes the parameters directly right after ``step()`` (an EMA update, ``p.copy_``) calls
   :meth:`wait_for_params` first. A parameter read outside the forward of a module that owns it
   (``self.wpe.weight[:T]``, another module's weight passed to ``F.linear``) is spotted in backward, when it
   gets a gradient and none of its owners ran: its unit is then waited for by a pre-hook of ``module``
   itself, at the start of every forward. Reads of that kind present from the first step are learned there
   (nothing is in flight then) and are exact; one that first appears while its all-gather is in flight is refused by
   the next ``step()`` on every rank (its gradients may come from half-gathered values). A parameter
   read before its own module runs in the same forward: each wait of an in-flight gather bumps its
   parameters' autograd versions, so where autograd saved the read (``F.linear`` of an input that needs
   a gradient) backward fails autograd's "modified by an inplace operation" check. Not seen: such a
   read that autograd does not save (an addition), or reads under ``no_grad`` only; use ``"step"`` for
   such models.

Bytes per rank per step (ring model): reduce-scatter ``(N-1)/N * numel * grad_wire_esize`` plus
all-gather ``(N-1)/N * numel * param_wire_esize`` per unit: the same as one all-reduce in fp32, 0.75x
of it with bf16 gradients, 0.5x with bf16 gradients and bf16 parameter gathers; plus the flags
all-reduce, ``2(N-1)/N * F`` bytes for ``F`` = parameters in the optimizer (frozen ones included) + 8 per
param group + 4 (none on one rank). Optional clipping adds one all-reduce of one scalar, issued in flight
together with the flags all-reduce (no round trip of its own; see :meth:`ShardedOptimizer.clip_grad_norm`).

State layout per rank: AdamW ``exp_avg``/``exp_avg_sq`` of ``numel / N`` elements per bucket (the
owned shard, accumulation dtype: fp32, or fp64 for fp64 parameters) plus ``steps``, one integer step
count per member (torch's per-parameter ``step``; every rank keeps all of them); Muon a
``momentum_buffer`` ``[real_owned, rows, cols]`` per unit; ``master`` (fp32 copy of the owned slice)
where parameters travel or are stored narrower than fp32; with ``grad_error_feedback``, a residual per unit
(fp32, the unit's whole size, this rank's own: in no state dict, zero after any load). ``self.state`` is keyed
by unit index;
:meth:`ShardedOptimizer.state_dict` presents it per parameter as ``Shard(0)`` DTensors for torch DCP
(one all-to-all per unit between owners and ``Shard(0)`` holders, :mod:`lowband.optim.sharded_exchange`),
:class:`lowband.optim.sharded_state.ShardedStateLayout` per parameter as rank-local chunks
(no gather), :meth:`ShardedOptimizer.shard_state_dict` as the raw shard.
Parameters become views into the flat parameter buffers (``p.data`` is re-pointed at construction),
so the all-gather writes the parameters in place; gradients stay in ``p.grad`` (local, not averaged;
the averaged, possibly clipped, gradient lives in the owned shard).

Gradient accumulation: wrap every microbatch's backward but the last in ``with opt.no_sync():`` (or set
``opt.require_backward_grad_sync = False``); hooks then do nothing and ``p.grad`` accumulates as
usual; the last backward (outside ``no_sync``) launches the reduce-scatters. If the last one is also
inside ``no_sync``, ``step()`` still reduces everything, without overlap.

Habits (issue 27; docs/sharded_optim.md "Habits"). What a script does through torch's API is exact or
refused at the next :meth:`~ShardedOptimizer.clip_grad_norm` / :meth:`~ShardedOptimizer.step` on every
rank alike, with one line: the hook records each ``p.grad`` and its ``_version`` when it copies it, and
the check compares every bit of ``p.grad`` with the copy (an edit through ``.data`` bumps no version), so
torch's ``clip_grad_norm_`` / ``clip_grad_value_`` (or any edit of ``.grad``) after backward is refused
(use :meth:`~ShardedOptimizer.clip_grad_norm`); ``torch.amp.GradScaler`` is exact (``unscale_``'s
power-of-two factor is spotted on ``p.grad`` and applied to the reduced shards, ``step(grad_scaler=)``
skips on a global inf/NaN and writes the global ``found_inf`` back into the scaler); a parameter whose
storage left the flat buffer with dtype and shape unchanged (``p.data = p.data * 0.9``) is re-adopted
(values copied in, ``p.data`` re-pointed), another dtype or shape (``model.to(dtype)``) is refused;
``state_dict()``'s DTensors carry the rank that made them and :meth:`~ShardedOptimizer.load_state_dict`
refuses another rank's (the nanoGPT resume); the state collectives run on a group with timeout
``state_timeout`` (60 s), so a call made by some ranks only ends with one line; a torch lr scheduler
attached to the optimizer turns the Muon/AdamW lr-ratio check off.

Missing gradients (``torch.optim`` + DDP ``find_unused_parameters=True`` semantics). A parameter
counts as used on a rank when ``p.grad is not None`` at ``step()`` (or its hook copied a gradient).
Used on at least one rank: averaged with zeros from the others. Used on no rank: untouched, as
``torch.optim`` leaves a parameter whose grad is ``None``: no moment decay, no weight decay, no step
count (AdamW steps are per member, each member's bias correction uses its own step), Muon momentum not
decayed and the matrix not updated; sparse tables the same. The global knowledge is DDP's: each step
every rank all-reduces (MAX) a ``uint8`` vector, one level per unit member, then one flag per parameter
left out of the units, then 8 bytes per param group (its hyperparameters' digest and complement) and 4 more
(GradScaler factor, inf flag, late-copy flag), after the last reduce-scatter completed (so at the same place on
every rank) and before any update; on one rank nothing is sent. AdamW runs one fused update over the
owned shard when every member was used with equal steps, otherwise one per run of adjacent used
members with equal steps. Frozen parameters (``requires_grad=False`` at construction) are left out of
every unit and never updated; frozen later, they get no gradient and are untouched; unfrozen later
(their flag is set), ``step()`` raises ``ValueError`` naming the parameter on every rank alike, before
any update. With ``lr = 0`` and zero gradients a step changes no parameter (checkpoint loaders rely on this).
Parameters written in place between steps (``model.load_state_dict`` to roll back, ``p.mul_`` under ``no_grad``)
are where the next step starts, also with an fp32 master: elements that no longer hold the master's rounding
take the written value (:meth:`ShardedOptimizer._adopt_edits`, one compare of the owned slice per step).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lowband.comm import Comm, CommHandle, all_finite
from lowband.comm.codecs import DEFAULT_BLOCK_SIZE, Codec, codec_reduce_scatter, get_codec, reduce_scatter_error
from lowband.optim.adamw import adamw_update_, validate_adamw_hparams
from lowband.optim.buckets import (
    ParamSpec,
    UnitLayout,
    layout_id,
    order_units,
    plan_adamw_buckets,
    plan_muon_units,
)
from lowband.optim.muon import muon_update_, validate_muon_hparams
from lowband.optim.sharded_exchange import load_shard0, owned_master, shard0_ready, to_shard0
from lowband.optim.sparse_rows import (
    SparseTable,
    SparseTableUnit,
    check_untied,
    plan_row_units,
    refuse_renormed_embeddings,
    validate_sparse_tables,
)

ALGORITHMS = ("adamw", "muon")
PARAM_GATHER = ("step", "forward")
UNIMPLEMENTED_ADAMW = ("amsgrad", "maximize")
"""``torch.optim.AdamW`` group options that change the update and are refused when true."""
EXCHANGES = {"ring": "sharded", "p2p": "sharded-p2p"}
"""``exchange=`` choices and the private ``Comm`` purpose each runs on (``lowband.comm.comm.RING_PURPOSES``)."""
INIT_SYNC = (True, False, "verify")
_PROBE = 64  # evenly spaced elements of a changed gradient where GradScaler's unscale factor is read (_probe_scale)
_LEVEL_USED, _LEVEL_GRAD_CHANGED, _LEVEL_STORAGE, _LEVEL_READ_IN_FLIGHT = 1, 2, 3, 4  # per-member flag levels (MAX)
_HYPER_BYTES = 4  # bytes of each param group's hyperparameter digest in the per-step flags


def hyperparameter_digest(groups: list[dict[str, Any]]) -> list[int]:
    """``_HYPER_BYTES`` bytes per param group: a digest of its hyperparameters (every key but ``params`` whose
    value is a number, bool, string, None, a tuple of numbers or a one-element tensor, by exact ``repr``)."""
    out: list[int] = []
    for g in groups:
        items = []
        for k in sorted(g):
            v = g[k]
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = float(v)
            if v is None or isinstance(v, (bool, int, float, str)) or (
                    isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)):
                items.append((k, v))
        out += list(hashlib.blake2b(repr(items).encode(), digest_size=_HYPER_BYTES).digest())
    return out
LR_RATIO_RTOL = 1e-6  # a schedule multiplies every lr by one factor: ratios agree to rounding (~1e-16)
GRAD_WIRE_DTYPES = (None, torch.float32, torch.bfloat16)
GRAD_CODECS = ("fp8", "int8")  # grad_wire_dtype names sent block-scaled (lowband.comm.codecs)
_WIRE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
               "bfloat16": torch.bfloat16}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None).memcmp
    except (AttributeError, OSError):  # no C library symbols in this process (not Linux/macOS)
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _load_memcmp()
"""libc ``memcmp``: compares two CPU buffers at memory speed (about 2x ``torch.equal`` on integer views)."""


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` (same numel and dtype) hold the same bits (NaNs included), compared as integers."""
    if a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    if _MEMCMP is not None and a.device.type == "cpu" and b.device.type == "cpu" and a.is_contiguous() \
            and b.is_contiguous():
        n = a.numel() * a.element_size()
        return n == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    bits = _BITS[a.element_size()]
    return torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """Order-independent integer checksum of a tensor's bits (equal bits give equal sums on any CPU or
    GPU: integer sums wrap exactly, whatever the reduction order), plus its numel."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        bits = flat.to(torch.int64)
    else:
        bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) * 2654435761 % 1000003 + 1
    return int((bits * weights).sum()), flat.numel()


class _Unit:
    """Runtime buffers and per-step flags of one communication unit."""

    def __init__(self, layout: UnitLayout, params: list[torch.Tensor]) -> None:
        self.layout = layout
        self.params = params
        dev, dt = layout.device, layout.dtype
        self.grad_buf = torch.zeros(layout.numel, dtype=dt, device=dev)
        self.param_buf = torch.zeros(layout.numel, dtype=dt, device=dev)
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=_acc_dtype(dt), device=dev)
        with torch.no_grad():
            for m, p in zip(layout.members, params, strict=True):
                view = self.param_buf[m.offset:m.offset + m.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(m.shape)
        self.reset()

    def reset(self) -> None:
        self.copied = [False] * len(self.params)
        self.n_copied = 0
        # the p.grad tensor each member's slot was copied from, and its version counter then: a later
        # in-place edit (torch's clip_grad_norm_ / clip_grad_value_) or rebinding is seen at step()
        self.grad_ref: list[torch.Tensor | None] = [None] * len(self.params)
        self.grad_ver = [0] * len(self.params)
        self.bad = [False] * len(self.params)  # p.grad's dtype or size no longer fits the slot
        self.launched = False
        self.rs: CommHandle | None = None
        self.reduced = False

    def grad_slot(self, i: int) -> torch.Tensor:
        m = self.layout.members[i]
        return self.grad_buf[m.offset:m.offset + m.numel]

    def param_view(self, i: int) -> torch.Tensor:
        m = self.layout.members[i]
        return self.param_buf[m.offset:m.offset + m.numel].view(m.shape)

    @torch.no_grad()
    def copy_grad(self, i: int, p: torch.Tensor) -> None:
        """Copy ``p.grad`` into member ``i``'s slot and remember which tensor, at which version."""
        g = p.grad
        assert g is not None
        slot = self.grad_slot(i)
        if g.numel() != slot.numel() or g.dtype != slot.dtype:  # storage changed: refused at step()
            slot.zero_()
            self.bad[i] = True
        else:
            slot.copy_(g.reshape(-1))
        self.grad_ref[i] = g
        self.grad_ver[i] = g._version


class ShardedOptimizer(torch.optim.Optimizer):
    """Sharded data-parallel AdamW and/or Muon (one ``torch.optim.Optimizer``); see module docstring.

    Each param group has ``algorithm`` ``"adamw"`` (keys ``lr``, ``betas``, ``eps``, ``weight_decay``)
    or ``"muon"`` (keys ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_method``,
    ``ns_steps``, ``ns_dtype``; 2-D parameters only). Hyperparameters are read from the group at step
    time, so LR schedulers work. Groups cannot be added after construction.

    **Per-group lr.** Every group's ``lr`` is its own: a Muon group's ``lr`` is Muon's (typically
    ~0.02), an AdamW group's is AdamW's (typically ~3e-4). Scale them together (``LambdaLR``, or
    ``g["lr"] = opt.base_lrs[i] * factor``). When Muon and AdamW groups are mixed, :meth:`step` raises
    ``ValueError`` (before any collective) if the groups' lrs no longer keep the ratio they were built
    with (relative tolerance 1e-6; all lrs 0 is allowed): the common loop
    ``for g in opt.param_groups: g["lr"] = lr`` would otherwise run Muon at the AdamW lr.
    ``lr_ratio_check=False`` turns the check off for deliberately different per-group schedules.

    **Initial weights.** Data parallelism needs every rank to start from the same weights, while
    scripts often seed per rank (``seed + rank``). ``init_sync=True`` (default) broadcasts rank 0's
    parameters at construction (one broadcast per unit of the flat parameter buffer, then one coalesced
    broadcast per dtype of frozen parameters and, with ``module=``, the module's other parameters and
    buffers; ``tag="init_sync"``); ``"verify"`` instead all-gathers an integer checksum per tensor and
    raises ``ValueError`` on every rank naming the first tensor that differs; ``False`` trusts the caller.

    **Checkpoints.** :meth:`state_dict` / :meth:`load_state_dict` are torch-DCP ready (per-parameter
    ``Shard(0)`` DTensors, any world size: ``get_state_dict`` / ``set_state_dict`` / ``dcp.save`` /
    ``dcp.load`` work); :meth:`full_state_dict` is the whole state in ``torch.optim`` format on every
    rank; :meth:`shard_state_dict` is this rank's raw shard (same layout only). A model plus optimizer
    as one flat dict that saves and loads each rank's own elements with no gather:
    :class:`lowband.optim.sharded_state.ShardedStateLayout`.

    Args:
        params: tensors or param-group dicts.
        lr, betas, eps, weight_decay: AdamW defaults (``weight_decay`` also Muon's default).
        algorithm: default algorithm of a group that does not name one.
        momentum, nesterov, ns_method, ns_steps, ns_dtype: Muon defaults (see :mod:`lowband.optim.muon`).
        comm: the data-parallel :class:`lowband.comm.Comm` (default: world, or 1 rank if
            ``torch.distributed`` is not initialized).
        bucket_mb: unit size cap in MiB (> 0).
        grad_wire_dtype: ``None`` (parameter dtype), ``torch.float32`` or ``torch.bfloat16`` (or the
            names ``"fp32"``, ``"bf16"``): the dtype gradients travel in; the owner always
            accumulates in fp32 (fp64 for fp64 parameters). ``"fp8"`` (e4m3) or ``"int8"``: block-scaled
            (one fp32 scale per ``grad_block_size`` elements, each rank's chunk padded to a multiple of
            it), sent by one all-to-all per unit and summed in fp32 by the owner
            (:func:`lowband.comm.codecs.codec_reduce_scatter`; error bound per element in
            :mod:`lowband.comm.codecs`); sparse-table units keep the parameter dtype.
        param_wire_dtype: same choices, for the parameter all-gather. ``bf16`` with fp32 parameters
            halves the gather bytes: the owner keeps an fp32 master copy of its slice
            (``state["master"]``, 1/N of the parameters) and every rank, the owner included, computes
            with the bf16-rounded values (modded-nanogpt's bf16 weights with fp32 master, PR #190).
        module: the model; needed for ``param_gather="forward"``.
        param_gather: ``"step"`` or ``"forward"`` (when the next forward waits for the all-gathers).
        sparse_tables: :class:`lowband.optim.sparse_rows.SparseTable` entries (2-D AdamW parameters):
            each becomes a row-aligned unit whose gradient reduce-scatter is the row-sparse exchange
            of :mod:`lowband.comm.sparse` (see :meth:`observe_tokens`, docs/sparse.md).
        sparse_mode: ``"auto"`` | ``"sparse"`` | ``"dense"`` for those tables.
        sparse_count_comm: gloo :class:`Comm` for their count all-gather (default ``comm``).
        init_sync: ``True`` (broadcast from rank 0), ``False``, or ``"verify"`` (see above).
        lr_ratio_check: refuse a step whose Muon/AdamW lrs lost their construction ratio (see above).
        state_timeout: seconds a state collective waits for the other ranks (see above).
        grad_block_size: elements per fp32 scale of an ``"fp8"``/``"int8"`` gradient (a multiple of 4).
        exchange: how a gloo group of 3 ranks or more moves the fp32 (fp64) gradient reduce-scatters and the
            parameter all-gathers of units with chunks of ``lowband.comm.ring.RING_MIN_CHUNK`` elements or more:
            ``"ring"`` (default; a pipelined ring, one TCP flow per link direction, :mod:`lowband.comm.ring`; sums
            in ring order) or ``"p2p"`` (every peer at once, receives posted first; sums in rank order). On a
            bandwidth-bound link the ring is faster (4 ranks, 10 Mbit/s: 1.07x DDP's step against 1.32x); where
            each rank shares few cores with others and the link is fast, its per-step hand-offs cost latency
            (4 ranks on 2 cores, 1 Gbit/s: 1.35x against 1.18x). Two ranks, other backends and narrower wires
            are the same either way. docs/PERFORMANCE.md has the runs.
        grad_error_feedback: with ``"fp8"``/``"int8"`` gradients, error feedback: each rank keeps its own
            encoding error of every unit (a residual: the unit's size in fp32 on every rank, 4 bytes per
            parameter; sparse-table units none) and sends ``gradient + residual`` next time, so what the
            codec dropped travels later instead of being lost. Only members that hold a gradient on
            this rank add their residual (one without sends zeros and keeps it); the residual changes
            only at a :meth:`step` that updates (a skipped or discarded step keeps it). It is not part
            of any state dict: every load restarts it at zero. Refused with ``torch.amp.GradScaler``.

    Raises:
        ValueError: bad hyperparameters, a parameter in two groups, ``bucket_mb <= 0``, Muon on a
            tensor that is not 2-D, a sparse table tied to another parameter of ``module`` (all before
            any collective), parameter shapes or settings that differ between ranks (checked once with
            ``comm.agree``, on every rank alike), or, with ``init_sync="verify"``, parameter values that
            differ between ranks.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands itself to step() (see step)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, algorithm: str = "adamw",
                 momentum: float = 0.95, nesterov: bool = True, ns_method: str = "ns5", ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.bfloat16, comm: Comm | None = None, bucket_mb: float = 25.0,
                 grad_wire_dtype: torch.dtype | str | None = None,
                 param_wire_dtype: torch.dtype | str | None = None, module: nn.Module | None = None,
                 param_gather: str = "step", sparse_tables: Iterable[SparseTable] = (),
                 sparse_mode: str = "auto", sparse_count_comm: Comm | None = None,
                 init_sync: bool | str = True, lr_ratio_check: bool = True,
                 state_timeout: float = 60.0, grad_block_size: int = DEFAULT_BLOCK_SIZE,
                 grad_error_feedback: bool = False, exchange: str = "ring") -> None:
        if not (init_sync is True or init_sync is False or init_sync == "verify"):
            raise ValueError(f"ShardedOptimizer: init_sync={init_sync!r} is not allowed; allowed: True "
                             "(broadcast from rank 0), False (trust the caller), 'verify' (checksum, raise)")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0 \
                or not math.isfinite(bucket_mb):
            raise ValueError(f"ShardedOptimizer: bucket_mb must be a positive number of MiB "
                             f"(got {bucket_mb!r})")
        grad_codec: Codec | None = None
        if isinstance(grad_wire_dtype, str) and grad_wire_dtype in GRAD_CODECS:
            if isinstance(grad_block_size, bool) or not isinstance(grad_block_size, int) \
                    or grad_block_size <= 0 or grad_block_size % 4:
                raise ValueError(f"ShardedOptimizer: grad_block_size must be a positive multiple of 4, got "
                                 f"{grad_block_size!r}")
            grad_codec = get_codec(grad_wire_dtype, block_size=grad_block_size)
            grad_wire_dtype = None
        if not isinstance(grad_error_feedback, bool):
            raise ValueError(f"ShardedOptimizer: grad_error_feedback must be True or False "
                             f"(got {grad_error_feedback!r})")
        if grad_error_feedback and grad_codec is None:
            raise ValueError(f"ShardedOptimizer: grad_error_feedback needs a block-scaled gradient wire "
                             f"(grad_wire_dtype 'fp8' or 'int8'), got grad_wire_dtype={grad_wire_dtype!r}")
        if isinstance(grad_wire_dtype, str) and grad_wire_dtype in _WIRE_NAMES:
            grad_wire_dtype = _WIRE_NAMES[grad_wire_dtype]
        if grad_wire_dtype not in GRAD_WIRE_DTYPES:
            raise ValueError(f"ShardedOptimizer: grad_wire_dtype={grad_wire_dtype!r} is not allowed; "
                             "allowed: None (parameter dtype), torch.float32 ('fp32'), torch.bfloat16 ('bf16'), "
                             "'fp8' or 'int8' (block-scaled, grad_block_size elements per fp32 scale)")
        if isinstance(param_wire_dtype, str) and param_wire_dtype in _WIRE_NAMES:
            param_wire_dtype = _WIRE_NAMES[param_wire_dtype]
        if param_wire_dtype not in GRAD_WIRE_DTYPES:
            raise ValueError(f"ShardedOptimizer: param_wire_dtype={param_wire_dtype!r} is not allowed; "
                             "allowed: None (parameter dtype), torch.float32 ('fp32'), torch.bfloat16 ('bf16')")
        if isinstance(state_timeout, bool) or not isinstance(state_timeout, (int, float)) \
                or not (state_timeout > 0 and math.isfinite(state_timeout)):
            raise ValueError(f"ShardedOptimizer: state_timeout must be a positive number of seconds "
                             f"(got {state_timeout!r})")
        if param_gather not in PARAM_GATHER:
            raise ValueError(f"ShardedOptimizer: param_gather={param_gather!r} is not allowed; "
                             f"allowed: {list(PARAM_GATHER)}")
        if param_gather == "forward" and module is None:
            raise ValueError("ShardedOptimizer: param_gather='forward' needs module= (the model whose "
                             "forward pre-hooks wait for the all-gathers)")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"ShardedOptimizer: algorithm={algorithm!r} is not allowed; "
                             f"allowed: {list(ALGORITHMS)}")
        if exchange not in EXCHANGES:
            raise ValueError(f"ShardedOptimizer: exchange={exchange!r} is not allowed; allowed: {list(EXCHANGES)}")
        sparse_tables = list(sparse_tables)
        validate_sparse_tables(sparse_tables, sparse_mode, "ShardedOptimizer")
        if module is not None:
            check_untied(module, sparse_tables, "ShardedOptimizer")
        groups = self._normalize_groups(params)
        if module is not None:
            refuse_renormed_embeddings(module, {id(q) for g in groups for q in g["params"]}, "ShardedOptimizer")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, algorithm=algorithm,
                        momentum=momentum, nesterov=nesterov, ns_method=ns_method, ns_steps=ns_steps,
                        ns_dtype=ns_dtype)
        self._constructed = False
        super().__init__(groups, defaults)
        self._validate_groups()
        self._refuse_unimplemented()

        self.comm = (comm if comm is not None else Comm()).private(EXCHANGES[exchange])  # own group (Comm.private)
        # the state collectives (state_dict, full_state_dict, load_state_dict) on a second group whose
        # timeout is state_timeout: a call only some ranks make ends with an error, not a 30-minute hang
        self.state_timeout = float(state_timeout)
        self._state_comm = self.comm.private("sharded_state", timeout=timedelta(seconds=self.state_timeout))
        self.bucket_mb = float(bucket_mb)
        self.grad_wire_dtype = grad_wire_dtype
        self.grad_codec = grad_codec  # fp8/int8 gradients: codec_reduce_scatter (lowband.comm.codecs)
        self.grad_error_feedback = grad_error_feedback
        self.param_wire_dtype = param_wire_dtype
        self.param_gather = param_gather
        self.require_backward_grad_sync = True
        self.last_grad_norm: torch.Tensor | None = None
        self.init_sync = init_sync
        self.lr_ratio_check = bool(lr_ratio_check)
        self._base_lrs = [float(g["lr"]) for g in self.param_groups]

        all_params = [p for g in self.param_groups for p in g["params"]]
        fingerprint = ([(gi, g["algorithm"], tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad)
                        for gi, g in enumerate(self.param_groups) for p in g["params"]],
                       [repr(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
                        for g in self.param_groups],
                       self.bucket_mb, repr(grad_codec) if grad_codec else str(grad_wire_dtype), grad_error_feedback,
                       str(param_wire_dtype), param_gather,
                       [(t.name, tuple(t.param.shape), t.hash, t.vocab_size) for t in sparse_tables], sparse_mode,
                       init_sync, self.lr_ratio_check, self.state_timeout, exchange)
        self.comm.agree(fingerprint, "ShardedOptimizer parameters (group, algorithm, shape, dtype, "
                                     "requires_grad) and settings")

        n = self.comm.size
        cap = max(1, int(self.bucket_mb * 2**20))
        adam_specs, muon_specs, row_specs = [], [], []
        table_of = {id(t.param): t for t in sparse_tables}
        idx = 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in table_of and (g["algorithm"] != "adamw" or not p.requires_grad):
                    raise ValueError(f"ShardedOptimizer: sparse table {table_of[id(p)].name!r} must be a "
                                     "trainable parameter of an algorithm='adamw' group")
                if p.requires_grad:
                    spec = ParamSpec(idx, gi, tuple(p.shape), p.dtype, p.device)
                    (row_specs if id(p) in table_of else muon_specs if g["algorithm"] == "muon"
                     else adam_specs).append(spec)
                idx += 1
        if len(row_specs) != len(sparse_tables):
            raise ValueError("ShardedOptimizer: every sparse table must be one of the optimizer's parameters")
        layouts = (plan_adamw_buckets(adam_specs, n, cap) + plan_muon_units(muon_specs, n, cap)
                   + plan_row_units(row_specs, n))
        layouts = order_units(layouts)
        self._layout_id = layout_id(layouts)
        self._units = [_Unit(lay, [all_params[m.index] for m in lay.members]) for lay in layouts]
        self._sparse: dict[int, SparseTableUnit] = {}
        for ui, unit in enumerate(self._units):
            t = table_of.get(id(unit.params[0])) if len(unit.params) == 1 else None
            if t is not None:
                self._sparse[ui] = SparseTableUnit(t, self.comm, count_comm=sparse_count_comm, mode=sparse_mode,
                                                   wire_dtype=grad_wire_dtype)
        # error feedback: this rank's encoding error of every unit's flat gradient not sent yet (sparse tables
        # travel exactly and keep none); see _ef_input / _commit_residuals
        self._residuals: dict[int, torch.Tensor] = {
            ui: torch.zeros(u.layout.numel, dtype=_acc_dtype(u.layout.dtype), device=u.layout.device)
            for ui, u in enumerate(self._units) if grad_error_feedback and ui not in self._sparse}
        self._next_launch = 0
        self._gather_order = self._forward_order(module)
        self._gathers: dict[int, CommHandle] = {}
        self._hooks: list[Any] = []
        # param_gather="forward": which parameters a forward read outside their own module (see _note_read); on
        # one rank every "gather" is a local copy done before step() returns, so nothing is ever read mid-gather
        self._track_reads = module is not None and param_gather == "forward" and self.comm.size > 1
        self._root_waits: set[int] = set()  # units read outside their owners: waited when `module`'s forward starts
        self._owner_called: set[int] = set()  # ids of parameters whose owning module's pre-hook ran since step()
        self._inflight_at_forward: set[int] = set()  # units in flight when a forward of `module` started
        self._read_in_flight: set[int] = set()  # ids of parameters a forward may have read mid-gather
        in_units = {id(p) for u in self._units for p in u.params}
        named = self._named_state(module, all_params, self.param_groups)[:len(all_params)]
        self._names = [name for name, _p in named]  # by flat parameter index, for error messages
        self._excluded = [(name, p) for name, p in named if id(p) not in in_units]
        # one level per unit member, one flag per parameter left out, 4 bytes (GradScaler factor, inf, late copy)
        self.used_flags_numel = (sum(len(u.params) for u in self._units) + len(self._excluded)
                                 + 2 * _HYPER_BYTES * len(self.param_groups) + 4)
        self._reset_used()
        self._sync_initial(module, all_params)
        for ui, unit in enumerate(self._units):
            for mi, p in enumerate(unit.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(ui, mi)))
        if module is not None and param_gather == "forward":
            owner = {id(p): ui for ui, u in enumerate(self._units) for p in u.params}
            for mod in module.modules():
                ids = [id(p) for p in mod.parameters(recurse=False) if id(p) in owner]
                uis = sorted({owner[i] for i in ids})
                if uis:
                    hook = self._make_forward_hook(uis, ids if self._track_reads else [])
                    self._hooks.append(mod.register_forward_pre_hook(hook))
            if self._track_reads:
                self._hooks.append(module.register_forward_pre_hook(self._make_root_hook(), prepend=True))
            # model.state_dict() / load_state_dict() of any of its modules right after step(): wait first (a
            # state dict read mid-gather mixes old and new values; a load would be overwritten by late gathers)
            wait = self._make_state_hook()
            for mod in module.modules():
                self._hooks.append(mod.register_state_dict_pre_hook(wait))
                self._hooks.append(mod.register_load_state_dict_pre_hook(wait))
        self._constructed = True

    def _forward_order(self, module: nn.Module | None) -> list[int]:
        """Unit indices in the order a forward needs them: by the earliest member in ``module``'s parameter
        registration order (without ``module``: the flat parameter order). :meth:`step` updates and launches
        the all-gathers in this order, so the first layers' parameters arrive first; units are otherwise
        ordered for backward (last layer first), and the forward's first pre-hook waited for the last gather."""
        position = {id(p): i for i, p in enumerate(module.parameters())} if module is not None else {}
        late = len(position)

        def first(ui: int) -> int:
            unit = self._units[ui]
            return min(position.get(id(p), late + m.index) for p, m in zip(unit.params, unit.layout.members,
                                                                             strict=True))
        return sorted(range(len(self._units)), key=first)

    # ------------------------------------------------------------------------------ validation
    @staticmethod
    def _normalize_groups(params: Iterable) -> list[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError("ShardedOptimizer: params must be an iterable of tensors or of dicts, "
                            "not a single tensor")
        items = list(params)
        if not items:
            raise ValueError("ShardedOptimizer: params is an empty list")
        if all(isinstance(x, dict) for x in items):
            groups = [dict(x) for x in items]
        elif all(isinstance(x, torch.Tensor) for x in items):
            groups = [{"params": items}]
        else:
            raise TypeError("ShardedOptimizer: params must be all tensors or all param-group dicts")
        seen: dict[int, int] = {}
        for gi, g in enumerate(groups):
            if "params" not in g:
                raise ValueError(f"ShardedOptimizer: param_groups[{gi}] has no 'params' key")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            g["params"] = ps
            for pi, p in enumerate(ps):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"ShardedOptimizer: param_groups[{gi}]['params'][{pi}] is a "
                                    f"{type(p).__name__}, expected a torch.Tensor")
                if id(p) in seen:
                    raise ValueError(f"ShardedOptimizer: a parameter of shape {tuple(p.shape)} appears "
                                     f"twice (param_groups[{seen[id(p)]}] and param_groups[{gi}]); each "
                                     "parameter must be in exactly one group, once")
                seen[id(p)] = gi
        return groups

    def _validate_groups(self) -> None:
        for gi, g in enumerate(self.param_groups):
            where = f"ShardedOptimizer param_groups[{gi}]"
            if g["algorithm"] not in ALGORITHMS:
                raise ValueError(f"{where}: algorithm={g['algorithm']!r} is not allowed; "
                                 f"allowed: {list(ALGORITHMS)}")
            for pi, p in enumerate(g["params"]):
                if not p.is_floating_point():
                    raise TypeError(f"{where}: params[{pi}] has dtype {p.dtype}; expected a floating dtype")
            if g["algorithm"] == "adamw":
                validate_adamw_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"], where)
            else:
                validate_muon_hparams(g["lr"], g["momentum"], g["nesterov"], g["weight_decay"],
                                      g["ns_method"], g["ns_steps"], g["ns_dtype"], where)
                for pi, p in enumerate(g["params"]):
                    if p.dim() != 2:
                        raise ValueError(f"{where}: algorithm='muon' handles 2-D matrices, but params[{pi}] "
                                         f"has shape {tuple(p.shape)}; give embeddings, heads and "
                                         "1-D parameters to an algorithm='adamw' group")

    # ------------------------------------------------------------------------- initial sync
    @staticmethod
    def _named_state(module: nn.Module | None, params: list[torch.Tensor],
                     groups: list[dict]) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the initial sync covers, named: the optimizer's parameters, then (with a module)
        the module's other parameters and its buffers, each tensor once."""
        names: dict[int, str] = {}
        if module is not None:
            for n, p in module.named_parameters():
                names.setdefault(id(p), n)
        out, seen = [], set()
        for gi, g in enumerate(groups):
            for pi, p in enumerate(g["params"]):
                out.append((names.get(id(p), f"param_groups[{gi}]['params'][{pi}]"), p))
                seen.add(id(p))
        if module is not None:
            for n, p in module.named_parameters():
                if id(p) not in seen:
                    out.append((n, p))
                    seen.add(id(p))
            for n, b in module.named_buffers():
                if id(b) not in seen:
                    out.append((f"buffer {n}", b))
                    seen.add(id(b))
        return out

    @torch.no_grad()
    def _sync_initial(self, module: nn.Module | None, params: list[torch.Tensor]) -> None:
        """``init_sync``: broadcast parameters (flat buffers) and buffers from rank 0, or verify them."""
        if self.comm.size == 1 or self.init_sync is False:
            return
        named = self._named_state(module, params, self.param_groups)
        if self.init_sync == "verify":
            mine = [_checksum(t) for _n, t in named]
            everyone = self.comm.all_gather_object(mine, tag="init_sync")
            for i, (n, t) in enumerate(named):
                if any(e[i] != everyone[0][i] for e in everyone):
                    ranks = [r for r, e in enumerate(everyone) if e[i] != everyone[0][i]]
                    raise ValueError(
                        f"ShardedOptimizer(init_sync='verify'): {n} (shape {tuple(t.shape)}) differs between "
                        f"ranks (rank 0 vs ranks {ranks}; first differing tensor of {len(named)}). Data-parallel "
                        "training needs equal initial weights: seed every rank alike, or use init_sync=True to "
                        "broadcast rank 0's weights")
            return
        in_units = set()
        for unit in self._units:  # parameters in units are views of the flat buffers: one broadcast each
            self.comm.broadcast(unit.param_buf, 0, tag="init_sync")
            in_units.update(id(p) for p in unit.params)
        rest: dict[tuple, list[torch.Tensor]] = {}
        for _n, t in named:
            if id(t) not in in_units and t.numel() > 0:
                rest.setdefault((t.dtype, t.device), []).append(t)
        for tensors in rest.values():  # frozen parameters, buffers: one coalesced broadcast per dtype
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            self.comm.broadcast(flat, 0, tag="init_sync")
            off = 0
            for t in tensors:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    # ------------------------------------------------------------------------- learning rates
    @property
    def base_lrs(self) -> list[float]:
        """Each group's lr at construction (or as last loaded from a state dict): the reference the
        lr-ratio check compares the current lrs against."""
        return list(self._base_lrs)

    def _refuse_unimplemented(self) -> None:
        """Raise ``ValueError`` naming the group if a param group asks for a ``torch.optim.AdamW`` option that
        changes the update and is not implemented here (``amsgrad``, ``maximize``: set in a group dict, by hand
        or by loading a torch AdamW state dict); ignoring it would step differently from torch. Local: every
        rank holds the same groups."""
        for gi, g in enumerate(self.param_groups):
            for key in UNIMPLEMENTED_ADAMW:
                if g.get(key):
                    raise ValueError(f"{type(self).__name__}: param_groups[{gi}] has {key}=True, which lowband's "
                                     f"sharded AdamW does not implement (it would step as with {key}=False); "
                                     f"set it to False or use torch.optim.AdamW")

    def _check_lrs(self) -> None:
        """Raise if Muon and AdamW groups no longer keep their construction lr ratio (see class doc)."""
        self._refuse_unimplemented()
        if not self.lr_ratio_check or len({g["algorithm"] for g in self.param_groups}) < 2:
            return
        if all("initial_lr" in g for g in self.param_groups):
            # a torch LRScheduler is attached (it records each group's initial_lr) and sets each group's
            # lr from that group's own base lr: CosineAnnealingLR(eta_min=...) etc. change the ratio by design
            return
        lrs = [float(g["lr"]) for g in self.param_groups]
        if all(lr == 0 for lr in lrs):  # warmup at 0, or torch DCP's lr=0 initialization step
            return
        factors = [lr / base if base > 0 else (1.0 if lr == 0 else math.inf)
                   for lr, base in zip(lrs, self._base_lrs)]
        lo, hi = min(factors), max(factors)
        if math.isfinite(hi) and hi - lo <= LR_RATIO_RTOL * max(abs(hi), abs(lo)):
            return
        desc = "; ".join(f"group {gi} ({g['algorithm']}): {base:g} -> {lr:g}"
                         for gi, (g, lr, base) in enumerate(zip(self.param_groups, lrs, self._base_lrs)))
        raise ValueError(
            "ShardedOptimizer.step: the param groups' lrs no longer keep the ratio they were built with "
            f"({desc}) and no torch lr scheduler is attached. Muon and AdamW groups carry separate lrs; a loop "
            "that sets one lr on every group runs Muon at the AdamW lr. Scale each group's own lr instead "
            "(g['lr'] = base_lr * factor with base_lr from opt.base_lrs), attach a torch.optim.lr_scheduler "
            "(LambdaLR, CosineAnnealingLR, ...: allowed, it keeps per-group lrs), or pass lr_ratio_check=False "
            "if different schedules per group are intended")

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise ValueError("ShardedOptimizer: param groups cannot be added after construction (the "
                             "bucket layout is fixed); pass every group to the constructor")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------- hooks and launch
    # The hooks hold the optimizer weakly: a parameter's post-accumulate-grad hook lives where Python's cyclic
    # collector cannot see it, so a strong reference there would keep an optimizer nobody uses alive for the
    # life of the process (with its private process groups and their gloo threads). A hook whose optimizer is
    # gone does nothing.
    def _make_grad_hook(self, ui: int, mi: int):
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is None:
                return
            if p.grad is not None and p.grad.layout != torch.strided:
                name = opt._names[opt._units[ui].layout.members[mi].index]
                raise ValueError(f"{type(opt).__name__}: parameter {name} got a sparse gradient "
                                 f"({p.grad.layout}; nn.Embedding(sparse=True) / F.embedding(sparse=True)), which "
                                 "the sharded optimizer does not take: use sparse=False (the gradient is reduced "
                                 "densely), or pass the table as sparse_tables=[...] for lowband's row-sparse "
                                 "exchange (docs/sparse.md)")
            if opt._track_reads:
                opt._note_read(ui, p)
            if opt.require_backward_grad_sync:
                opt._on_grad_ready(ui, mi, p)
        return hook

    def _make_forward_hook(self, uis: list[int], ids: list[int]):
        ref = weakref.ref(self)

        def hook(_module: nn.Module, _args: Any) -> None:
            opt = ref()
            if opt is not None:
                opt._owner_called.update(ids)
                opt._wait_gathers(uis)
        return hook

    def _make_state_hook(self):
        """``state_dict`` / ``load_state_dict`` pre-hook of ``module``'s modules (``param_gather="forward"``): wait
        for every parameter all-gather in flight (local; no new collective)."""
        ref = weakref.ref(self)

        def hook(*_args: Any) -> None:
            opt = ref()
            if opt is not None and opt._gathers:
                opt._wait_gathers()
        return hook

    def _make_root_hook(self):
        """Forward pre-hook of ``module`` (runs first): note the units in flight as a forward starts, and wait
        for the units learned to be read outside their own modules (:meth:`_note_read`)."""
        ref = weakref.ref(self)

        def hook(_module: nn.Module, _args: Any) -> None:
            opt = ref()
            if opt is not None:
                opt._inflight_at_forward.update(opt._gathers)
                opt._wait_gathers(sorted(opt._root_waits))
        return hook

    def _note_read(self, ui: int, p: torch.Tensor) -> None:
        """``param_gather="forward"``, in backward: ``p`` got a gradient. If no module owning ``p`` directly ran
        its forward since the last :meth:`step` (``p`` was read functionally: ``self.wpe.weight[:T]``, a weight
        used by another module), its unit is waited from now on when ``module``'s forward starts; if the unit's
        all-gather was in flight when this forward started (and was not such a learned wait), or is still in
        flight now, the forward may have read half-gathered values, and the next :meth:`step` refuses on every
        rank (level ``_LEVEL_READ_IN_FLIGHT``). A model that reads the same parameters this way every step is
        learned at its first step, when nothing is in flight, and is exact from then on."""
        if id(p) in self._owner_called:
            return
        if ui in self._gathers or (ui in self._inflight_at_forward and ui not in self._root_waits):
            self._read_in_flight.add(id(p))
        self._root_waits.add(ui)

    def _reset_reads(self) -> None:
        """Start the next step's read tracking (at the end of :meth:`step` and at a refusal). Not part of
        :meth:`_reset_step`: ``zero_grad()`` calls that, and a script may call ``zero_grad()`` between its forward
        and its backward, which must not forget which owners that forward ran."""
        self._owner_called.clear()
        self._inflight_at_forward.clear()
        self._read_in_flight.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context backward hooks do not communicate (gradient accumulation)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @torch.no_grad()
    def _on_grad_ready(self, ui: int, mi: int, p: torch.Tensor) -> None:
        unit = self._units[ui]
        if unit.launched:
            raise RuntimeError("ShardedOptimizer: a gradient arrived for a bucket whose reduce-scatter "
                               "already started this step; run all but the last microbatch's backward "
                               "inside optimizer.no_sync(), and call step() or zero_grad() between steps")
        assert p.grad is not None
        unit.copy_grad(mi, p)
        if not unit.copied[mi]:
            unit.copied[mi] = True
            unit.n_copied += 1
        while (self._next_launch < len(self._units)
               and self._units[self._next_launch].n_copied == len(self._units[self._next_launch].params)):
            self._launch(self._next_launch)

    def _launch(self, ui: int) -> None:
        unit = self._units[ui]
        assert ui == self._next_launch and not unit.launched
        wire = self.grad_wire_dtype or unit.layout.dtype
        if ui in self._sparse:  # row-sparse exchange of an embedding table (lowband.optim.sparse_rows)
            m = unit.layout.members[0]
            unit.rs = self._sparse[ui].launch(unit.grad_shard, unit.grad_buf[:m.numel].view(m.shape))
        elif self.grad_codec is not None:  # block-scaled fp8/int8: all-to-all, fp32 sums at the owner
            send = self._ef_input(ui) if ui in self._residuals else unit.grad_buf
            unit.rs = codec_reduce_scatter(self.comm, unit.grad_shard, send, self.grad_codec, op="avg",
                                           async_op=True, tag=f"grad:{unit.layout.kind}")
        else:
            unit.rs = self.comm.reduce_scatter(unit.grad_shard, unit.grad_buf, op="avg", wire_dtype=wire,
                                               async_op=True, tag=f"grad:{unit.layout.kind}")
        unit.launched = True
        self._next_launch += 1

    def _ef_input(self, ui: int) -> torch.Tensor:
        """What an error-feedback unit sends: its flat gradient in the accumulation dtype plus the residual,
        on the members that hold a gradient on this rank (a member without one sends zeros and keeps its
        residual, so a parameter no rank used stays untouched and its pending error is not spent).
        Computed the same way at launch and again at :meth:`_commit_residuals`, so both see the same bits."""
        unit, residual = self._units[ui], self._residuals[ui]
        x = unit.grad_buf.to(residual.dtype, copy=True)
        for held in self._held(unit):
            x[held].add_(residual[held])
        return x

    @staticmethod
    def _held(unit: _Unit) -> list[slice]:
        """The flat ranges of ``unit``'s members that hold a gradient on this rank this step."""
        return [slice(m.offset, m.offset + m.numel) for mi, m in enumerate(unit.layout.members)
                if unit.grad_ref[mi] is not None]

    @torch.no_grad()
    def _commit_residuals(self) -> None:
        """At a step that updates: each error-feedback unit's residual becomes this step's encoding error
        (recomputed from the same input, so nothing extra is kept between backward and step), on the
        members that held a gradient. A skipped or discarded step never gets here: its residual stays."""
        n = self.comm.size
        assert self.grad_codec is not None
        for ui, residual in self._residuals.items():
            err = reduce_scatter_error(self._ef_input(ui), n, self.grad_codec)
            for held in self._held(self._units[ui]):
                residual[held].copy_(err[held])

    def _reset_residuals(self) -> None:
        """Loaded state does not carry this rank's residual (it is not a shard of anything): start from zero."""
        for residual in self._residuals.values():
            residual.zero_()

    @torch.no_grad()
    def _launch_remaining(self) -> None:
        """Copy the gradients no backward hook copied (a parameter whose gradient came only from microbatches
        under ``no_sync``, or unused) and launch their units. Such a late copy is taken at ``step()`` /
        ``clip_grad_norm``, possibly after ``scaler.unscale_(opt)`` divided every ``p.grad`` by the loss scale:
        when the copies made in backward show that factor (:meth:`_early_exp`), the late copy is multiplied
        back into their frame, so every slot holds scaled values and one factor unscales the reduced shards.
        A late copy on a rank with no such evidence is flagged (:meth:`_sync_checks` refuses it if another
        rank saw an unscale)."""
        exp: int | bool | None = False  # False: not looked for yet
        for ui in range(self._next_launch, len(self._units)):
            unit = self._units[ui]
            for mi, p in enumerate(unit.params):
                if not unit.copied[mi]:
                    if p.grad is not None:
                        if exp is False:
                            exp = self._early_exp()
                        unit.copy_grad(mi, p)
                        if exp is None:
                            self._late_unknown = True
                        elif exp:
                            unit.grad_slot(mi).mul_(2.0 ** -exp)
                    else:
                        unit.grad_slot(mi).zero_()
            self._launch(ui)

    def _early_exp(self) -> int | None:
        """The power-of-two factor ``2**e`` by which ``p.grad`` differs from its copy made in backward (GradScaler's
        unscale), from the first copied member that shows one; ``None`` if none does (no unscale yet, or no
        evidence on this rank)."""
        for unit in self._units:
            for mi, p in enumerate(unit.params):
                g, ref = p.grad, unit.grad_ref[mi]
                if not unit.copied[mi] or ref is None or g is not ref or g._version != unit.grad_ver[mi] \
                        or unit.bad[mi]:
                    continue
                e = self._probe_scale(unit.grad_slot(mi), g)
                if e is not None and e is not False:
                    return int(e)
        return None

    # ------------------------------------------------------------- per-step checks (the flags)
    def _reset_used(self) -> None:
        self._checked = False
        self._used_global: list[list[bool]] | None = None
        self._grad_exp: int | None = None  # the reduced shards were multiplied by 2**_grad_exp (GradScaler)
        self._found_inf = False  # some rank's reduced shard holds inf/NaN (this step; global)
        self._late_unknown = False  # a gradient copied at step() with no evidence of an unscale on this rank

    def _flag_device(self) -> torch.device:
        if self._units:
            return self._units[0].grad_buf.device
        params = [p for g in self.param_groups for p in g["params"]]
        return params[0].device if params else torch.device("cpu")

    @torch.no_grad()
    def _readopt(self) -> None:
        """Re-adopt parameters whose storage left the flat parameter buffer with dtype, shape and device
        unchanged (``p.data = p.data * 0.9``): copy the new values into the buffer view (and the owned
        fp32 master, where one is kept) and point ``p.data`` back at it. Local; no communication. A
        changed dtype, shape or device is refused by :meth:`_sync_checks` instead."""
        for ui, unit in enumerate(self._units):
            lay = unit.layout
            for mi, p in enumerate(unit.params):
                m = lay.members[mi]
                if p.dtype != lay.dtype or tuple(p.shape) != m.shape or p.device != lay.device:
                    continue
                view = unit.param_view(mi)
                if p.data_ptr() == view.data_ptr() and p.stride() == view.stride():
                    continue
                view.copy_(p.detach())
                p.data = view
                self._readopt_master(ui, mi)

    def _readopt_master(self, ui: int, mi: int) -> None:
        unit = self._units[ui]
        st = self.state.get(ui)
        if not st or "master" not in st:
            return
        lay, rank, m = unit.layout, self.comm.rank, unit.layout.members[mi]
        if lay.kind == "adamw":
            lo, hi = lay.owner_range(rank)
            a, b = max(lo, m.offset), min(hi, m.offset + m.numel)
            if a < b:
                st["master"][a - lo:b - lo].copy_(unit.param_buf[a:b])
        else:
            assert lay.matrix_shape is not None and lay.real_per_rank is not None
            j = m.offset // (lay.matrix_shape[0] * lay.matrix_shape[1]) - rank * lay.slots_per_rank
            if 0 <= j < lay.real_per_rank[rank]:
                st["master"][j].copy_(unit.param_view(mi))

    @staticmethod
    def _probe_scale(slot: torch.Tensor, g: torch.Tensor) -> int | bool | None:
        """Compare the copied gradient ``slot`` with ``p.grad`` now, every bit (an edit through ``.data``
        bumps no version counter, so only the values show it): ``None`` if equal, else the exponent ``e``
        if the first usable difference (of up to ``_PROBE`` evenly spaced elements, else of the first
        element that differs) is the factor ``2**e`` (torch.amp.GradScaler's unscale kernel edits ``.grad``
        in place without bumping its version counter; the caller verifies ``e`` on every element),
        ``False`` otherwise."""
        flat = g.reshape(-1)
        if _same_bits(slot, flat):
            return None
        stride = max(1, slot.numel() // _PROBE)
        a, b = slot[::stride][:_PROBE], flat[::stride][:_PROBE]
        ok = (a != b) & torch.isfinite(a) & torch.isfinite(b) & (a != 0)
        if not bool(ok.any()):  # the samples show no usable difference: take the first element that differs
            bits = _BITS[slot.element_size()]
            first = (slot.view(bits) != flat.view(bits)).nonzero()[:1, 0]
            a, b = slot[first], flat[first]
            ok = torch.isfinite(a) & torch.isfinite(b) & (a != 0)
            if not bool(ok.any()):
                return False
        i = int(ok.nonzero()[0, 0])
        mant, exp = math.frexp(float(b[i]) / float(a[i]))
        return exp - 1 if mant == 0.5 else False

    @torch.no_grad()
    def _local_levels(self) -> tuple[list[list[int]], int | None]:
        """Per unit member: 0 no gradient, 1 used, 2 ``p.grad`` changed after it was copied (other than
        by one power-of-two factor common to every member: GradScaler's unscale), 3 the parameter's
        dtype/shape/device no longer fits its buffer, 4 a forward may have read it mid-gather
        (:meth:`_note_read`); plus the common exponent, if any."""
        levels: list[list[int]] = []
        exp: int | None = None
        scaled: list[tuple[int, int]] = []
        for unit in self._units:
            lay, lv = unit.layout, []
            for mi, p in enumerate(unit.params):
                m, g, ref = lay.members[mi], p.grad, unit.grad_ref[mi]
                if id(p) in self._read_in_flight:
                    lv.append(_LEVEL_READ_IN_FLIGHT)
                elif unit.bad[mi] or p.dtype != lay.dtype or tuple(p.shape) != m.shape or p.device != lay.device:
                    lv.append(_LEVEL_STORAGE)
                elif ref is None:
                    lv.append(_LEVEL_USED if (unit.copied[mi] or g is not None) else 0)
                elif g is not ref or g._version != unit.grad_ver[mi]:
                    lv.append(_LEVEL_GRAD_CHANGED)
                else:
                    e = self._probe_scale(unit.grad_slot(mi), g)
                    if e is False or (e is not None and exp is not None and e != exp):
                        lv.append(_LEVEL_GRAD_CHANGED)
                        continue
                    if e is not None:
                        exp = e
                    lv.append(_LEVEL_USED)
                    scaled.append((len(levels), mi))
            levels.append(lv)
        if exp is not None:  # every copied gradient must be exactly its copy times 2**exp
            f = 2.0 ** exp
            for ui, mi in scaled:
                unit = self._units[ui]
                a = unit.grad_slot(mi) * f
                b = unit.params[mi].grad.reshape(-1)  # type: ignore[union-attr]
                if not bool(((a == b) | (a.isnan() & b.isnan())).all()):
                    levels[ui][mi] = _LEVEL_GRAD_CHANGED
        return levels, exp

    @torch.no_grad()
    def _sync_checks(self, norm: bool = False) -> torch.Tensor | None:
        """The per-step agreement, once per step at the first of :meth:`clip_grad_norm` / :meth:`step`.

        Launches the units not launched yet, waits for every reduce-scatter (in unit order), then
        all-reduces (MAX, ``tag="grad_used"``, one synchronous collective, issued at the same place on
        every rank) a ``uint8`` vector: per unit member its level (0 no gradient, 1 used, 2 ``p.grad``
        changed after lowband copied it, 3 storage left the flat buffer with another dtype/shape, 4 read by a
        forward mid-gather),
        one "unfrozen since construction" flag per parameter left out of the units, then four bytes:
        the power-of-two factor GradScaler's ``unscale_`` applied to every ``p.grad`` (its exponent + 128
        and 127 - exponent, so MAX gives both the largest and the smallest over ranks; 0 = none),
        "a reduced shard holds inf/NaN", and "a gradient copied at step() with no evidence of the factor"
        (:meth:`_launch_remaining`). Raises ``ValueError`` on every rank alike (naming the first
        parameter in unit order) for levels 2, 3 and 4, an unfrozen parameter, ranks that scaled by
        different factors, or a factor some rank could not apply to its late copies; multiplies the reduced
        shards by the agreed factor. On one rank the local
        flags are the global ones: nothing is sent.

        ``norm=True`` (from :meth:`clip_grad_norm`): the owned shards' sum of squares is all-reduced
        (``tag="grad_norm"``) in flight together with the flags, not one round trip after them, and returned;
        ``None`` when the checks had already run this step or the agreed GradScaler factor then changed the
        shards (the caller takes the norm again)."""
        if self._checked:
            return None
        self._launch_remaining()
        levels, exp = self._local_levels()
        for unit in self._units:
            self._reduce(unit)
        nonfinite = any(not all_finite(u.grad_shard) for u in self._units)
        tail = [0, 0, int(nonfinite), int(self._late_unknown)]
        if exp is not None:
            if -127 <= exp <= 126:
                tail[0], tail[1] = exp + 128, 127 - exp
            else:
                levels = [[_LEVEL_GRAD_CHANGED if v == _LEVEL_USED else v for v in lv] for lv in levels]
        hyper = hyperparameter_digest(self.param_groups)  # b and 255 - b: MAX gives every byte's max and min
        flat = ([v for lv in levels for v in lv] + [int(p.requires_grad) for _n, p in self._excluded]
                + hyper + [255 - b for b in hyper] + tail)
        early = self._local_norm_sq() if norm else None
        if self.comm.size > 1:
            buf = torch.tensor(flat, dtype=torch.uint8, device=self._flag_device())
            flags = self.comm.all_reduce(buf, "max", async_op=True, tag="grad_used")
            # the norm's all-reduce goes out right behind the flags', so both are in flight at once
            summed = self.comm.all_reduce(early, "sum", async_op=True, tag="grad_norm") if early is not None else None
            flags.wait()
            if summed is not None:
                summed.wait()
            flat = [int(v) for v in buf.tolist()]
        elif early is not None:
            self.comm.all_reduce(early, "sum", tag="grad_norm")  # one rank: a local record, as on N ranks
        self._checked = True
        off, used, problem = 0, [], None
        for ui, unit in enumerate(self._units):
            lv = flat[off:off + len(unit.params)]
            off += len(unit.params)
            used.append([v >= _LEVEL_USED for v in lv])
            for mi, v in enumerate(lv):
                if v >= _LEVEL_GRAD_CHANGED and (problem is None or v > problem[0]):
                    problem = (v, ui, mi)
        unfrozen = [bool(v) for v in flat[off:off + len(self._excluded)]]
        off += len(self._excluded)
        hi, lo = flat[off:off + len(hyper)], flat[off + len(hyper):off + 2 * len(hyper)]
        hi_code, lo_code, found, late_unknown = flat[-4:]
        if problem is not None:
            self._refuse_member(*problem)
        self._check_excluded(unfrozen)
        differ = sorted({i // _HYPER_BYTES for i, (a, b) in enumerate(zip(hi, lo, strict=True)) if a + b != 255})
        if differ:
            self._reset_step()
            mine = {k: v for k, v in self.param_groups[differ[0]].items() if k != "params"}
            raise ValueError(
                f"{type(self).__name__}: the hyperparameters of param group(s) {differ} differ between ranks (group "
                f"{differ[0]} on this rank: {mine}): each rank updates its own slice of every parameter with its own "
                "values, so the gathered model would mix them (under DDP the ranks would drift apart). Set them alike "
                "on every rank: step the lr scheduler on every rank (not under `if rank == 0`), from the step count "
                "rather than the wall clock or a rank's own measurements")
        if hi_code:
            emax, emin = hi_code - 128, 127 - lo_code
            if late_unknown:
                self._reset_step()
                raise ValueError(
                    f"{type(self).__name__}: scaler.unscale_(opt) ran before lowband copied some gradients (parameters "
                    "whose gradient came only from microbatches under no_sync), and a rank had no gradient copied in "
                    "backward to tell the loss scale by; call scaler.step(opt) without scaler.unscale_(opt) (it "
                    "unscales the reduced shards itself), and clip with opt.clip_grad_norm before unscaling")
            if emax != emin:
                self._reset_step()
                raise ValueError(
                    f"{type(self).__name__}: p.grad was scaled by 2**{emin} on some ranks and 2**{emax} on others "
                    "after lowband reduced it; use one torch.amp.GradScaler per rank, stepped alike on every rank")
            self._grad_exp = emax
            if emax != 0:
                early = None  # taken before the shards are unscaled
            for unit in self._units:
                unit.grad_shard.mul_(2.0 ** emax)
        self._found_inf = bool(found)
        self._used_global = used
        return early

    def _refuse_member(self, level: int, ui: int, mi: int) -> None:
        unit = self._units[ui]
        lay, p = unit.layout, unit.params[mi]
        name = self._names[lay.members[mi].index]
        cls = type(self).__name__
        self._reset_step()
        self._reset_reads()
        if level == _LEVEL_READ_IN_FLIGHT:
            raise ValueError(
                f"{cls}: parameter {name} was read by a forward while its parameter all-gather "
                "(param_gather='forward') was in flight, on at least one rank: it is read outside the forward of "
                "the module that owns it (e.g. self.wpe.weight[:T], or passed to F.linear), which earlier steps did "
                "not do. This step's gradients may come from half-gathered values, so the step is refused; from "
                "now on the parameter is waited for when the model's forward starts. Use param_gather='step' for "
                "models that change which parameters they read outside their modules")
        if level == _LEVEL_STORAGE:
            raise ValueError(
                f"{cls}: parameter {name} is now {p.dtype} {tuple(p.shape)} on {p.device}, but the optimizer was "
                f"built for {lay.dtype} {lay.members[mi].shape} on {lay.device} (model.to(dtype) / model.double() "
                "/ p.data = ... after building the optimizer): build the optimizer after model.to(...)")
        raise ValueError(
            f"{cls}: p.grad of {name} was changed after lowband reduced it (torch.nn.utils.clip_grad_norm_ / "
            "clip_grad_value_ or another edit of .grad between backward and step): lowband holds the averaged "
            "gradient, so use opt.clip_grad_norm(max_norm) instead (after scaler.unscale_(opt) with a GradScaler)")

    def _check_excluded(self, unfrozen: list[bool]) -> None:
        if not any(unfrozen):
            return
        name, p = self._excluded[unfrozen.index(True)]
        self._reset_step()
        raise ValueError(
            f"ShardedOptimizer.step: parameter {name} (shape {tuple(p.shape)}) had requires_grad=False when the "
            "optimizer was built and has requires_grad=True now (on at least one rank); the bucket layout is "
            "fixed at construction, so it cannot be trained: build the optimizer after unfreezing it")

    def _unit_used(self, ui: int) -> list[bool]:
        """Unit ``ui``'s members that some rank used this step (after :meth:`_sync_checks`)."""
        assert self._used_global is not None
        return self._used_global[ui]

    def _reduce(self, unit: _Unit) -> None:
        if not unit.reduced:
            assert unit.rs is not None
            unit.rs.wait()
            unit.reduced = True

    def _wait_gathers(self, uis: Iterable[int] | None = None) -> None:
        keys = list(self._gathers) if uis is None else [u for u in uis if u in self._gathers]
        for ui in keys:
            self._gathers.pop(ui).wait()
            if self._track_reads:
                # the gather wrote these parameters: a tensor autograd saved from them before this wait (a read
                # before their own module ran) now fails autograd's version check in backward instead of
                # giving a gradient of half-gathered values
                torch.autograd.graph.increment_version(self._units[ui].params)

    def wait_for_params(self) -> None:
        """Wait for every in-flight parameter all-gather (``param_gather="forward"`` mode).

        Purely local (no new collective): the all-gathers were issued by :meth:`step` on every rank
        alike, so waiting for them on a subset of ranks is safe. After it the parameters are whole on
        every rank, so an evaluation forward on rank 0 only (with or without ``no_grad``) runs no
        collective: the forward pre-hooks only wait for gathers already in flight, and the gradient
        hooks fire only under backward (a rank-0-only backward would desynchronize the ranks; call
        :meth:`zero_grad` after it, on that rank, and before the next training step).
        """
        self._wait_gathers()

    def _reset_step(self) -> None:
        self._reset_used()
        for unit in self._units:
            unit.reset()
        for su in self._sparse.values():
            su.reset()
        self._next_launch = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` and drop any reduce-scatter launched since the last step."""
        for unit in self._units:
            if unit.rs is not None:
                unit.rs.wait()
        self._reset_step()
        super().zero_grad(set_to_none=set_to_none)

    def discard_step(self) -> None:
        """Skip this step's update: no parameter or state changes (e.g. a non-finite loss or gradient norm).

        Waits for every reduce-scatter launched by backward hooks (so no collective is left in flight
        and every rank stays in step), drops the reduced gradients and sparse-table bookkeeping, and
        sets ``p.grad = None``. Issues no collective of its own. Call it on every rank alike (decide
        with one agreed flag, e.g. :class:`lowband.train.guards.NonFiniteGuard`); a rank that calls
        :meth:`step` while another calls this deadlocks in the parameter all-gather. Equivalent to
        ``zero_grad(set_to_none=True)``, named for what it guarantees.
        """
        self.zero_grad(set_to_none=True)

    def buffer_bytes(self) -> int:
        """Bytes of this optimizer's persistent communication buffers on this rank: the flat gradient
        buffers, the reduced gradient shards and, with ``grad_error_feedback``, the residuals (parameters
        live in the flat parameter buffers, so they count as parameters)."""
        return (sum(u.grad_buf.numel() * u.grad_buf.element_size()
                    + u.grad_shard.numel() * u.grad_shard.element_size() for u in self._units)
                + sum(r.numel() * r.element_size() for r in self._residuals.values()))

    # ------------------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradient to global L2 norm ``max_norm``; return the norm before clipping.

        Call after backward and before :meth:`step`. Waits for every reduce-scatter (launching any
        not yet launched), sums the squares of the owned shards, and all-reduces that one scalar
        (``tag="grad_norm"``); as the step's first call it issues that all-reduce together with the step's
        flags all-reduce, so clipping adds no round trip of its own (with a GradScaler factor other than 1
        agreed there, the unscaled shards' norm is all-reduced again after it). Scales the shards by
        ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` does. ``max_norm=inf``
        only measures.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"clip_grad_norm: max_norm must be a positive number (got {max_norm!r})")
        self._wait_gathers()
        total = self._sync_checks(norm=True)
        if total is None:
            total = self._local_norm_sq()
            self.comm.all_reduce(total, "sum", tag="grad_norm")
        norm = total.sqrt()[0]
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            if float(coef) < 1.0:  # multiplying by exactly 1 would change nothing: skip the pass
                for unit in self._units:
                    unit.grad_shard.mul_(coef.to(unit.grad_shard.dtype))
        self.last_grad_norm = norm
        return norm

    def _local_norm_sq(self) -> torch.Tensor:
        """``[sum of squares of the owned shards]`` (float64 if any shard is, else float32), this rank's part."""
        wide = any(u.grad_shard.dtype == torch.float64 for u in self._units)
        acc = torch.float64 if wide else torch.float32
        device = self._units[0].grad_shard.device if self._units else torch.device("cpu")
        total = torch.zeros(1, dtype=acc, device=device)
        for unit in self._units:
            g = unit.grad_shard if unit.grad_shard.dtype == acc else unit.grad_shard.to(acc)
            total += torch.dot(g, g)
        return total

    # ---------------------------------------------------------------------------------- step
    def whole_tensor_params(self) -> list[torch.Tensor]:
        """The parameters of its Muon groups (orthogonalized whole on their owner rank; a part of a sharded weight
        is refused at ``step()``, :func:`lowband.sharding.refuse_sharded_whole_tensor_updates`)."""
        return [p for g in self.param_groups if g.get("algorithm") == "muon" for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None, grad_scaler: Any = None):  # type: ignore[override]
        """Reduce, update the owned slices, gather; returns ``closure()``'s loss if given.

        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step(opt)`` (torch's protocol for optimizers
        with ``_step_supports_amp_scaling``; torch warns that it is deprecated, the attribute protocol
        could not make ``found_inf`` global): the reduced shards are unscaled here unless
        ``scaler.unscale_(opt)`` already did, and the step is skipped on every rank alike when a reduced
        shard on any rank holds inf/NaN; the global ``found_inf`` is written back into the scaler, so
        ``scaler.update()`` backs off alike on every rank."""
        if grad_scaler is not None and self._residuals:
            raise ValueError(f"{type(self).__name__}: grad_error_feedback cannot be used with torch.amp.GradScaler "
                             "(the residual would carry the loss scale of the step that made it); use bf16 "
                             "autocast, or grad_error_feedback=False")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_lrs()
        self._wait_gathers()
        self._readopt()
        self._sync_checks()  # refusals happen here, before any update, on every rank alike
        if grad_scaler is not None and self._apply_scaler(grad_scaler):
            self._reset_step()  # inf/NaN somewhere: skipped on every rank (parameters and state unchanged)
            self._reset_reads()
            return loss
        if self._residuals:
            self._commit_residuals()
        rank = self.comm.rank
        for ui in self._gather_order:  # the order the next forward needs them (every rank alike)
            unit = self._units[ui]
            group = self.param_groups[unit.layout.group]
            used = self._unit_used(ui)
            if unit.layout.kind == "adamw":
                self._adamw_step(ui, unit, group, rank, used)
            else:
                self._muon_step(ui, unit, group, rank, used)
            lo, hi = unit.layout.owner_range(rank)
            self._gathers[ui] = self.comm.all_gather(unit.param_buf, unit.param_buf[lo:hi], async_op=True,
                                                     wire_dtype=self._param_wire(unit),
                                                     tag=f"param:{unit.layout.kind}")
        if self.param_gather == "step":
            self._wait_gathers()
        self._reset_step()
        self._reset_reads()
        return loss

    @torch.no_grad()
    def _apply_scaler(self, scaler: Any) -> bool:
        """Unscale the reduced shards by the scaler's ``1/scale`` unless ``scaler.unscale_(opt)`` already
        scaled every ``p.grad`` by it (seen by :meth:`_sync_checks`); write the global ``found_inf``
        into the scaler's per-optimizer record; return whether to skip the step."""
        scale = scaler._scale
        inv = scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        if self._grad_exp is None:
            for unit in self._units:
                unit.grad_shard.mul_(inv.to(device=unit.grad_shard.device, dtype=unit.grad_shard.dtype))
        elif 2.0 ** self._grad_exp != float(inv):
            self._reset_step()
            raise ValueError(f"{type(self).__name__}: p.grad was scaled by 2**{self._grad_exp} after lowband reduced "
                             f"it, but the GradScaler stepping this optimizer unscales by {float(inv):g}: call "
                             "scaler.unscale_(opt) with the scaler that steps it, and edit .grad no other way")
        found = float(self._found_inf)
        st = scaler._per_optimizer_states[id(self)]
        per_device = st["found_inf_per_device"]
        if per_device:  # unscale_ recorded this rank's local verdict: make it the global one
            for i, t in enumerate(per_device.values()):
                t.fill_(found if i == 0 else 0.0)
        else:
            st["found_inf_per_device"] = {scale.device: torch.full((), found, dtype=torch.float32,
                                                                    device=scale.device)}
        return bool(found)

    def _param_wire(self, unit: _Unit) -> torch.dtype:
        return self.param_wire_dtype or unit.layout.dtype

    def _master(self, unit: _Unit, own: torch.Tensor, state: dict) -> torch.Tensor:
        """The tensor the update is applied to: the owned slice itself, or, when parameters travel
        narrower than they are stored (bf16 gather of fp32 params) or are stored narrower than fp32,
        an fp32 master copy of the owned slice kept in ``state["master"]``."""
        acc = unit.grad_shard.dtype
        if not self._needs_master(unit):
            return own
        if "master" not in state:
            state["master"] = own.to(acc).clone()
        else:
            self._adopt_edits(unit, own, state["master"])
        return state["master"]

    def _adopt_edits(self, unit: _Unit, own: torch.Tensor, master: torch.Tensor) -> None:
        """Elements of the owned slice that no longer hold what the last step left there (its master rounded
        to the parameter dtype, or to the gather's wire dtype first) were written since by code outside the
        optimizer (``model.load_state_dict`` to roll back, ``p.mul_`` under ``no_grad``, an EMA swap): their
        master takes the written value, as torch's optimizers start the next step from the parameters as they
        are. Local; no communication. Cost when nothing was written (the common case): one rounding of the
        master and one bitwise compare of the owned slice; the elementwise pass runs only when something was."""
        wire = self._param_wire(unit)
        stored = master.to(own.dtype)
        gathered = master.to(wire).to(own.dtype) if wire != own.dtype else stored  # what the gather left there
        if _same_bits(own, gathered) or (gathered is not stored and _same_bits(own, stored)):
            return
        edited = own != stored
        if gathered is not stored:
            edited &= own != gathered
        edited &= ~(own.isnan() & stored.isnan())
        if bool(edited.any()):
            master.copy_(torch.where(edited, own.to(master.dtype), master))

    def _new_adamw_state(self, unit: _Unit) -> dict[str, Any]:
        return {"steps": [0] * len(unit.params), "exp_avg": torch.zeros_like(unit.grad_shard),
                "exp_avg_sq": torch.zeros_like(unit.grad_shard)}

    @staticmethod
    def _adamw_runs(lay: UnitLayout, used: list[bool], steps: list[int], lo: int,
                    hi: int) -> list[tuple[int, int, int]]:
        """Shard-relative ``[a, b)`` ranges of the owned slice ``[lo, hi)`` covered by used members,
        adjacent members with equal steps merged: ``(a, b, step)`` per range."""
        runs: list[tuple[int, int, int]] = []
        for mi, m in enumerate(lay.members):  # members are in offset order
            a, b = max(lo, m.offset) - lo, min(hi, m.offset + m.numel) - lo
            if not used[mi] or a >= b:
                continue
            if runs and runs[-1][1] == a and runs[-1][2] == steps[mi]:
                runs[-1] = (runs[-1][0], b, steps[mi])
            else:
                runs.append((a, b, steps[mi]))
        return runs

    def _adamw_step(self, ui: int, unit: _Unit, group: dict, rank: int, used: list[bool]) -> None:
        """AdamW on the owned slice for the members some rank used; each member counts its own step
        (torch's per-parameter ``step``). One fused update over the whole slice when every member was
        used and all steps agree; otherwise one per run of adjacent used members with equal steps."""
        # used on no rank: nothing changes (no moment decay, weight decay or step); only an fp32
        # master is still created at the unit's first step, before the gather rounds the parameters
        if not any(used) and not self._needs_master(unit):
            return
        lo, hi = unit.layout.owner_range(rank)
        shard = unit.param_buf[lo:hi]
        state = self.state[ui]
        if not state:
            state.update(self._new_adamw_state(unit))
        target = self._master(unit, shard, state)
        if not any(used):
            return
        steps = state["steps"]
        for mi, u in enumerate(used):
            if u:
                steps[mi] += 1
        beta1, beta2 = group["betas"]
        hp = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        ea, eas, g = state["exp_avg"], state["exp_avg_sq"], unit.grad_shard
        if all(used) and all(s == steps[0] for s in steps):
            adamw_update_(target, g, ea, eas, step=steps[0], **hp)
        else:
            for a, b, step in self._adamw_runs(unit.layout, used, steps, lo, hi):
                adamw_update_(target[a:b], g[a:b], ea[a:b], eas[a:b], step=step, **hp)
        if target is not shard:
            shard.copy_(target)

    @staticmethod
    def _owned_members(lay: UnitLayout, rank: int) -> list[int]:
        """Member indices of the matrices ``rank`` owns in a Muon unit, in slot order."""
        assert lay.matrix_shape is not None and lay.real_per_rank is not None
        size = lay.matrix_shape[0] * lay.matrix_shape[1]
        first = rank * lay.slots_per_rank
        owned = {m.offset // size - first: mi for mi, m in enumerate(lay.members)}
        return [owned[j] for j in range(lay.real_per_rank[rank])]

    def _muon_step(self, ui: int, unit: _Unit, group: dict, rank: int, used: list[bool]) -> None:
        """Muon on the owned matrices some rank used (a matrix used on no rank: momentum not decayed,
        matrix not updated; an fp32 master is still created at the unit's first step)."""
        if not any(used) and not self._needs_master(unit):
            return
        lay = unit.layout
        assert lay.matrix_shape is not None and lay.real_per_rank is not None
        rows, cols = lay.matrix_shape
        c = lay.slots_per_rank
        real = lay.real_per_rank[rank]
        state = self.state[ui]
        if not state:
            state["momentum_buffer"] = torch.zeros(real, rows, cols, dtype=unit.grad_shard.dtype,
                                                   device=unit.grad_shard.device)
        if real == 0:
            return
        own = unit.param_buf.view(-1, rows, cols)[rank * c:rank * c + real]
        target = self._master(unit, own, state)
        sel = [j for j, mi in enumerate(self._owned_members(lay, rank)) if used[mi]]
        if not sel:
            return
        grads = unit.grad_shard.view(c, rows, cols)[:real]
        mom = state["momentum_buffer"]
        hp = dict(lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"],
                  weight_decay=group["weight_decay"], ns_method=group["ns_method"], ns_steps=group["ns_steps"],
                  ns_dtype=group["ns_dtype"])
        if len(sel) == real:
            muon_update_(target, grads, mom, **hp)
        else:
            idx = torch.tensor(sel, dtype=torch.long, device=mom.device)
            sub_t, sub_m = target.index_select(0, idx), mom.index_select(0, idx)
            muon_update_(sub_t, grads.index_select(0, idx), sub_m, **hp)
            target.index_copy_(0, idx, sub_t)
            mom.index_copy_(0, idx, sub_m)
        if target is not own:
            own.copy_(target)

    # -------------------------------------------------------------------------- sparse tables
    @property
    def sparse_units(self) -> dict[str, SparseTableUnit]:
        """The row-sparse table units by table name."""
        return {su.table.name: su for su in self._sparse.values()}

    def observe_tokens(self, tokens: torch.Tensor) -> None:
        """Record this step's host token ids (a batch or one microbatch; call before forward) for the
        sparse tables' touched rows. No communication."""
        for su in self._sparse.values():
            su.observe(tokens)

    def plan_sparse(self) -> None:
        """Run the count all-gather of every sparse table with observed tokens now (before forward),
        in unit order; raises the out-of-range-token ``ValueError`` on every rank alike. Optional (the
        launch does it otherwise); call it on every rank alike."""
        for su in self._sparse.values():
            su.plan()

    def sparse_stats(self) -> dict[str, Any]:
        """Last step's :class:`lowband.comm.sparse.SparseStats` per sparse table (density, bytes, mode)."""
        return {su.table.name: su.stats for su in self._sparse.values() if su.stats is not None}

    # ------------------------------------------------------------------------- introspection
    @property
    def units(self) -> list[UnitLayout]:
        """The communication units (layouts), in reduce-scatter launch order (backward order; the parameter
        all-gathers run in forward order, see the module docstring)."""
        return [u.layout for u in self._units]

    @property
    def gather_order(self) -> list[int]:
        """Indices into :attr:`units` in the order :meth:`step` updates them and launches their parameter
        all-gathers (forward order, see the module docstring)."""
        return list(self._gather_order)

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank (moments / momentum of owned slices)."""
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))

    def _packed_groups(self) -> list[dict]:
        out, idx = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(idx, idx + len(g["params"])))
            idx += len(g["params"])
            out.append(packed)
        return out

    def _load_groups(self, groups: list[dict], what: str) -> None:
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError(f"{what}: param_groups do not match this optimizer's (number of groups or "
                             "parameters per group differ)")
        for saved, g in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v
        self._refuse_unimplemented()  # a torch AdamW state dict saved with amsgrad / maximize
        lrs = [float(g["lr"]) for g in self.param_groups]
        if any(lr != 0 for lr in lrs):  # the saved lrs carry the ratio the run was using
            self._base_lrs = lrs
        self._reset_residuals()  # every load passes here: loaded state carries no gradient residual

    # ---------------------------------------------------------------------------- state dicts
    @torch.no_grad()
    def state_dict(self) -> dict:  # type: ignore[override]
        """The optimizer state for ``torch.distributed.checkpoint`` (collective: call on every rank).

        On more than one rank it holds this rank's chunks only, and says so: every ``Shard(0)`` DTensor
        carries ``_lowband_shard_of = (rank, world_size)`` (a Python attribute, kept by ``torch.save`` /
        ``torch.load`` and ``copy.deepcopy``; torch DCP loads in place into the loading rank's own
        DTensors, so it never carries another rank's), checked by :meth:`load_state_dict`, which refuses
        the state on another rank or world size, on every rank alike.

        ``{"state": {param_index: {"step", "exp_avg", "exp_avg_sq"} | {"momentum_buffer"} (+ "master")},
        "param_groups": [...]}`` in ``torch.optim`` numbering, each state tensor a ``Shard(0)`` DTensor
        of the parameter's full shape over this optimizer's group (a plain tensor on one rank), ``step``
        a float32 scalar; see :mod:`lowband.optim.sharded_state`. torch's
        ``get_state_dict(model, opt)`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` work on it,
        and reshard it to any world size. Every trainable parameter has an entry (what its first step
        would create if it has not stepped). Communication: one ``all_to_all`` per unit over the state
        group (``tag="state"``): each element moves once from the rank that owns it to the rank whose
        ``Shard(0)`` chunk holds it, never a gather (:mod:`lowband.optim.sharded_exchange`); a 0-d parameter's
        state, which has no rows, is a plain tensor its owner sends to every rank (DCP writes it once).
        :meth:`load_state_dict` of this form is the same exchange backwards (the owner of a 0-d parameter takes
        its own copy).
        For this rank's raw shard (no communication, same layout only) use :meth:`shard_state_dict`.
        """
        if self.comm.size == 1:
            full = self.logical_state_dict()  # one rank: plain tensors
            shard0 = self._shard0()
            state = {i: {k: (v if k == "step" else shard0.shard(v)) for k, v in st.items()}
                     for i, st in full["state"].items()}
            return {"state": state, "param_groups": full["param_groups"]}
        with self._state_call("state_dict"):
            self._wait_gathers()
            chunks = to_shard0(self)
        shard0 = self._shard0()
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for ui, unit in enumerate(self._units):
            steps = self.state.get(ui, {}).get("steps")
            for mi, m in enumerate(unit.layout.members):
                entry = {k: shard0.wrap(v, tuple(params[m.index].shape)) for k, v in chunks[m.index].items()}
                if unit.layout.kind == "adamw":
                    entry = {"step": torch.tensor(float(steps[mi] if steps else 0), dtype=torch.float32), **entry}
                state[m.index] = entry
        return {"state": dict(sorted(state.items())), "param_groups": self._packed_groups()}

    @torch.no_grad()
    def logical_state_dict(self) -> dict:
        """:meth:`full_state_dict` with an entry for every trainable parameter (collective).

        A parameter that has not stepped gets what its first step would create (zero moments /
        momentum, ``step`` 0, its master the parameter itself), so every parameter has every key;
        ``step`` is a float32 scalar. Identical on every rank; the gathered form of :meth:`state_dict`
        (which keeps each rank's ``Shard(0)`` chunk of it). Communication: :meth:`full_state_dict`'s.
        """
        with self._state_call("state_dict"):
            full = self._full_state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for unit in self._units:
            acc = unit.grad_shard.dtype
            for m in unit.layout.members:
                p = params[m.index]
                st = full["state"].get(m.index)
                if st is None:  # not stepped yet: what the first step creates
                    zeros = torch.zeros(p.shape, dtype=acc, device=p.device)
                    st = ({"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
                          if unit.layout.kind == "adamw" else {"momentum_buffer": zeros})
                    if self._needs_master(unit):
                        st["master"] = p.detach().to(acc, copy=True)
                state[m.index] = {k: (v.detach().to(torch.float32).clone() if k == "step" else
                                      v.detach().reshape(p.shape)) for k, v in st.items()}
        return {"state": dict(sorted(state.items())), "param_groups": full["param_groups"]}

    @contextlib.contextmanager
    def _state_call(self, what: str) -> Iterator[None]:
        """Turn a state collective's timeout (``state_timeout``) into one line naming the call."""
        try:
            yield
        except RuntimeError as e:
            if self.comm.size > 1 and "time" in str(e).lower() and "out" in str(e).lower():
                raise RuntimeError(
                    f"{type(self).__name__}.{what}: its collective did not complete within state_timeout="
                    f"{self.state_timeout:g} s: {what}() is collective, call it on every rank (e.g. every rank calls "
                    "opt.full_state_dict(), rank 0 torch.save-s it and every rank passes it to "
                    "load_full_state_dict(); or torch.distributed.checkpoint's get_state_dict + dcp.save)") from None
            raise

    def _check_saved_by(self, state: dict) -> None:
        """Refuse, on every rank alike, ``Shard(0)`` DTensors that another rank (or world size) made
        (their ``_lowband_shard_of``; one ``all_gather_object``, ``tag="state"``, when any DTensor is
        present)."""
        from torch.distributed.tensor import DTensor

        values = [v for st in state.values() if isinstance(st, dict) for v in st.values()]
        if not any(isinstance(v, DTensor) for v in values):
            return
        mine = sorted({getattr(v, "_lowband_shard_of", None) for v in values if isinstance(v, DTensor)} - {None})
        everyone = self._state_comm.all_gather_object(mine, tag="state")
        n = self.comm.size
        bad = [(r, e) for r, stamps in enumerate(everyone) for e in stamps if tuple(e) != (r, n)]
        if bad:
            r, e = bad[0]
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: rank {r} of {n} got a state_dict() saved by rank "
                f"{e[0]} of {e[1]}, which holds only that rank's shard of the optimizer "
                "state (e.g. rank 0 saved it and every rank loads it): save full_state_dict() (called on every "
                "rank) and load it with load_full_state_dict() on every rank, or use torch DCP "
                "(get_state_dict / set_state_dict with dcp.save / dcp.load)")

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict` (collective when it holds DTensors: call on every rank), saved at
        any world size, also as torch's ``set_state_dict`` hands it over (keys named by parameter
        path); a plain ``torch.optim`` full state dict; or a :meth:`shard_state_dict` of this rank.

        ``Shard(0)`` DTensors of this world size holding every state key of every parameter (what
        :meth:`state_dict` returns, or its template filled by ``dcp.load``) are exchanged back to their
        owners with one ``all_to_all`` per unit; other DTensors are gathered (one all-gather per dtype,
        ``tag="state"``)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("ShardedOptimizer.load_state_dict: expected a dict with 'state' and 'param_groups'")
        if "sharding" in state_dict:
            self.load_shard_state_dict(state_dict)
            return
        with self._state_call("load_state_dict"):
            self._check_saved_by(state_dict["state"])
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        keyed = self._index_state(state_dict, "load_state_dict")
        if self.comm.size > 1 and shard0_ready(self, keyed):
            self._install_owned(load_shard0(self, keyed), keyed)
            return
        flat = {(i, k): v for i, st in keyed.items() for k, v in st.items()}
        gathered = self._shard0().gather(flat)
        full: dict[int, dict[str, Any]] = {}
        for (i, k), v in gathered.items():
            full.setdefault(i, {})[k] = v
        groups = [dict(g, params=list(range(len(g["params"])))) for g in state_dict["param_groups"]]
        self.load_full_state_dict({"state": full, "param_groups": groups, "_indexed": True})

    def _shard0(self) -> Any:
        from lowband.optim.sharded_state import Shard0

        if getattr(self, "_shard0_cache", None) is None:
            self._shard0_cache = Shard0(self._state_comm)
        return self._shard0_cache

    def _index_state(self, state_dict: dict, what: str) -> dict[int, dict]:
        """``state`` keyed by flat parameter index: saved keys (ints, or parameter paths as torch's
        ``set_state_dict`` passes them) map by position in the saved groups' ``params`` lists."""
        groups = state_dict["param_groups"]
        self._load_groups(groups, what)
        index: dict[Any, int] = {}
        start = 0
        for saved, g in zip(groups, self.param_groups):
            for j, key in enumerate(saved["params"]):
                index[key] = start + j
            start += len(g["params"])
        out = {}
        for k, v in state_dict["state"].items():
            if k not in index:
                raise ValueError(f"{what}: state key {k!r} is not in the saved param_groups' params")
            out[index[k]] = v
        return out

    def shard_state_dict(self) -> dict:
        """This rank's shard of the state (no communication).

        ``{"state": {unit_index: {...}}, "param_groups": [...], "sharding": {"world_size", "rank",
        "layout"}}``. Load it with :meth:`load_shard_state_dict` into an optimizer with the same layout
        (same world size, parameters, groups and ``bucket_mb``); to change the world size use
        :meth:`state_dict` or :meth:`full_state_dict`.
        """
        self._wait_gathers()
        state = {ui: {k: (list(v) if k == "steps" else v) for k, v in st.items()} for ui, st in self.state.items()}
        return {"state": state, "param_groups": self._packed_groups(),
                "sharding": {"world_size": self.comm.size, "rank": self.comm.rank, "layout": self._layout_id}}

    def load_shard_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`shard_state_dict` taken on this rank of an identically laid-out optimizer."""
        sh = state_dict.get("sharding") if isinstance(state_dict, dict) else None
        if sh is None:
            raise ValueError("load_shard_state_dict: not a shard state dict (no 'sharding' key); for a "
                             "torch-format state dict use load_state_dict or load_full_state_dict")
        if (sh["world_size"], sh["rank"], sh["layout"]) != (self.comm.size, self.comm.rank, self._layout_id):
            raise ValueError(f"load_shard_state_dict: saved with world_size={sh['world_size']}, rank={sh['rank']}, "
                             f"layout={sh['layout']}; this optimizer has world_size={self.comm.size}, "
                             f"rank={self.comm.rank}, layout={self._layout_id}; use state_dict / "
                             "load_state_dict (or full_state_dict / load_full_state_dict) to reshard")
        self._load_groups(state_dict["param_groups"], "load_shard_state_dict")
        self.state.clear()
        for ui, st in state_dict["state"].items():
            unit = self._units[int(ui)]
            dev, acc = unit.grad_shard.device, unit.grad_shard.dtype
            new = {k: (v.to(device=dev, dtype=acc).clone() if isinstance(v, torch.Tensor) else v)
                   for k, v in st.items() if k != "step"}
            if unit.layout.kind == "adamw":  # per-member steps; an older shard's one unit step goes to all
                steps = st["steps"] if "steps" in st else [int(st["step"])] * len(unit.params)
                if len(steps) != len(unit.params):
                    raise ValueError(f"load_shard_state_dict: unit {ui} has {len(unit.params)} parameters but "
                                     f"{len(steps)} step counts")
                new["steps"] = [int(x) for x in steps]
            self.state[int(ui)] = new

    def full_state_dict(self, *, cpu_offload: bool = False, rank0_only: bool = False) -> dict:
        """The whole optimizer state in ``torch.optim`` format, identical on every rank (collective).

        ``{"state": {param_index: {"step", "exp_avg", "exp_avg_sq"} | {"momentum_buffer"}},
        "param_groups": [...]}``, parameter indices in param-group order, as
        ``torch.optim.AdamW.state_dict()`` numbers them, ``step`` per parameter. An AdamW parameter
        never used has no entry (as in torch) unless its unit keeps fp32 masters (then step 0, zero
        moments and its master). Every rank must call it; it issues one all-gather per state tensor
        per unit that has state (``tag="state"``), on a group of its own whose timeout is
        ``state_timeout``: called on some ranks only, it ends with one line after that time.

        State too large to gather on one device: each state tensor of a unit is gathered, cut into its
        parameters' entries and released before the next one, so beside the result the device holds one
        gathered state tensor of one unit at a time. ``cpu_offload=True`` puts the entries in host memory
        as they are cut (the device then holds only that one tensor), ``rank0_only=True`` keeps them on
        the optimizer group's rank 0 only: the other ranks take part in every gather and return ``{}``
        (torch's ``get_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True,
        cpu_offload=True)`` does both). Same collectives and bytes either way.
        """
        with self._state_call("full_state_dict"):
            return self._full_state_dict(cpu_offload=cpu_offload, rank0_only=rank0_only)

    @torch.no_grad()
    def _full_state_dict(self, *, cpu_offload: bool = False, rank0_only: bool = False) -> dict:
        self._wait_gathers()
        rank = self.comm.rank
        keep = not rank0_only or rank == 0
        out: dict[int, dict] = {}

        def entry(full: torch.Tensor, start: int, numel: int, shape: torch.Size) -> torch.Tensor:
            piece = full[start:start + numel].view(shape)
            return piece.to("cpu", copy=True) if cpu_offload else piece.clone()

        for ui, unit in enumerate(self._units):
            st = self.state.get(ui)
            lay = unit.layout
            if not st:
                continue
            if lay.kind == "adamw":
                keep_unstepped = self._needs_master(unit)  # its master is state even before a first use
                stepped = [(mi, m) for mi, m in enumerate(lay.members)  # never used: no state, as in torch
                           if st["steps"][mi] != 0 or keep_unstepped]
                if keep:
                    for mi, m in stepped:
                        out[m.index] = {"step": torch.tensor(float(st["steps"][mi]), dtype=torch.float32)}
                for key in ("exp_avg", "exp_avg_sq"):  # one gathered tensor alive at a time
                    full = torch.empty(lay.numel, dtype=st[key].dtype, device=st[key].device)
                    self._state_comm.all_gather(full, st[key], tag="state")
                    if keep:
                        for _, m in stepped:
                            out[m.index][key] = entry(full, m.offset, m.numel, m.shape)
                    del full
            else:
                assert lay.matrix_shape is not None and lay.real_per_rank is not None
                rows, cols = lay.matrix_shape
                c = lay.slots_per_rank
                mom = st["momentum_buffer"]
                chunk = torch.zeros(c, rows, cols, dtype=mom.dtype, device=mom.device)
                chunk[:lay.real_per_rank[rank]].copy_(mom)
                full = torch.empty(lay.numel, dtype=mom.dtype, device=mom.device)
                self._state_comm.all_gather(full, chunk, tag="state")
                del chunk
                if keep:
                    for m in lay.members:
                        out[m.index] = {"momentum_buffer": entry(full, m.offset, rows * cols, torch.Size((rows, cols)))}
                del full
            if self._needs_master(unit):
                master = self._gather_master(ui)
                if keep:
                    for m in lay.members:
                        if m.index in out:
                            out[m.index]["master"] = entry(master, m.offset, m.numel, m.shape)
                del master
        if not keep:
            return {}
        return {"state": dict(sorted(out.items())), "param_groups": self._packed_groups()}

    def _needs_master(self, unit: _Unit) -> bool:
        """The fp32-master rule (see :meth:`_master`): parameters travel or are stored narrower than
        the accumulation dtype."""
        acc = unit.grad_shard.dtype
        return not (unit.layout.dtype == acc and self._param_wire(unit) == unit.layout.dtype)

    def _gather_master(self, ui: int) -> torch.Tensor:
        """Unit ``ui``'s masters over its whole flat space (one all-gather, ``tag="state"``); a slice
        whose owner has not stepped yet contributes the master its first step would create."""
        unit = self._units[ui]
        lay, acc = unit.layout, unit.grad_shard.dtype
        local = owned_master(self, ui)
        if lay.kind == "muon":  # its real matrices, then zeros for the empty slots of the rank's chunk
            padded = torch.zeros(lay.shard_numel, dtype=acc, device=unit.grad_shard.device)
            padded[:local.numel()].copy_(local)
            local = padded
        full = torch.empty(lay.numel, dtype=acc, device=unit.grad_shard.device)
        self._state_comm.all_gather(full, local.contiguous().reshape(-1), tag="state")
        return full

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict | None, *, from_rank0: bool = False) -> None:
        """Load a :meth:`full_state_dict` (or a ``torch.optim.AdamW`` state dict for AdamW groups),
        taking this rank's slices; no communication, any world size. A parameter missing from
        ``state`` has not stepped yet (zeros, AdamW step 0); each AdamW parameter keeps its own step.

        ``from_rank0=True`` (collective over the optimizer's group, on its state group with ``state_timeout``):
        only the group's rank 0 passes the state dict (the others pass ``None``), e.g. the file rank 0 saved from
        ``full_state_dict(cpu_offload=True, rank0_only=True)``; no other rank ever holds the whole state. Rank 0
        sends the structure (parameter groups, which entries exist, their shapes and dtypes; one
        ``all_gather_object``), then each state tensor, parameter by parameter, unit by unit (one ``broadcast``
        each, ``tag="state"``, on the optimizer's device), and every rank takes its slices before the next unit
        (torch's ``set_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True,
        broadcast_from_rank0=True)``). A state dict rank 0 cannot load is refused on every rank, with rank 0's
        error.
        """
        if from_rank0:
            self._load_full_from_rank0(state_dict)
            return
        if state_dict is None:
            raise ValueError("load_full_state_dict: no state dict (None); pass from_rank0=True when only rank 0 "
                             "holds it")
        saved = self._saved_by_index(state_dict)
        self.state.clear()
        for ui in range(len(self._units)):
            self._load_unit(ui, saved)

    def _saved_by_index(self, state_dict: dict) -> dict[int, dict]:
        """A full state dict's entries keyed by flat parameter index (its param groups checked and loaded)."""
        if state_dict.get("_indexed"):
            self._load_groups(state_dict["param_groups"], "load_full_state_dict")
            return {int(k): v for k, v in state_dict["state"].items()}
        return self._index_state(state_dict, "load_full_state_dict")

    def _load_full_from_rank0(self, state_dict: dict | None) -> None:
        """:meth:`load_full_state_dict` with ``from_rank0=True`` (see there)."""
        comm, root = self._state_comm, self.comm.rank == 0
        header: dict[str, Any] = {}
        saved: dict[int, dict] = {}
        if root:
            try:
                if state_dict is None:
                    raise ValueError("load_full_state_dict(from_rank0=True): rank 0 passed no state dict (None)")
                groups = state_dict["param_groups"]
                saved = self._saved_by_index(state_dict)
                header = {"groups": groups, "entries": {
                    i: {k: (("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."))
                            if isinstance(v, torch.Tensor) and k != "step" else ("value", float(v)))
                        for k, v in st.items()} for i, st in saved.items()}}
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                header = {"error": f"{type(e).__name__}: {e}"}
        with self._state_call("load_full_state_dict"):
            header = comm.all_gather_object(header if root else None, tag="state")[0]
        if "error" in header:
            raise ValueError(f"load_full_state_dict(from_rank0=True): rank 0 could not load its state dict "
                             f"({header['error']})")
        if not root:
            self._load_groups(header["groups"], "load_full_state_dict")
        entries: dict[int, dict] = {int(i): st for i, st in header["entries"].items()}
        self.state.clear()
        for ui, unit in enumerate(self._units):
            dev = unit.grad_shard.device
            part: dict[int, dict] = {}
            for m in unit.layout.members:
                if m.index not in entries:
                    continue
                part[m.index] = {}
                for key, (kind, *spec) in entries[m.index].items():
                    if kind == "value":
                        part[m.index][key] = torch.tensor(spec[0])
                        continue
                    shape, dtype = spec
                    if root:  # one tensor at a time on the device (read only: every rank copies its slices)
                        t = saved[m.index][key].detach().to(device=dev).contiguous()
                    else:
                        t = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
                    with self._state_call("load_full_state_dict"):
                        comm.broadcast(t, 0, tag="state")
                    part[m.index][key] = t
            self._load_unit(ui, part)

    def _load_unit(self, ui: int, saved: dict[int, dict]) -> None:
        """Take this rank's slices of unit ``ui``'s entries in ``saved`` (keyed by flat parameter index)."""
        rank = self.comm.rank
        unit = self._units[ui]
        lay = unit.layout
        present = [m for m in lay.members if m.index in saved]
        if not present:
            return
        acc, dev = unit.grad_shard.dtype, unit.grad_shard.device
        if lay.kind == "adamw":
            lo, hi = lay.owner_range(rank)
            st: dict[str, Any] = {"steps": [int(float(saved[m.index]["step"])) if m.index in saved else 0
                                            for m in lay.members]}
            for key in ("exp_avg", "exp_avg_sq"):
                shard = torch.zeros(lay.shard_numel, dtype=acc, device=dev)
                for m in present:
                    a, b = max(lo, m.offset), min(hi, m.offset + m.numel)
                    if a < b:
                        src = saved[m.index][key].reshape(-1)
                        shard[a - lo:b - lo].copy_(src[a - m.offset:b - m.offset])
                st[key] = shard
            self.state[ui] = st
        else:
            assert lay.matrix_shape is not None and lay.real_per_rank is not None
            rows, cols = lay.matrix_shape
            c = lay.slots_per_rank
            real = lay.real_per_rank[rank]
            mom = torch.zeros(real, rows, cols, dtype=acc, device=dev)
            for m in present:
                slot = m.offset // (rows * cols) - rank * c
                if 0 <= slot < real:
                    mom[slot].copy_(saved[m.index]["momentum_buffer"])
            self.state[ui] = {"momentum_buffer": mom}
        if self._needs_master(unit) and all("master" in saved[m.index] for m in present):
            self._install_master(ui, {m.index: saved[m.index]["master"] for m in present})

    def _install_owned(self, owned: dict[int, dict[str, torch.Tensor]], keyed: dict[int, dict]) -> None:
        """Install this rank's owned state per unit (1-D over its owned range, from
        :func:`~lowband.optim.sharded_exchange.load_shard0`) and the AdamW step counters of ``keyed``."""
        self.state.clear()
        for ui, unit in enumerate(self._units):
            lay = unit.layout
            st: dict[str, Any] = {}
            if lay.kind == "adamw":
                st["steps"] = [int(float(keyed[m.index]["step"])) if "step" in keyed[m.index] else 0
                               for m in lay.members]
            for key, flat in owned[ui].items():
                if lay.kind == "adamw":
                    st[key] = flat
                else:
                    assert lay.matrix_shape is not None
                    st[key] = flat.view(-1, *lay.matrix_shape)
            self.state[ui] = st

    def _install_master(self, ui: int, per_member: dict[int, torch.Tensor]) -> None:
        """Take this rank's slice of saved fp32 masters (members missing from ``per_member`` start from
        the parameter, as a first step would)."""
        unit = self._units[ui]
        lay, acc, rank = unit.layout, unit.grad_shard.dtype, self.comm.rank
        full = unit.param_buf.to(acc, copy=True)
        for m in lay.members:
            if m.index in per_member:
                full[m.offset:m.offset + m.numel].copy_(per_member[m.index].reshape(-1))
        if lay.kind == "adamw":
            lo, hi = lay.owner_range(rank)
            master = full[lo:hi].clone()
        else:
            assert lay.matrix_shape is not None and lay.real_per_rank is not None
            rows, cols = lay.matrix_shape
            c, real = lay.slots_per_rank, lay.real_per_rank[rank]
            master = full.view(-1, rows, cols)[rank * c:rank * c + real].clone()
        self.state[ui]["master"] = master

    def remove_hooks(self) -> None:
        """Remove the gradient and forward hooks this optimizer registered."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class ShardedAdamW(ShardedOptimizer):
    """:class:`ShardedOptimizer` with every group on AdamW (torch ``AdamW`` defaults)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, algorithm="adamw",
                         **kwargs)


class ShardedMuon(ShardedOptimizer):
    """Muon for ``muon_params`` (2-D hidden matrices) and AdamW for ``adamw_params`` (embeddings,
    head, 1-D parameters), driven by one :class:`ShardedOptimizer` (group 0 Muon at ``lr``, group 1
    AdamW at ``adamw_lr``; either group is left out when its list is empty).

    The two lrs are separate keys of separate groups: schedule them by one factor (``LambdaLR``), never
    by writing one value into every group (caught at :meth:`step`, see :class:`ShardedOptimizer`).
    Split a model with :func:`lowband.plan.muon_split` (any model, optionally its plan) or
    :func:`split_params_for_muon` (name rules).
    """

    def __init__(self, muon_params: Iterable[torch.Tensor], adamw_params: Iterable[torch.Tensor], *,
                 lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
                 ns_method: str = "ns5", ns_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16,
                 adamw_lr: float = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0, **kwargs: Any) -> None:
        groups = []
        mp, ap = list(muon_params), list(adamw_params)
        if mp:
            groups.append({"params": mp, "algorithm": "muon", "lr": lr, "momentum": momentum,
                           "nesterov": nesterov, "weight_decay": weight_decay, "ns_method": ns_method,
                           "ns_steps": ns_steps, "ns_dtype": ns_dtype})
        if ap:
            groups.append({"params": ap, "algorithm": "adamw", "lr": adamw_lr, "betas": tuple(adamw_betas),
                           "eps": adamw_eps, "weight_decay": adamw_weight_decay})
        super().__init__(groups, ns_method=ns_method, ns_steps=ns_steps, ns_dtype=ns_dtype, **kwargs)


MUON_EXCLUDE = ("embed", "wte", "wpe", "head", "lm_head", "output")


def split_params_for_muon(model: nn.Module, exclude: Iterable[str] = MUON_EXCLUDE) -> tuple[list, list]:
    """Split ``model``'s parameters into (Muon, AdamW) lists.

    Muon gets the 2-D weights of ``nn.Linear`` modules whose qualified name contains none of
    ``exclude`` (substrings); AdamW gets everything else (embeddings, head, biases, norms, other
    parameters). Tied parameters are listed once.
    """
    excl = tuple(exclude)
    muon_ids: set[int] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not any(e in name for e in excl):
            muon_ids.add(id(mod.weight))
    muon, adamw = [], []
    for p in model.parameters():
        (muon if id(p) in muon_ids and p.dim() == 2 else adamw).append(p)
    return muon, adamw
