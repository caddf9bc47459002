"""`StreamingDiLoCo`: fragment-wise outer synchronisation across replica groups, driven by the inner
optimizer's step post-hook (the user's training loop does not change).

Schedule (see :mod:`lowband.diloco.schedule`): with ``n`` fragments, ``sync_every`` ``H`` and delay
``tau``, ``K = H / n``. After the inner step that brings the local step to ``K - tau`` the fragment
``committed % n`` is *prepared*: its pseudo-gradient ``global - local`` is packed into flat fp32
buckets (fp64 for fp64 models) on the parameters' device and each bucket's codec all-reduce (average
over replicas) is started asynchronously. Between prepare and sync every post-hook polls the
in-flight buckets (issuing their second phase as soon as the first is done), so the traffic overlaps
the next ``tau`` inner steps. After the step that brings it to ``K`` the fragment is *synced*: wait,
outer optimizer step on the averaged pseudo-gradient (on the global copy), ``committed += 1``, and the
fragment's weights become ``global + alpha (local - global)``; the local step returns to 0.

Communication (per sync, cross-replica group, tag ``diloco:frag<i>``): per bucket one all-to-all and
one all-gather of the encoded pseudo-gradient (``2 (N-1)/N`` of the encoded bytes per rank, see
:mod:`lowband.comm.codecs`). Once at construction (tag ``diloco:init``): one broadcast from replica 0
of every parameter of the model, trainable or frozen, and every buffer (``init_sync``, as DDP's
construction does), and two ``all_gather_object`` (tag ``validate``) checking that every replica has
the same settings, fragment shapes and parameter / buffer shapes, and the same outer optimizers (class and
param-group hyperparameters: another outer lr or momentum would step the same average differently).

Parameters and buffers outside the schedule (PyTorch semantics, docs/diloco.md "Frozen, unused and
conditional parameters"): a frozen parameter (``requires_grad=False`` at construction) is in no
fragment; after ``init_sync`` it is never communicated and never written. Buffers are made equal once,
by ``init_sync``, and never synced again: between syncs replicas train independently, so a buffer that
forward updates (running statistics, counters) evolves per replica. A fragment parameter that got no
gradient on some inner steps (the inner optimizer skips ``.grad is None``) simply moved less: its
pseudo-gradient ``global - local`` is averaged like any other, zero from a replica that never changed
it; the outer optimizer steps every fragment parameter (``.grad`` is always set, as in torchft), so with
outer momentum a parameter no replica touched since its last sync still moves by its momentum.

With a message codec (``int4``, ``int2``, ``topk``, ``topk-int4``, ``topk-int2``, ``topk-rice*``) each bucket is one
all-gather of every replica's message instead (``(N-1)`` messages per rank). **Error feedback**
(default on for lossy codecs below 8 bits and top-k, off for the torchft-compatible fp32/bf16/fp8/int8
unless asked): each replica adds its fragment's residual ``e`` to the pseudo-gradient before encoding
and keeps ``e' = (g + e) - decode(encode(g + e))`` (its own message's encoding error) for that
fragment's next sync; ``e'`` replaces ``e`` only when the sync commits (a rolled-back attempt keeps
``e``), and a replica healed from a peer starts with ``e = 0`` (its own dropped mass went with its
discarded local work). With ``ef_decay = beta < 1`` (SparseLoCo's error-feedback decay) the residual is
scaled first: the message encodes ``g + beta e`` and ``e' = (g + beta e) - decode(encode(g + beta e))``.
**Non-finite guard**: the averaged pseudo-gradient (bitwise the same on every replica) is checked at the
sync; if any element is NaN/inf every replica raises ``FloatingPointError`` naming the fragment, before the
outer step, and nothing is applied.

State layout: per fragment, a global copy of its parameters on ``backup_device`` (default CPU, pinned
when the model is on CUDA), one outer optimizer over those copies (so its state, e.g. SGD momentum,
lives there too) and, with error feedback, the residual (one flat buffer in the pseudo-gradient's
dtype, on ``backup_device``); the counters ``committed`` and ``local_step``. The inner optimizer and
the model are never replaced; the model's weights are written in place at each sync. The one state
format is :meth:`StreamingDiLoCo.state_dict` (:mod:`lowband.diloco.state`), DCP-ready. A sharded
parameter's padding (GTP's pad rows: part of the flat buffer, not of the weight) is zero in the averaged
pseudo-gradient and the residual after every sync (a mid-rise codec decodes a sent zero as +-scale/2), so
the global copies, outer momentum and weights keep it zero and a checkpoint, which holds real rows only,
resumes bit for bit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.comm import Comm, all_finite
from lowband.comm.codecs import DEFAULT_BLOCK_SIZE, check_wire, get_wire, is_lossless
from lowband.comm.compress import DEFAULT_TOPK_CHUNK, DEFAULT_TOPK_K, default_error_feedback
from lowband.diloco.fragments import Fragment, split_fragments
from lowband.diloco.membership import StaticMembership
from lowband.diloco.outer import (
    OuterOptimizerFactory,
    check_alpha,
    check_ef_decay,
    default_outer_optimizer,
    merge_,
    outer_step,
    pseudo_gradient_into,
)
from lowband.diloco.row_digest import row_digests
from lowband.diloco.schedule import PREPARE, SYNC, ScheduleConfig, actions_at, fragment_for
from lowband.parallel.gtp import is_gtp_param
from lowband.plan import ModelPlan
from lowband.sharding import padding_mask, placement_of

INIT_SYNC = (True, False, "broadcast", "verify")


@dataclass
class _InFlight:
    fragment: int
    flat: torch.Tensor
    handles: list[Any]
    residual: torch.Tensor | None = None  # the error-feedback residual this attempt leaves if it commits
    own_finite: bool = True


def _bucket_bounds(numel: int, cap_elems: int | None, breaks: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Buckets of a flat buffer: cut at every break, then every piece into ``cap_elems`` runs."""
    cuts = sorted({b for b in breaks if 0 < b < numel})
    out: list[tuple[int, int]] = []
    for lo, hi in zip([0, *cuts], [*cuts, numel], strict=True):
        if cap_elems is None or cap_elems >= hi - lo:
            out.append((lo, hi))
        else:
            out += [(s, min(s + cap_elems, hi)) for s in range(lo, hi, cap_elems)]
    return out


