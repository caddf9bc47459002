"""Muon on GTP-sharded weights: whole matrices routed to owner ranks, orthogonalized there, returned as
row shards.

A GTP weight ``W [rows, cols]`` lives as row shards (:class:`lowband.parallel.gtp.GTPWeight`: tail-padded
to ``padded_rows = N * shard_rows``, rank ``s`` holds rows ``[s * shard_rows, (s+1) * shard_rows)``; pad
rows are structural zeros). Newton-Schulz needs the whole matrix, so :class:`GTPMuon` gives every such
matrix one *owner* rank of the GTP group and, per optimizer step and per bucket of matrices:

1. **all-to-all #1** (``Comm.all_to_all`` with variable splits on the GTP comm, tag
   ``gtp:muon:a2a:grad``, the gradient dtype on the wire): every rank sends the row shard of each
   matrix's gradient (already reduce-scattered, dp-averaged and clipped by the strategy) to its owner,
   which stacks the N shards into the padded whole gradient and drops the pad rows;
2. the owner runs momentum, Nesterov and :func:`lowband.optim.muon.orthogonalize` on its whole
   matrices, one matrix at a time (:func:`lowband.optim.muon.muon_direction_`), writing each ``O``'s row
   shards straight into the send buffer of #2;
3. **all-to-all #2** (tag ``gtp:muon:a2a:update``): the owner returns to every rank the row shard of
   the update ``O`` (pad rows zero), on the wire in ``ns_dtype`` when that is narrower than the
   parameter, else in the parameter dtype (either way exactly the ``O.to(param.dtype)`` of the
   single-device update);
4. every rank applies ``W *= 1 - lr * wd; W -= lr * muon_shape_scale(rows, cols) * O`` to its shard
   (:func:`lowband.optim.muon.muon_apply_`, elementwise, with the *logical* shape's scale), so the
   result equals single-device :class:`lowband.optim.muon.Muon` on the whole matrix.

Bytes per step on GTP rank ``r`` (``e``: element size): #1 sends ``sum over matrices not owned by r of
shard_rows * cols * e_grad``; #2 sends ``sum over matrices owned by r of (N - 1) * shard_rows * cols *
e_wire``. Two all-to-alls per bucket; buckets with no gradient are skipped on every rank alike.

Ownership (:func:`plan_gtp_muon`): matrices in backward order (last registered first), cut into
buckets of at most ``bucket_mb`` of whole-matrix bytes (a new bucket also at each param-group or dtype
change); inside a bucket, matrices by descending Newton-Schulz cost (:func:`lowband.optim.buckets.matrix_cost`)
go to the rank with the least cost so far (ties to the lower rank), the running cost carried across
buckets: balanced per bucket (for the pipeline) and overall. Pure arithmetic on shapes: identical on
every rank, no communication.

Pipeline (memory-bounded): the first :data:`IN_FLIGHT` buckets' all-to-all #1 are issued asynchronously
at the start of :meth:`GTPMuon.step`; the AdamW updates and the replicated Muon matrices are computed
while they travel; then per bucket: wait for its #1, orthogonalize, issue its #2 asynchronously, issue
the next bucket's #1, and apply the *previous* bucket's update (its #2 travelled during this bucket's
Newton-Schulz), releasing its buffers. At most ``IN_FLIGHT`` routed gradient buffers and two update
buffers are alive at once, and Newton-Schulz temporaries of one matrix. No overlap with backward: the
gradients enter Muon only after the strategy's dp all-reduce and the global-norm clip, which need the
whole backward.

Other parameters (``algorithm="adamw"`` groups: embeddings, norms, biases, tied or untied heads, GTP
embedding shards) take :func:`lowband.optim.adamw.adamw_update_` elementwise on whatever this rank
holds (equal to ``torch.optim.AdamW`` on the full tensor). A Muon matrix that is *not* a GTP shard
(a linear GTP keeps replicated, e.g. one tied to another linear) is updated with
:func:`lowband.optim.muon.muon_update_` locally on every rank: its gradient is the same everywhere, so
every rank computes the same result with no communication (costs every rank its Newton-Schulz).

Refused at construction (before any collective, identically on every rank): a Muon parameter that is
not 2-D, a GTP shard of another GTP group than ``comm``, and a TP-split matrix
(:mod:`lowband.parallel.gtp_tp`: its whole matrix spans the TP group, which this routing does not cover).

State per rank: for each owned GTP matrix its momentum in logical shape (``~1/N`` of all Muon
momentum plus the balance's imbalance; stored as one ``[k, rows, cols]`` stack per owned shape per
bucket, ``state[p]["momentum_buffer"]`` a view of it), the whole momentum of replicated Muon matrices,
and AdamW's ``exp_avg``/``exp_avg_sq`` (shard-shaped for GTP shards) and ``step`` (a 0-d float32
tensor, as torch keeps it). All state is allocated at construction, so :meth:`GTPMuon.state_bytes` is
exact from the start. Checkpoints: :class:`lowband.optim.gtp_muon_state.GTPMuonStateLayout`.

Grad presence: a matrix whose shard has no ``.grad`` is skipped (as ``torch.optim`` does). GTP makes
grad presence structural (every rank of the group runs the same forward), so every rank skips the same
matrices; a model whose ranks disagree would break the all-to-all's split sizes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lowband.comm import Comm, CommHandle
from lowband.optim.adamw import adamw_update_, validate_adamw_hparams
from lowband.optim.buckets import matrix_cost
from lowband.optim.muon import muon_apply_, muon_direction_, muon_shape_scale, muon_update_, validate_muon_hparams
from lowband.sharding import cut_of, placement_of

ALGORITHMS = ("muon", "adamw")
GRAD_TAG = "gtp:muon:a2a:grad"
UPDATE_TAG = "gtp:muon:a2a:update"
IN_FLIGHT = 2
"""Buckets whose all-to-all #1 travels ahead of the Newton-Schulz in progress (bounds the routed buffers alive)."""