def whole_first(frag: Fragment) -> list[int]:
    """Reorder ``frag`` in place, its whole parameters first, then its GTP row shards, and return the bucket break
    between them (``[]`` when it holds one kind only). A block or top-k codec encodes each bucket alone, so the
    whole parameters, identical on every rank of a replica, then get identical averaged values on every rank
    whatever the row shards next to them hold; mixed in one block they took that block's rank-dependent scale and
    drifted apart inside the replica. (The trainer's ``diloco`` strategy calls it for every wire.)"""
    shard = [is_gtp_param(p) for p in frag.params]
    if all(shard) or not any(shard):
        return []
    whole = sum(p.numel() for p, s in zip(frag.params, shard, strict=True) if not s)
    order = [j for j, s in enumerate(shard) if not s] + [j for j, s in enumerate(shard) if s]
    frag.params[:] = [frag.params[j] for j in order]
    frag.names[:] = [frag.names[j] for j in order]
    return [whole]


def padding_index(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Positions, in the flat concatenation of ``params``, of their padding elements (a sharded parameter's
    elements outside its logical tensor: :func:`lowband.sharding.padding_mask`), as an int64 tensor; ``None``
    when there are none. No communication."""
    found, off = [], 0
    for p in params:
        pl = placement_of(p)
        mask = padding_mask(pl) if pl is not None else None
        if mask is not None:
            found.append(mask.reshape(-1).nonzero().squeeze(1) + off)
        off += p.numel()
    return torch.cat(found) if found else None


def outer_settings(outers: Iterable[torch.optim.Optimizer]) -> list[tuple[str, list[dict[str, object]]]]:
    """Per fragment: the outer optimizer's class and each param group's hyperparameters (one-element tensors as
    floats, tuples as lists), what every replica must share (taken at construction: a schedule the user attaches
    later is not compared)."""
    def plain(v: object) -> object:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return float(v)
        return list(v) if isinstance(v, tuple) else v

    return [(type(o).__name__, [{k: plain(v) for k, v in sorted(g.items()) if k != "params" and not callable(v)}
                                for g in o.param_groups]) for o in outers]


def weights_digest(tensors: Iterable[torch.Tensor]) -> str:
    """A hex digest (16 characters) of the bits of ``tensors``, in order."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _checksum(t: torch.Tensor) -> str:
    return weights_digest([t])


def init_state(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """What ``init_sync`` makes equal across replicas, in a fixed order: ``("parameter", name, p)`` for
    every parameter of ``model`` (each shared tensor once, under its first name), trainable or frozen,
    then ``("buffer", name, b)`` for every buffer (persistent or not), as DDP's construction does."""
    params = [("parameter", n, p) for n, p in model.named_parameters()]
    return params + [("buffer", n, b) for n, b in model.named_buffers()]


class _ModelLoadMarker:
    """The model's ``load_state_dict`` post-hook: tells its :class:`StreamingDiLoCo` (held weakly) that the model
    was loaded. A copy of the model (``copy.deepcopy``, pickle: an export's unsharded copy) gets an inert one."""

    def __init__(self, diloco: StreamingDiLoCo | None) -> None:
        self._diloco = None if diloco is None else weakref.ref(diloco)

    def __call__(self, _module: nn.Module, _keys: Any) -> None:
        diloco = None if self._diloco is None else self._diloco()
        if diloco is not None:
            diloco._model_loaded = True

    def __deepcopy__(self, _memo: dict) -> _ModelLoadMarker:
        return _ModelLoadMarker(None)

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return _ModelLoadMarker, (None,)


class StreamingDiLoCo:
    """Streaming DiLoCo around an existing model and inner optimizer.

    Args:
        model: the replica's model, weights initialised or pretrained weights loaded (the global copies are
            taken now; weights loaded later without :meth:`load_state_dict` are refused at the next step).
        inner_optimizer: the model's optimizer, or every optimizer that trains it (a list: torch's ``Muon`` for
            the matrices next to an ``AdamW`` for the rest); step hooks are registered on each. An inner step
            is counted (and a fragment prepared or synced) when every one of them has stepped once, whatever
            their order; one stepping twice before the others have is refused. A trainable fragment parameter
            that none of them holds is refused at construction.
        comm: the cross-replica group (the ranks at the same dp and GTP position in every replica:
            ``replica_mesh(...).replica``); ``None`` = the default process group (every rank its own
            replica; one replica without ``torch.distributed``). A group holding two ranks of one GTP group
            (they hold different row shards of a weight) is refused.
        sync_every: H, inner steps between two syncs of the same fragment.
        fragments: number of fragments (consecutive split of the units: the plan's ``fragment_units``
            when the model has a plan, else the default rule) or a list of modules / parameter lists
            (see :func:`lowband.diloco.fragments.split_fragments`). Tied parameters are synced once;
            frozen parameters (``requires_grad=False``) are left out of every fragment.
        delay: tau, inner steps between a fragment's prepare and its sync, in ``[0, H / n)``.
        alpha: merge weight of the local weights after a sync, in ``[0, 1]`` (0 = pure global).
        outer_optimizer: a factory ``params -> Optimizer`` used for every fragment, or a list of n
            factories (one per fragment); default SGD lr 0.7 momentum 0.9 Nesterov.
        wire: pseudo-gradient wire codec, one of ``lowband.comm.codecs.WIRE_CODECS``: ``fp32``,
            ``bf16``, ``fp8``, ``int8`` (two-phase all-reduce, ``fp64`` for tests) or ``int4``,
            ``int2``, ``topk``, ``topk-int4``, ``topk-int2``, ``topk-rice*`` (all-gather of messages).
        block_size: elements per fp32 scale for ``fp8``/``int8``/``int4``/``int2`` (and the values of
            ``topk-int*``).
        topk_chunk: top-k chunk (a power of two; offsets travel in ``log2`` of it bits).
        topk_k: values kept per chunk.
        error_feedback: keep each fragment's encoding residual and add it to its next pseudo-gradient;
            ``None`` (default) = on for the message codecs, off for the others.
        ef_decay: ``beta`` in ``(0, 1]``: the residual is multiplied by it before it is added (1 = plain error
            feedback; SparseLoCo / Covenant-72B use 0.95). Needs error feedback on when below 1.
        bucket_cap_mb: split a fragment's flat pseudo-gradient into buckets of at most this many MiB
            (of the fp32/fp64 buffer); ``None`` = one bucket per fragment.
        bucket_breaks: per fragment, element offsets into its flat pseudo-gradient where a bucket must
            end (before the cap applies). Each bucket is encoded on its own, so a block or top-k codec
            never mixes the values on either side: parameters identical on every rank of a replica
            (replicated next to GTP row shards) then get the same averaged values on every rank.
            ``None`` with a lossy wire: a fragment holding both GTP row shards and whole parameters is reordered
            whole parameters first, with a break before the shards (:func:`whole_first`).
        backup_device: where global copies, outer state and residuals live (default CPU).
        init_sync: how replicas start equal (models seeded per rank, nanoGPT style, start different):
            ``True`` / ``"broadcast"`` (default) broadcast every parameter (frozen ones too) and every
            buffer from replica 0; ``"verify"`` compare checksums and raise ``ValueError`` on every
            replica naming the first parameter or buffer that differs; ``False`` trust the caller.
        membership: who takes part in a sync; default :class:`StaticMembership` over ``comm``; or
            :class:`lowband.diloco.ft.TorchftMembership` (quorum, healing, rollback and retry).
        plan: the model's :class:`~lowband.plan.ModelPlan` (default: ``lowband.plan.plan_for(model)``);
            only ``fragment_units`` is used.

    Raises:
        ValueError: naming the value: H < n, n not dividing H, tau outside ``[0, H/n)``, alpha outside
            ``[0, 1]``, a list of outer optimizers of the wrong length, overlapping fragments (a tied
            parameter in two fragments named with all its names), fragments leaving trainable
            parameters out, an unknown wire codec or codec setting, settings that differ between
            replicas, weights that differ between replicas under ``init_sync="verify"``. All local
            checks run before any collective.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                 comm: Comm | None = None, sync_every: int,
                 fragments: int | Sequence[nn.Module | Iterable[nn.Parameter]] = 1, delay: int = 0,
                 alpha: float = 0.0,
                 outer_optimizer: OuterOptimizerFactory | Sequence[OuterOptimizerFactory] | None = None,
                 wire: str = "fp32", block_size: int = DEFAULT_BLOCK_SIZE,
                 topk_chunk: int = DEFAULT_TOPK_CHUNK, topk_k: int = DEFAULT_TOPK_K,
                 error_feedback: bool | None = None, ef_decay: float = 1.0,
                 bucket_cap_mb: float | None = None, bucket_breaks: Sequence[Sequence[int]] | None = None,
                 backup_device: str | torch.device = "cpu",
                 init_sync: bool | str = True, membership: Any = None, plan: ModelPlan | None = None) -> None:
        # ---- local validation (identical on every rank, before any collective)
        if not isinstance(model, nn.Module):
            raise TypeError(f"diloco model must be an nn.Module, got {type(model).__name__}")
        inner = [inner_optimizer] if isinstance(inner_optimizer, torch.optim.Optimizer) else (
            list(inner_optimizer) if isinstance(inner_optimizer, list | tuple) else None)
        if not inner or not all(isinstance(o, torch.optim.Optimizer) for o in inner):
            raise TypeError("diloco inner_optimizer must be a torch.optim.Optimizer or a non-empty list of them, "
                            f"got {type(inner_optimizer).__name__}")
        if len({id(o) for o in inner}) != len(inner):
            raise ValueError("diloco inner_optimizer: the list holds one optimizer twice")
        self.frags: list[Fragment] = split_fragments(model, fragments, plan=plan)
        held = {id(q) for opt in inner for g in opt.param_groups for q in g["params"]}
        orphans = [name for f in self.frags for name, q in zip(f.names, f.params, strict=True)
                   if q.requires_grad and id(q) not in held]
        if orphans:
            raise ValueError(
                f"diloco: {orphans[:5]} ({len(orphans)} parameters) require grad but no inner optimizer holds "
                f"{'it' if len(orphans) == 1 else 'them'}. If another optimizer trains them (torch.optim.Muon for the "
                "matrices next to an AdamW), pass every optimizer: inner_optimizer=[adamw, muon] (DiLoCo then syncs "
                "after all of them stepped; with one, the other stepped after a sync with a gradient taken before "
                "it); otherwise freeze them (requires_grad_(False)) before building StreamingDiLoCo")
        n = len(self.frags)
        self.schedule = ScheduleConfig(n, sync_every, delay)
        check_alpha(alpha)
        self.alpha = float(alpha)
        check_wire(wire, what="diloco wire")
        self.codec = get_wire(wire, block_size, topk_chunk, topk_k)
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"diloco error_feedback must be True, False or None (auto), got {error_feedback!r}")
        if init_sync not in INIT_SYNC or (isinstance(init_sync, int) and not isinstance(init_sync, bool)):
            raise ValueError(f"diloco init_sync={init_sync!r} is not one of {list(INIT_SYNC)}")
        cap = bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0):
            raise ValueError(f"diloco bucket_cap_mb={bucket_cap_mb!r} must be a positive number or None")
        if outer_optimizer is None:
            factories: list[OuterOptimizerFactory] = [default_outer_optimizer] * n
        elif callable(outer_optimizer):
            factories = [outer_optimizer] * n
        elif isinstance(outer_optimizer, Sequence):
            if len(outer_optimizer) != n:
                raise ValueError(f"diloco outer_optimizer: got a list of {len(outer_optimizer)}, expected "
                                 f"one per fragment ({n})")
            if not all(callable(f) for f in outer_optimizer):
                raise TypeError("diloco outer_optimizer list entries must be callables params -> Optimizer")
            factories = list(outer_optimizer)
        else:
            raise TypeError("diloco outer_optimizer must be None, a callable params -> Optimizer, or a list "
                            f"of them, got {type(outer_optimizer).__name__}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.inner_optimizers: list[torch.optim.Optimizer] = inner
        self._stepped_now: list[int] = []  # indices of the inner optimizers stepped in this inner step so far
        self.comm = (comm if comm is not None else Comm(name="replica")).private("diloco")
        self._refuse_replicas_inside_gtp()
        self.membership = membership if membership is not None else StaticMembership(self.comm)
        self.backup_device = torch.device(backup_device)
        self.buffer_dtypes = [torch.float64 if any(p.dtype == torch.float64 for p in f.params)
                              else torch.float32 for f in self.frags]
        self.bucket_cap_elems: list[int | None] = [
            None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20) // (8 if dt == torch.float64
                                                                                        else 4))
            for dt in self.buffer_dtypes]
        if error_feedback is None:
            error_feedback = default_error_feedback(wire)
        self.error_feedback = bool(error_feedback) and not all(is_lossless(self.codec, dt)
                                                               for dt in self.buffer_dtypes)
        check_ef_decay(ef_decay)
        if ef_decay != 1.0 and not self.error_feedback:
            raise ValueError(f"diloco ef_decay={ef_decay} decays the error-feedback residual, but error feedback "
                             f"is off (wire {wire!r}, error_feedback={error_feedback!r}): turn it on or leave "
                             "ef_decay at 1")
        self.ef_decay = float(ef_decay)
        if bucket_breaks is not None and len(bucket_breaks) != n:
            raise ValueError(f"diloco bucket_breaks: got {len(bucket_breaks)} lists, expected one per fragment ({n})")
        self.bucket_breaks: list[list[int]] = [sorted(int(b) for b in bs) for bs in bucket_breaks or [[]] * n]
        if bucket_breaks is None:  # GTP inside, lossy wire: the whole parameters are encoded apart from the shards
            for i, f in enumerate(self.frags):
                if not is_lossless(self.codec, self.buffer_dtypes[i]):
                    self.bucket_breaks[i] = whole_first(f)
        self._padding: list[torch.Tensor | None] = [padding_index(f.params) for f in self.frags]

        # ---- cross-replica checks and initial sync (collectives, every rank alike)
        # what every replica must share, by name: checked here across the static replicas, and by a membership
        # that changes (TorchftMembership) at the first sync of every new quorum
        self.agreed_settings: dict[str, object] = {
            "fragments": n, "alpha": self.alpha, "wire": wire, "block_size": self.codec.block_size,
            "topk_chunk": topk_chunk, "topk_k": topk_k, "error_feedback": self.error_feedback,
            "ef_decay": self.ef_decay,
            "bucket_cap_mb": bucket_cap_mb, "bucket_breaks": self.bucket_breaks,
            "fragment shapes": [[tuple(p.shape) for p in f.params] for f in self.frags],
            "fragment dtypes": [[str(p.dtype) for p in f.params] for f in self.frags]}
        schedule = (sync_every, delay) if getattr(self.membership, "uniform_schedule", True) else ()
        signature = (*self.agreed_settings.values(), *schedule, str(init_sync))
        state = init_state(model)
        if init_sync:  # every tensor init_sync covers must exist alike on every replica
            signature = (*signature, [(kind, name, tuple(t.shape), str(t.dtype)) for kind, name, t in state])
        self.comm.agree(signature, "diloco settings, fragment shapes and model state")
        if init_sync == "verify" and self.comm.size > 1:
            sums = [(kind, name, _checksum(t)) for kind, name, t in state]
            everyone = self.comm.all_gather_object(sums, tag="diloco:init")
            for j, (kind, name, _) in enumerate(sums):
                if any(other[j][2] != everyone[0][j][2] for other in everyone):
                    who = [r for r, other in enumerate(everyone) if other[j][2] != everyone[0][j][2]]
                    raise ValueError(f"diloco init_sync='verify': {kind} {name!r} differs between replicas "
                                     f"(replica 0 vs {who}); seed every replica alike or use "
                                     "init_sync='broadcast'")
        elif init_sync in (True, "broadcast") and self.comm.size > 1:
            with torch.no_grad():
                for _, _, t in state:
                    self.comm.broadcast(t.data, src=0, tag="diloco:init")
        self.init_sync = init_sync

        # ---- state: global copies, per-fragment outer optimizers, residuals on the backup device
        pin = self.backup_device.type == "cpu" and torch.cuda.is_available() and any(
            p.is_cuda for f in self.frags for p in f.params)
        self.globals: list[list[torch.Tensor]] = []
        for f in self.frags:
            copies = []
            for p in f.params:
                c = p.detach().to(self.backup_device, copy=True)
                if pin:
                    c = c.pin_memory()
                copies.append(c)
            self.globals.append(copies)
        self.outer: list[torch.optim.Optimizer] = [fac(g) for fac, g in zip(factories, self.globals,
                                                                           strict=True)]
        # replicas stepping the same average with another outer lr or momentum would drift apart silently
        self.agreed_settings["outer optimizer"] = outer_settings(self.outer)
        self.comm.agree(self.agreed_settings["outer optimizer"], "diloco outer optimizer (type and hyperparameters)")
        self.residuals: list[torch.Tensor | None] = [
            torch.zeros(f.numel, dtype=dt, device=self.backup_device) if self.error_feedback else None
            for f, dt in zip(self.frags, self.buffer_dtypes, strict=True)]
        self.committed = 0
        self.local_step = 0
        self._inflight: _InFlight | None = None
        self.dcp_meshes: dict = {}  # (device type, replicas, dp) -> DeviceMesh (replica axis first) of the
        # per-replica state rows (lowband.diloco.state.per_replica; the trainer puts its ParallelMesh's there)
        self._on_sync: list[Callable[[StreamingDiLoCo, int], None]] = []
        self._on_attempt: list[Callable[[StreamingDiLoCo, int, bool], None]] = []
        self._paused = False
        self.state_layout: Any = None
        """Maps a parameter's local tensors to their logical checkpoint form and back (``to_logical(name, t)``,
        ``to_local(name, t)``, ``weights``: the sharded names), when parameters are shards (GTP inside a
        replica: :class:`lowband.diloco.state.GTPShardLayout`, set here when a fragment holds a GTP shard);
        ``None`` = parameters are whole."""
        if any(is_gtp_param(p) for f in self.frags for p in f.params):
            from lowband.diloco.state import GTPShardLayout

            self.state_layout = GTPShardLayout(model)  # state_dict() then saves whole weights, not shards
        self._frag_ids = {id(p) for f in self.frags for p in f.params}
        self.check_trainable()
        self.membership.attach(self)
        # where the weights come from (checked before every inner step, see _check_weights_source): the fragment
        # parameters' version counters now, whether an inner step ran, and what was loaded since the last one
        self._built_versions = self._versions()
        self._stepped = False
        self._model_loaded = False
        self._written_before_paused = False  # fragment weights written before a paused() step, none unpaused yet
        self._state_loaded: tuple[int, int] | None = None  # (committed, local_step) of a loaded state
        self._saved_digests: dict[str, torch.Tensor] | None = None  # its weights' row digests (logical form)
        self._hooks = [h for j, opt in enumerate(inner) for h in (
            opt.register_step_post_hook(lambda *_, j=j: self._post_step_of(j)),
            opt.register_step_pre_hook(lambda *_, j=j: self._pre_step_of(j)))]
        self._hooks.append(model.register_load_state_dict_post_hook(_ModelLoadMarker(self)))

    def _refuse_replicas_inside_gtp(self) -> None:
        """Raise ``ValueError`` when the cross-replica group holds two ranks of the GTP group of a fragment
        parameter: those ranks hold different row shards of the weight, so init_sync would copy one's rows over
        the other's and every sync would average different rows (silently: the shards' shapes agree). Local,
        before any collective."""
        replicas = {self.comm.global_rank(i) for i in range(self.comm.size)}
        seen: set[int] = set()
        for f in self.frags:
            for name, p in zip(f.names, f.params, strict=True):
                gw = getattr(p, "gtp", None)
                if gw is None or id(gw.runtime) in seen:
                    continue
                seen.add(id(gw.runtime))
                group = gw.runtime.comm
                shared = sorted(replicas & {group.global_rank(i) for i in range(group.size)})
                if len(shared) > 1:
                    raise ValueError(
                        f"diloco: the cross-replica group {self.comm.name!r} holds ranks {shared} of the GTP group of "
                        f"{name!r} (comm=None is every rank): they hold different row shards of it, so the replicas "
                        "would average different rows. Pass comm= the ranks at the same GTP position in every "
                        "replica (lowband.parallel.build_mesh(replica=R, gtp=G).replica)")

    # ------------------------------------------------------------------------------ properties
    @property
    def num_fragments(self) -> int:
        return len(self.frags)

    @property
    def sync_every(self) -> int:
        return self.schedule.sync_every

    @property
    def delay(self) -> int:
        return self.schedule.delay

    @property
    def in_flight(self) -> int | None:
        """The fragment whose all-reduce is in flight (between prepare and sync), else ``None``."""
        return None if self._inflight is None else self._inflight.fragment

    def add_sync_callback(self, fn: Callable[[StreamingDiLoCo, int], None]) -> None:
        """Call ``fn(self, fragment)`` after every committed sync (tests, logging)."""
        self._on_sync.append(fn)

    def add_attempt_callback(self, fn: Callable[[StreamingDiLoCo, int, bool], None]) -> None:
        """Call ``fn(self, fragment, committed_ok)`` after every sync attempt, committed or not."""
        self._on_attempt.append(fn)

    # -------------------------------------------------------------------------------- the hook
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inner ``step()`` calls inside this context are not DiLoCo steps: the hooks do nothing (no
        local step counted, no membership call). For state-dict helpers that initialize an optimizer's
        state with a zero-lr step (torch's ``get_state_dict`` on a fresh optimizer)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def _versions(self) -> list[int]:
        return [p._version for f in self.frags for p in f.params]

    def _pre_step_of(self, j: int) -> None:
        """Inner optimizer ``j`` is about to step: the first of an inner step runs the checks."""
        if self._paused:
            self._pre_step()
            return
        if j in self._stepped_now:
            others = [i for i in range(len(self.inner_optimizers)) if i not in self._stepped_now]
            raise RuntimeError(
                f"diloco: inner optimizer {j} stepped again before inner optimizer(s) {others} stepped once (a "
                "GradScaler skipping one optimizer's step, a step() called twice): DiLoCo counts an inner step when "
                "every inner optimizer has stepped once, so the replicas' syncs would drift apart. Step every "
                "optimizer once per iteration (a fused torch optimizer takes GradScaler's skip into its own step)")
        if not self._stepped_now:
            self._pre_step()

    def _post_step_of(self, j: int) -> None:
        """Inner optimizer ``j`` stepped: the last of an inner step counts it."""
        if self._paused:
            self._post_step()
            return
        self._stepped_now.append(j)
        if len(self._stepped_now) == len(self.inner_optimizers):
            self._stepped_now = []
            self._post_step()

    def _pre_step(self) -> None:
        if self._paused:  # a paused step writes the weights (a zero-lr step still does in place): count what came first
            if not self._stepped and self._versions() != self._built_versions:
                self._written_before_paused = True
            return
        self._check_weights_source()
        if hasattr(self.membership, "before_step"):
            self.membership.before_step()

    def _check_weights_source(self) -> None:
        """Before an inner step: refuse weights that do not match the global copies' source (local, the same
        script on every replica: every replica raises at the same step).

        * The model was loaded (``model.load_state_dict`` since the last inner step, or any in-place write to a
          fragment parameter between construction and the first step: ``dcp.load``, ``copy_``) and DiLoCo's own
          state was not (:meth:`load_state_dict`, a heal's :meth:`load_outer_state`): the global copies are
          still the old weights, so the next sync would apply ``loaded - old`` as a pseudo-gradient.
        * Before the first step, a loaded state has progress (``committed`` or ``local_step`` > 0) while no
          fragment parameter was written since construction and ``init_sync`` made the replicas equal: every
          replica trains from replica 0's weights, its own (loaded before StreamingDiLoCo was built) lost.

        Writes through ``.data`` bump no version counter and are not seen."""
        written = self._model_loaded or (not self._stepped and (self._written_before_paused
                                                                 or self._versions() != self._built_versions))
        if written and self._state_loaded is None:
            how = ("model.load_state_dict() was called" if self._model_loaded else
                   "the weights were written in place (dcp.load, copy_)")
            raise ValueError(
                f"diloco: {how} after StreamingDiLoCo was built, but DiLoCo's own state was not loaded: its global "
                "copies are still the weights it was built from, so the next sync would apply the difference as "
                "a pseudo-gradient. To start from other weights (pretrained), load them before building "
                "StreamingDiLoCo; to resume, load its state too (dl.load_state_dict of a saved dl.state_dict(), "
                "or lowband.diloco.DilocoCheckpoint)")
        if (not self._stepped and not written and self._state_loaded is not None and any(self._state_loaded)
                and self.init_sync and self.comm.size > 1):
            committed, local_step = self._state_loaded
            raise ValueError(
                f"diloco: a state with progress was loaded (committed {committed}, local_step {local_step}), but no "
                f"model weight was loaded since StreamingDiLoCo was built with init_sync={self.init_sync!r}: every "
                "replica holds replica 0's weights (a model loaded before building is overwritten by init_sync), "
                "so each replica's own progress is lost. Load each replica's model after building StreamingDiLoCo, "
                "or build it with init_sync=False when every replica loads its own weights first")
        if self._state_loaded is not None and self._saved_digests is not None:
            self._check_saved_digests(self._saved_digests)
        self._model_loaded = self._written_before_paused = False
        self._state_loaded = self._saved_digests = None
        self._stepped = True

    def _check_saved_digests(self, saved: dict[str, torch.Tensor]) -> None:
        """Refuse fragment weights whose rows are not the ones this replica held when the loaded state was saved
        (:func:`lowband.diloco.row_digest.row_digests`; a GTP shard compares its real rows against their slice of
        the whole weight's digests; local, no communication)."""
        lay = self.state_layout
        differ = []
        for f in self.frags:
            for name, p in zip(f.names, f.params, strict=True):
                want = saved.get(name)
                if want is None:
                    continue
                runs = None if lay is None else lay.row_runs(name)
                if runs is None:
                    same = torch.equal(row_digests(p.detach()).cpu(), want)
                else:  # this rank's real rows of its shard against their slice of the whole weight's digests
                    same = all(torch.equal(row_digests(p.detach()[loc:loc + n]).cpu(), want[log:log + n])
                               for log, loc, n in runs)
                if not same:
                    differ.append(name)
        if differ:
            raise ValueError(
                f"diloco: the weights of {differ[:5]} ({len(differ)} of the fragment parameters) are not the ones "
                "this replica held when the loaded DiLoCo state was saved: a model file of another replica (rank "
                "0's torch.save loaded on every replica, or torch.distributed.checkpoint of model.state_dict() on "
                "several replicas, which keeps one replica's copy under each name) or of another step. Save and "
                "load each replica's own model together with its DiLoCo state (torch.save per rank, or "
                "lowband.diloco.DilocoCheckpoint)")

    def _post_step(self) -> None:
        if self._paused:
            if not self._stepped:
                self._built_versions = self._versions()
            return
        if hasattr(self.membership, "after_step"):
            self.membership.after_step()
        self.local_step += 1
        actions = actions_at(self.local_step, self.schedule)
        if actions:
            self.wait_for_inner_writes()
        if self._inflight is not None and not actions:
            for h in self._inflight.handles:  # same order on every rank
                if not h.poll():
                    break
        for action in actions:
            if action == PREPARE:
                self._prepare()
            elif action == SYNC:
                try:
                    self._sync(check=PREPARE not in actions)  # prepared just now: checked just now
                finally:
                    self.local_step = 0

    def wait_for_inner_writes(self) -> None:
        """Wait for the inner optimizer's writes to the weights still in flight after its ``step()`` returned
        (``ShardedOptimizer(param_gather="forward")``: the updated slices' all-gathers, ``wait_for_params``; purely
        local) before DiLoCo reads or writes the weights: the pseudo-gradient would read half-gathered weights
        and a gather landing later would overwrite the merged ones (0.28 off after 9 steps, no error). No-op for
        an optimizer without deferred writes."""
        for opt in self.inner_optimizers:
            wait = getattr(opt, "wait_for_params", None)
            if callable(wait):
                wait()

    def check_trainable(self) -> None:
        """Raise ``ValueError`` naming a parameter the inner optimizer trains that is in no fragment: one unfrozen
        (``requires_grad_(True)``) after DiLoCo was built, an adapter added since (``add_param_group``), or a
        trainable parameter of the inner optimizer outside the model. Nothing would ever sync it: every replica
        would train its own copy for the rest of the run. Also refuses a fragment parameter frozen
        (``requires_grad_(False)``) since: the outer optimizer's momentum would keep moving it. Runs at
        construction, at every fragment's prepare and at its sync (local; the same script changes every replica
        alike, so every replica raises at the same step). Rebuild DiLoCo after changing which parameters train."""
        frozen = [n for f in self.frags for n, p in zip(f.names, f.params, strict=True) if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"diloco: {frozen[:5]} {'was' if len(frozen) == 1 else 'were'} frozen (requires_grad=False) after "
                "StreamingDiLoCo was built: the outer optimizer would keep moving a frozen weight (its momentum), "
                "where torch leaves it alone. Build StreamingDiLoCo after choosing which parameters train (close() "
                "the old one first; init_sync then starts every replica from replica 0's weights)")
        frag_ids = self._frag_ids
        in_model = [p for p in self.model.parameters() if p.requires_grad and id(p) not in frag_ids]
        in_optimizers = [(oi, gi, pi, p) for oi, opt in enumerate(self.inner_optimizers)
                         for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
                         if p.requires_grad and id(p) not in frag_ids]
        if not in_model and not in_optimizers:
            return  # the common case: one pass over the parameters, no names built
        named = {id(p): n for n, p in self.model.named_parameters()}
        stray = [named[id(p)] for p in in_model]
        stray += [named.get(id(p), f"inner_optimizer{f'[{oi}]' if len(self.inner_optimizers) > 1 else ''}"
                                   f".param_groups[{gi}]['params'][{pi}]")
                  for oi, gi, pi, p in in_optimizers if id(p) not in named]
        if stray:
            raise ValueError(
                f"diloco: {stray[:5]} {'is' if len(stray) == 1 else 'are'} trained but in no fragment (unfrozen or "
                "added after StreamingDiLoCo was built, or outside the model): nothing would sync "
                f"{'it' if len(stray) == 1 else 'them'}, so the replicas would drift apart. Build StreamingDiLoCo "
                "after choosing which parameters train (close() the old one first)")

    def _prepare(self) -> None:
        self.check_trainable()
        self.membership.start_quorum(self)  # may heal this replica and move self.committed
        i = fragment_for(self.committed, self.num_fragments)
        frag = self.frags[i]
        device = frag.params[0].device
        flat = torch.empty(frag.numel, dtype=self.buffer_dtypes[i], device=device)
        pseudo_gradient_into(flat, self.globals[i], frag.params)
        residual = self.residuals[i]
        new_residual = None
        if residual is not None:
            r = residual.to(device)
            flat.add_(r if self.ef_decay == 1.0 else r * self.ef_decay)  # (g + beta e): product, then sum
            new_residual = torch.empty_like(flat)
        own_finite = all_finite(flat)
        handles = []
        for s, e in _bucket_bounds(flat.numel(), self.bucket_cap_elems[i], self.bucket_breaks[i]):
            if new_residual is None:  # memberships without error-feedback support keep working
                handles.append(self.membership.all_reduce(flat[s:e], self.codec, f"diloco:frag{i}"))
            else:
                handles.append(self.membership.all_reduce(flat[s:e], self.codec, f"diloco:frag{i}",
                                                          residual_out=new_residual[s:e]))
        self._inflight = _InFlight(i, flat, handles, new_residual, own_finite)

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            for h in self._inflight.handles:  # same order on every rank
                h.wait()
            self._inflight.handles = []

    def _sync(self, *, check: bool = True) -> None:
        inflight = self._inflight
        i = fragment_for(self.committed, self.num_fragments)
        if inflight is None or inflight.fragment != i:
            raise RuntimeError(f"diloco: sync of fragment {i} without a matching prepare")
        self._wait_inflight()
        self._inflight = None
        pad = self._padding[i]
        if pad is not None:  # padding is no weight: keep it zero in everything the sync writes
            pad = pad.to(inflight.flat.device)
            inflight.flat.index_fill_(0, pad, 0)
            if inflight.residual is not None:
                inflight.residual.index_fill_(0, pad.to(inflight.residual.device), 0)
        if check:
            self.check_trainable()  # a parameter frozen between the prepare and now
        if not all_finite(inflight.flat):  # the same bits on every replica: all raise
            own = "finite" if inflight.own_finite else "NOT finite"
            raise FloatingPointError(
                f"diloco: the averaged pseudo-gradient of fragment {i} ({self.frags[i].names[0]!r}...) has "
                f"non-finite values (this replica's own was {own}); an inner step diverged on some replica. "
                "Nothing was applied; lower the inner lr, clip gradients or skip non-finite inner steps")
        if not self.membership.should_commit():
            with torch.no_grad():  # roll back to the last agreed weights; the same fragment retries
                for p, g in zip(self.frags[i].params, self.globals[i], strict=True):
                    p.copy_(g)
            for fn in self._on_attempt:  # the residual stays: the attempt's message was not applied
                fn(self, i, False)
            return
        outer_step(self.outer[i], self.globals[i], inflight.flat)
        merge_(self.frags[i].params, self.globals[i], self.alpha)
        if inflight.residual is not None:
            self.residuals[i].copy_(inflight.residual)  # type: ignore[union-attr]
        self.committed += 1
        for fn in self._on_attempt:
            fn(self, i, True)
        for fn in self._on_sync:
            fn(self, i)

    # ------------------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """This replica's DiLoCo state in the one documented format (:mod:`lowband.diloco.state`).

        Keys never depend on the rank or the world size; an in-flight fragment is waited for (a
        collective completion: call on every rank of every replica at the same inner step, as for any
        checkpoint; with several replicas the first call also creates the per-replica rows' device mesh,
        collectively) and stored averaged. With GTP inside, shards are gathered over their GTP group.
        Per-replica entries (error-feedback residuals, ``saved_by_replica``, ``weights_digest.<fqn>``) are
        ``DTensor`` rows on a ``(replica, dp)`` mesh when there are several replicas, so
        ``torch.distributed.checkpoint`` saves every replica's own; the rest is identical on every rank and
        plain.
        """
        from lowband.diloco.state import diloco_state_dict

        return diloco_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (after ``dcp.load`` into a :meth:`state_dict` template, or a
        ``torch.load``-ed one); raises ``ValueError`` naming a key that does not fit this instance."""
        from lowband.diloco.state import load_diloco_state_dict

        load_diloco_state_dict(self, state)
        self._state_loaded = (self.committed, self.local_step)

    def outer_state(self) -> dict[str, Any]:
        """Global copies and outer optimizer states only (what a healing replica copies from a peer)."""
        return {"globals": [[g.detach().clone() for g in gs] for gs in self.globals],
                "outer": [o.state_dict() for o in self.outer]}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        """Heal from a peer's :meth:`outer_state`; this replica's error-feedback residuals restart at 0."""
        with torch.no_grad():
            for gs, saved in zip(self.globals, state["globals"], strict=True):
                for g, s in zip(gs, saved, strict=True):
                    g.copy_(s)
            for r in self.residuals:
                if r is not None:
                    r.zero_()
        for o, s in zip(self.outer, state["outer"], strict=True):
            o.load_state_dict(s)
        self._state_loaded = (self.committed, self.local_step)
        self._saved_digests = None  # healed: the weights are the peer's, not a saved state's

    def averaged_model(self, *, keep: bool = True) -> nn.Module | None:
        """The average of the replicas' models, the model to keep at the end of a run (one replica's model holds
        its own local steps since its fragments' last syncs): a plain model in host memory, bitwise what every
        replica holds alike (per segment of rows), or ``None`` where not ``keep`` (e.g. every rank but the one
        that saves it). Collective over the replica group (and the GTP / TP groups inside a replica): call on
        every rank of every replica alike, at the same step. A pseudo-gradient in flight is waited for and not
        applied; the live model is not changed. See :func:`lowband.diloco.average.replica_average` (tags
        ``average:digests``, 32 bytes per segment of at least 64 elements, and ``average``, at most the bytes of
        one fp32 all-reduce of the model). Refused (``ValueError``) under torchft's membership, whose groups meet
        only at quorums."""
        from lowband.diloco.average import replica_average

        return replica_average(self, keep=keep)

    def wait_inflight(self) -> None:
        """Complete the in-flight fragment's all-reduce now (its handles in order, the same on every
        rank), without syncing it: the fragment still syncs at its scheduled step. Call on every replica
        alike before issuing another collective on the replica group outside the schedule (the trainer's
        model export)."""
        self._wait_inflight()

    # --------------------------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Remove the hook (an in-flight all-reduce is waited for and dropped)."""
        self._wait_inflight()
        self._inflight = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> StreamingDiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