@dataclass(frozen=True)
class MatrixSpec:
    """One GTP-sharded Muon matrix as the planner sees it (logical shape and shard geometry)."""

    rows: int
    cols: int
    shard_rows: int
    group: int
    dtype: torch.dtype

    @property
    def shard_numel(self) -> int:
        return self.shard_rows * self.cols

    @property
    def cost(self) -> int:
        return matrix_cost(self.rows, self.cols)


@dataclass
class RouteBucket:
    """Matrices that travel in one pair of all-to-alls.

    Attributes:
        members: indices into the spec list, in bucket order (backward order).
        owners: owner rank of each member (aligned with ``members``).
        group: their param group; ``dtype``: their parameter dtype.
    """

    members: list[int]
    owners: list[int]
    group: int
    dtype: torch.dtype
    world_size: int
    specs: list[MatrixSpec] = field(repr=False)

    def owned(self, rank: int, live: set[int] | None = None) -> list[int]:
        """Members owned by ``rank`` in bucket order (only those in ``live`` if given)."""
        return [m for m, o in zip(self.members, self.owners) if o == rank and (live is None or m in live)]

    def splits(self, live: set[int] | None = None) -> list[int]:
        """Elements every rank sends to each owner in all-to-all #1 (the same on every rank)."""
        out = [0] * self.world_size
        for m, o in zip(self.members, self.owners):
            if live is None or m in live:
                out[o] += self.specs[m].shard_numel
        return out


def plan_gtp_muon(specs: list[MatrixSpec], world_size: int, cap_bytes: int) -> list[RouteBucket]:
    """Buckets and owners for GTP Muon matrices (see the module docstring). Deterministic, no collective.

    Raises:
        ValueError: if ``world_size`` or ``cap_bytes`` is not positive.
    """
    if world_size < 1:
        raise ValueError(f"plan_gtp_muon: world_size must be >= 1, got {world_size}")
    if cap_bytes <= 0:
        raise ValueError(f"plan_gtp_muon: bucket cap must be positive (got {cap_bytes} bytes)")
    chunks: list[list[int]] = []
    used = 0
    key = None
    for i in reversed(range(len(specs))):
        s = specs[i]
        nbytes = s.rows * s.cols * torch.empty((), dtype=s.dtype).element_size()
        k = (s.group, s.dtype)
        if not chunks or k != key or (used + nbytes > cap_bytes and chunks[-1]):
            chunks.append([])
            used, key = 0, k
        chunks[-1].append(i)
        used += nbytes
    loads = [0] * world_size
    buckets = []
    for members in chunks:
        owner: dict[int, int] = {}
        for pos in sorted(range(len(members)), key=lambda j: (-specs[members[j]].cost, j)):
            m = members[pos]
            r = min(range(world_size), key=lambda q: (loads[q], q))
            owner[m] = r
            loads[r] += specs[m].cost
        s0 = specs[members[0]]
        buckets.append(RouteBucket(members, [owner[m] for m in members], s0.group, s0.dtype, world_size, specs))
    return buckets


def _wire_dtype(ns_dtype: torch.dtype, param_dtype: torch.dtype) -> torch.dtype:
    """Update dtype on the wire: ``ns_dtype`` when narrower than the parameter (the receiver's
    ``O.to(param.dtype)`` is then the same conversion the single-device update makes), else the
    parameter dtype (converted by the owner before sending: again the same conversion)."""
    esize = torch.empty((), dtype=ns_dtype).element_size()
    return ns_dtype if esize < torch.empty((), dtype=param_dtype).element_size() else param_dtype


@dataclass
class _Stack:
    members: list[int]  # owned members of one shape, bucket order
    buf: torch.Tensor  # [k, rows, cols] momentum


@dataclass
class _InFlight:
    bucket: int
    live: list[int]
    splits: list[int]
    recv: torch.Tensor
    handle: CommHandle
    send: torch.Tensor  # kept alive until the all-to-all completes
    upd_send: torch.Tensor | None = None
    upd_recv: torch.Tensor | None = None
    upd_handle: CommHandle | None = None


class GTPMuon(torch.optim.Optimizer):
    """Muon for GTP row shards (routed to owners) and AdamW for the rest; one optimizer, so an LR
    scheduler scales every group. See the module docstring for the communication pattern and state.

    Constructor: ``GTPMuon(params, comm, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
    momentum=0.95, nesterov=True, ns_method="ns5", ns_steps=5, ns_dtype=torch.bfloat16, bucket_mb=4.0)``.

    Args:
        params: param-group dicts, each with ``algorithm`` ``"muon"`` (2-D matrices: GTP shards of
            ``comm``'s group or replicated matrices) or ``"adamw"`` (anything); a group may override
            any default below.
        comm: the GTP group (``runtime.comm`` of the shards' :class:`~lowband.parallel.gtp.GTPRuntime`,
            or the ``Comm`` it was built from); the all-to-alls run on ``comm.private("gtp_muon")``.
        lr, betas, eps, weight_decay: AdamW defaults (``weight_decay`` and ``lr`` also Muon's unless a
            Muon group sets its own).
        momentum, nesterov, ns_method, ns_steps, ns_dtype: Muon (:class:`lowband.optim.muon.Muon`).
        bucket_mb: cap of whole-matrix bytes per routing bucket.

    Raises:
        ValueError: a bad hyperparameter or algorithm, a non-2-D Muon parameter, a GTP shard of another
            group, or a TP-split matrix (named), before any collective.
    """

    def __init__(self, params: Iterable[dict[str, Any]], comm: Comm, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_method: str = "ns5", ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.bfloat16, bucket_mb: float = 4.0) -> None:
        defaults = dict(algorithm="adamw", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, nesterov=nesterov, ns_method=ns_method, ns_steps=ns_steps,
                        ns_dtype=ns_dtype)
        super().__init__(list(params), defaults)
        if not bucket_mb > 0:
            raise ValueError(f"GTPMuon: bucket_mb must be > 0, got {bucket_mb!r}")
        self.comm = comm.private("gtp_muon")  # its own process group, same members (see Comm.private)
        self.bucket_mb = bucket_mb
        self._gtp_params: list[torch.Tensor] = []
        specs: list[MatrixSpec] = []
        for gi, g in enumerate(self.param_groups):
            where = f"GTPMuon param_groups[{gi}]"
            if g["algorithm"] not in ALGORITHMS:
                raise ValueError(f"{where}: algorithm must be one of {list(ALGORITHMS)}, got {g['algorithm']!r}")
            if g["algorithm"] == "adamw":
                validate_adamw_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"], where)
                continue
            validate_muon_hparams(g["lr"], g["momentum"], g["nesterov"], g["weight_decay"], g["ns_method"],
                                  g["ns_steps"], g["ns_dtype"], where)
            for p in g["params"]:
                self._check_muon_param(p, where)
                pl = placement_of(p)
                if cut_of(p, "gtp") is not None:
                    self._gtp_params.append(p)
                    (rows, cols), (shard_rows, _) = pl.shape, pl.local_shape()
                    specs.append(MatrixSpec(rows, cols, shard_rows, gi, p.dtype))
        self.specs = specs
        self.buckets = plan_gtp_muon(specs, comm.size, max(1, int(bucket_mb * 2**20)))
        self._stacks: list[list[_Stack]] = []
        self._init_state()
        self._constructed = True

    def add_param_group(self, param_group: dict) -> None:
        """Groups are fixed at construction (the Muon buckets and every state tensor are built there): a group
        added later is refused, naming the way out, instead of failing at the next ``step()``."""
        if getattr(self, "_constructed", False):
            raise ValueError("GTPMuon: param groups cannot be added after construction (its Muon buckets and state "
                             "are built there); build a new GTPMuon with every group, e.g. after adding adapters")
        super().add_param_group(param_group)

    def _check_muon_param(self, p: torch.Tensor, where: str) -> None:
        pl = placement_of(p)
        name = f" {pl.name!r}" if pl is not None and pl.name else ""
        if p.dim() != 2:
            raise ValueError(f"{where}: Muon handles 2-D matrices; got a tensor of shape {tuple(p.shape)}")
        tp = cut_of(p, "tp")
        if tp is not None and tp.size > 1:
            raise ValueError(f"{where}: Muon matrix{name} is split over a TP group of {tp.size} ranks "
                             f"(full shape {pl.shape}); Newton-Schulz needs the whole "
                             "matrix and GTPMuon routes only over the GTP group. Give TP-split matrices to "
                             "AdamW (algorithm='adamw') or use tp size 1")
        cut = cut_of(p, "gtp")
        if cut is not None and (cut.size != self.comm.size or cut.rank != self.comm.rank
                                or getattr(cut.group, "name", None) != self.comm.name):
            raise ValueError(f"{where}: Muon matrix{name} is a GTP shard of group "
                             f"{getattr(cut.group, 'name', None)!r} (size {cut.size}, rank {cut.rank}); GTPMuon "
                             f"routes over {self.comm.name!r} (size {self.comm.size}, rank {self.comm.rank})")

    # ------------------------------------------------------------------------------ state
    def _init_state(self) -> None:
        gtp_ids = {id(p) for p in self._gtp_params}
        for g in self.param_groups:
            for p in g["params"]:
                if g["algorithm"] == "adamw":
                    self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
                elif id(p) not in gtp_ids:
                    self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
        rank = self.comm.rank
        for b in self.buckets:
            stacks: list[_Stack] = []
            by_shape: dict[tuple[int, int], list[int]] = {}
            for m in b.owned(rank):
                by_shape.setdefault((self.specs[m].rows, self.specs[m].cols), []).append(m)
            for (rows, cols), ms in by_shape.items():
                p0 = self._gtp_params[ms[0]]
                buf = torch.zeros(len(ms), rows, cols, dtype=p0.dtype, device=p0.device)
                for j, m in enumerate(ms):
                    self.state[self._gtp_params[m]] = {"momentum_buffer": buf[j]}
                stacks.append(_Stack(ms, buf))
            self._stacks.append(stacks)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, then each owned GTP Muon momentum is copied into its stacked buffer and the state points
        at that buffer's view again (torch's load puts new tensors into ``state``, which the step, reading the
        stacks, would never see: the loaded momentum was silently dropped)."""
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for stacks in self._stacks:
                for stack in stacks:
                    for j, m in enumerate(stack.members):
                        p = self._gtp_params[m]
                        st = self.state.setdefault(p, {})
                        loaded = st.get("momentum_buffer")
                        if loaded is not None and loaded is not stack.buf[j]:
                            stack.buf[j].copy_(loaded)
                        st["momentum_buffer"] = stack.buf[j]

    def owner(self, p: torch.Tensor) -> int | None:
        """GTP rank owning ``p``'s whole-matrix Muon state; ``None`` if ``p`` is not a GTP Muon matrix."""
        for b in self.buckets:
            for m, o in zip(b.members, b.owners):
                if self._gtp_params[m] is p:
                    return o
        return None

    def is_gtp_muon(self, p: torch.Tensor) -> bool:
        return any(q is p for q in self._gtp_params)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state tensors this rank holds (stacked momentum counted once)."""
        total = 0  # the views of one stack partition it exactly, so summing the views counts it once
        for st in self.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def expected_wire_bytes(self, rank: int | None = None) -> tuple[int, int]:
        """Bytes rank ``rank`` (default: this rank) sends per step in all-to-all #1 and #2, every matrix
        having a gradient (the ledger's count; for tests and benchmarks)."""
        r = self.comm.rank if rank is None else rank
        n = self.comm.size
        grad = upd = 0
        if n == 1:
            return 0, 0
        for b in self.buckets:
            g = self.param_groups[b.group]
            sp = b.splits()
            e = torch.empty((), dtype=b.dtype).element_size()
            ew = torch.empty((), dtype=_wire_dtype(g["ns_dtype"], b.dtype)).element_size()
            grad += (sum(sp) - sp[r]) * e
            upd += (n - 1) * sp[r] * ew
        return grad, upd

    # ------------------------------------------------------------------------------ step
    def whole_tensor_params(self) -> list[torch.Tensor]:
        """None: the Muon matrices are gathered whole on their owners (GTP row shards are this optimizer's own)."""
        return []

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ahead: deque[_InFlight] = deque()
        nxt = 0

        def launch() -> None:  # keep IN_FLIGHT buckets' all-to-all #1 travelling ahead of Newton-Schulz
            nonlocal nxt
            while nxt < len(self.buckets) and len(ahead) < IN_FLIGHT:
                f = self._send_grads(nxt)
                nxt += 1
                if f is not None:
                    ahead.append(f)

        launch()
        gtp_ids = {id(p) for p in self._gtp_params}
        for g in self.param_groups:  # computed while the gradients travel
            for p in g["params"]:
                if p.grad is None or id(p) in gtp_ids:
                    continue
                st = self.state[p]
                if g["algorithm"] == "adamw":
                    st["step"] += 1
                    adamw_update_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], step=int(st["step"].item()),
                                  lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                                  weight_decay=g["weight_decay"])
                else:
                    muon_update_(p, p.grad, st["momentum_buffer"], lr=g["lr"], momentum=g["momentum"],
                                 nesterov=g["nesterov"], weight_decay=g["weight_decay"], ns_method=g["ns_method"],
                                 ns_steps=g["ns_steps"], ns_dtype=g["ns_dtype"])
        prev: _InFlight | None = None
        while ahead:
            f = ahead.popleft()
            self._orthogonalize_and_return(f)  # waits for its #1, issues its #2
            launch()
            if prev is not None:
                self._apply(prev)  # the previous bucket's #2 travelled during this bucket's Newton-Schulz
            prev = f
        if prev is not None:
            self._apply(prev)
        return loss

    def _send_grads(self, bi: int) -> _InFlight | None:
        b = self.buckets[bi]
        n, r = self.comm.size, self.comm.rank
        live = [m for m in b.members if self._gtp_params[m].grad is not None]
        if not live:
            return None
        live_set = set(live)
        splits = b.splits(live_set)
        p0 = self._gtp_params[live[0]]
        send = torch.empty(sum(splits), dtype=b.dtype, device=p0.device)
        off = 0
        for o in range(n):
            for m in b.owned(o, live_set):
                k = self.specs[m].shard_numel
                send[off:off + k].copy_(self._gtp_params[m].grad.reshape(-1))
                off += k
        recv = torch.empty(n * splits[r], dtype=b.dtype, device=p0.device)
        h = self.comm.all_to_all(recv, send, [splits[r]] * n, splits, async_op=True, tag=GRAD_TAG)
        return _InFlight(bi, live, splits, recv, h, send)

    def _orthogonalize_and_return(self, f: _InFlight) -> None:
        b = self.buckets[f.bucket]
        g = self.param_groups[b.group]
        n, r = self.comm.size, self.comm.rank
        f.handle.wait()
        live_set = set(f.live)
        per = f.splits[r]
        recv = f.recv.view(n, per)
        offsets: dict[int, int] = {}
        off = 0
        for m in b.owned(r, live_set):
            offsets[m] = off
            off += self.specs[m].shard_numel
        wire = _wire_dtype(g["ns_dtype"], b.dtype)
        out = torch.empty(n, per, dtype=wire, device=f.recv.device)
        for stack in self._stacks[f.bucket]:
            for j, m in enumerate(stack.members):  # one matrix at a time: one matrix's NS temporaries alive
                if m not in live_set:
                    continue
                s = self.specs[m]
                lo = offsets[m]
                whole = recv[:, lo:lo + s.shard_numel].reshape(n * s.shard_rows, s.cols)[: s.rows]
                o = muon_direction_(whole, stack.buf[j], momentum=g["momentum"], nesterov=g["nesterov"],
                                    ns_method=g["ns_method"], ns_steps=g["ns_steps"], ns_dtype=g["ns_dtype"])
                for q in range(n):  # rank q's row shard of O, pad rows zero
                    dst = out[q, lo:lo + s.shard_numel].view(s.shard_rows, s.cols)
                    r0, r1 = q * s.shard_rows, min((q + 1) * s.shard_rows, s.rows)
                    real = max(r1 - r0, 0)
                    if real:
                        dst[:real].copy_(o[r0:r1])
                    dst[real:].zero_()
        f.upd_send = out.view(-1)
        f.upd_recv = torch.empty(sum(f.splits), dtype=wire, device=f.recv.device)
        f.recv = f.send = torch.empty(0, dtype=b.dtype, device=f.recv.device)  # free the gathered grads
        f.upd_handle = self.comm.all_to_all(f.upd_recv, f.upd_send, f.splits, [per] * n, async_op=True,
                                            tag=UPDATE_TAG)

    def _apply(self, f: _InFlight) -> None:
        b = self.buckets[f.bucket]
        g = self.param_groups[b.group]
        assert f.upd_handle is not None and f.upd_recv is not None
        f.upd_handle.wait()
        live_set = set(f.live)
        off = 0
        for o in range(self.comm.size):
            for m in b.owned(o, live_set):
                s = self.specs[m]
                p = self._gtp_params[m]
                upd = f.upd_recv[off:off + s.shard_numel].view(s.shard_rows, s.cols)
                muon_apply_(p, upd, lr=g["lr"], weight_decay=g["weight_decay"], scale=muon_shape_scale(s.rows, s.cols))
                off += s.shard_numel
        f.upd_send = f.upd_recv = None  # release the bucket's update buffers now
