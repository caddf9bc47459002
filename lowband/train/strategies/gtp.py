"""``gtp``: generalized tensor parallelism (every ``nn.Linear`` and plain ``nn.Embedding`` weight
sharded by rows over a GTP group).

Mesh: ``dp x gtp`` with ``gtp = gtp.size`` (0 = whole world) and ``dp = world / gtp``
(:func:`lowband.parallel.mesh.build_mesh`). Every rank is a data lane (its own slice of each batch).

Communication per microbatch (GTP group, see :mod:`lowband.parallel.gtp`): one all-gather per sharded
weight in forward (prefetched one ahead), one in backward (not for the token embedding, whose wgrad
is a scatter-add), one async reduce-scatter of its wgrad (pre-scaled by 1/gtp), drained at the end
of backward. Per step, after the last microbatch: one coalesced all-reduce (avg) of the replicated
parameters' grads (norms, other embeddings) over the GTP group (tag ``gtp:replicated``), then, if
``dp > 1``, one coalesced all-reduce (avg) of every grad over the DP group (tag ``grad``). All of them
take ``strategy.grad_wire_dtype``; with ``fp8`` the two all-reduces are block-scaled
(:func:`lowband.comm.codecs.codec_all_reduce`) and their used flags travel exactly beside them (tags
``gtp:replicated:flags`` / ``grad:flags``). Clipping:
:func:`lowband.parallel.clip_grad_norm_`, one all-reduce of a 2-vector over the GTP group (``gtp:norm``).

State per rank: ``1/gtp`` of every sharded weight (tail-padded rows), its grad and its AdamW moments;
the replicated parameters whole. Optimizer (``gtp.optimizer``): ``adamw``: torch AdamW (elementwise, so
AdamW on a shard equals AdamW on the full tensor); ``muon``: :class:`lowband.optim.gtp_muon.GTPMuon`:
the Muon matrices of :func:`lowband.plan.muon_split` (by name, taken before sharding) at
``optim.muon_lr`` / ``optim.muon_momentum`` (Nesterov, ``optim.muon_ns_method``, ``optim.muon_ns_dtype``
as for ``sharded-muon``), routed whole to owner ranks of the GTP group with two all-to-alls per bucket
per step (tags ``gtp:muon:a2a:grad`` / ``gtp:muon:a2a:update``; each owner keeps the momentum of its
whole matrices, ~1/gtp of the Muon state); everything else AdamW at ``optim.lr``.

Initial weights: broadcast from rank 0 over the world before sharding (ranks seeded differently
agree). Tied weights (an output head tied to the token embedding) stay replicated.

Checkpoints: :class:`lowband.parallel.gtp_state.GTPStateLayout`: in logical shapes, with the keys of
``single``/``ddp`` (format ``replicated``), each rank writing only the real rows of its shards (rank-local
chunks, no gather), so they reshard to any GTP degree and are interchangeable with those strategies. With
Muon: :class:`lowband.optim.gtp_muon_state.GTPMuonStateLayout` (format ``gtp-muon-v1``; logical shapes,
rank-local too, reshards to any GTP degree, not loadable by ``single``/``ddp``).

Inside a larger mesh (a DiLoCo replica): :meth:`GTPStrategy.setup_on_mesh` takes the mesh's ``gtp``
and ``dp`` axes instead of building a mesh over the world.

No model plan needed: GTP shards every ``nn.Linear`` (and plain ``nn.Embedding``) by rows and gathers
the whole weight before use, so any layout of linears works (a factory may return a bare
``nn.Module``); the plan's ``parallel_linears`` (which TP needs) are not read. A model without an
``nn.Linear`` is refused before any collective (:func:`check_gtp_model`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.optim.gtp_muon import GTPMuon
from lowband.optim.gtp_muon_state import GTPMuonStateLayout
from lowband.parallel.clip import clip_grad_norm_, global_grad_norm
from lowband.parallel.gtp import (
    GTPRuntime,
    reduce_grads,
    shard_embeddings,
    shard_linears,
)
from lowband.parallel.gtp_quant import BlockSpec
from lowband.parallel.gtp_state import GTPStateLayout
from lowband.parallel.init_sync import sync_module_state
from lowband.parallel.mesh import ParallelMesh, build_mesh
from lowband.plan import muon_split
from lowband.train.errors import ConfigError
from lowband.train.optimizers import adamw_param_groups, torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy
from lowband.train.strategies.sharded import muon_ns_dtype

_WIRE = {"float32": None, "bfloat16": torch.bfloat16, "fp8": "fp8"}  # fp8: block-scaled reduce-scatter


@dataclass(kw_only=True)
class GTPConfig:
    """Strategy ``gtp``: generalized tensor parallelism (docs/gtp.md)."""

    size: int = 0
    """GTP group size (0 = the whole world); must divide the world size (the rest is data parallel)."""
    gather: str = "native"
    """Weight all-gather format: native | bf16 | fp8 (e4m3, per-block fp32 scales)."""
    fp8_block: int = 32
    """fp8 scaling block edge (block = fp8_block x fp8_block weight elements)."""
    finalize_depth: int = 2
    """Reduce-scatters left in flight before the oldest is finalized."""
    optimizer: str = "adamw"
    """adamw (torch AdamW on the row shards) | muon (Muon for the hidden matrices, routed whole to owner
    ranks of the GTP group with two all-to-alls per step, using optim.muon_*; AdamW for the rest)."""
    muon_bucket_mb: float = 4.0
    """gtp.optimizer = muon: whole-matrix MB routed per pair of all-to-alls; at most two such buckets are in
    flight, so this bounds the optimizer step's extra memory (larger: fewer, bigger collectives)."""


def check_gtp_model(model: nn.Module, where: str) -> None:
    """``ConfigError`` (every rank alike, no communication) if ``model`` has no ``nn.Linear`` for GTP to
    shard (embeddings and a head tied to one, which stays replicated, do not make a GTP model: its
    projections would stay replicated), naming the modules its other 2-D weights sit in (e.g.
    ``transformers``' ``Conv1D``)."""
    from lowband.plan import tied_groups
    tied = {n for g in tied_groups(model) for n in g}  # a tied linear (a head tied to the embedding) stays whole
    if any(isinstance(m, nn.Linear) and f"{name}.weight" not in tied for name, m in model.named_modules()):
        return
    kinds = sorted({type(m).__name__ for m in model.modules()
                    if not isinstance(m, nn.Embedding) and isinstance(getattr(m, "weight", None), torch.Tensor)
                    and m.weight.dim() == 2})
    extra = f" (its 2-D weights sit in {', '.join(kinds)} modules)" if kinds else ""
    raise ConfigError(f"{where} shards nn.Linear layers (and nn.Embedding tables); {type(model).__name__} has no "
                      f"nn.Linear to shard (a tied one stays replicated){extra}; use strategy ddp or "
                      "sharded-adamw, or build the model from nn.Linear")


@register_strategy("gtp")
class GTPStrategy(Strategy):
    config_sections = ("strategy", "gtp")
    needs_parallel_linears = False  # plan-free: every nn.Linear is sharded (check_gtp_model)
    fp8_grads = True  # every gradient collective: GTP's reduce-scatters and replicated all-reduce, the dp all-reduce
    diloco_inner = True
    ft_agreed_sections = ("gtp",)

    @classmethod
    def inner_gtp_size(cls, cfg, per_replica: int) -> int:
        """``gtp.size``, 0 = the whole replica."""
        return cfg.gtp.size or per_replica

    @classmethod
    def validate_inner(cls, cfg, per_replica: int) -> None:
        """``gtp.size`` divides the replica; the ``gtp`` section's checks on a world of one replica."""
        g = cfg.gtp.size
        if g < 0 or (g and per_replica % g):
            raise ConfigError(f"gtp.size must be 0 (the whole replica) or a divisor of run.world_size / "
                              f"diloco.num_replicas = {per_replica} ranks per replica (diloco.inner = gtp); "
                              f"got {g}")
        cls.validate_config(cfg, per_replica)

    @classmethod
    def check_inner_model(cls, model: nn.Module) -> None:
        check_gtp_model(model, "diloco.inner = gtp")

    def inner_format(self) -> str:
        return f"gtp-{self.cfg.gtp.optimizer}"

    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        super().validate_config(cfg, world_size)
        s = cfg.gtp
        if s.size < 0 or (s.size and world_size % s.size):
            raise ConfigError(f"gtp.size must be 0 (whole world) or a divisor of run.world_size "
                              f"({world_size}); got {s.size}")
        if s.finalize_depth < 0:
            raise ConfigError(f"gtp.finalize_depth must be >= 0; got {s.finalize_depth}")
        if s.fp8_block < 1:
            raise ConfigError(f"gtp.fp8_block must be >= 1; got {s.fp8_block}")
        if s.gather == "fp8":
            m = cfg.model
            for name, width in (("model.n_embd", m.n_embd), ("model.mlp_ratio * model.n_embd",
                                                               m.mlp_ratio * m.n_embd)):
                if width % s.fp8_block:
                    raise ConfigError(f"gtp.gather = fp8 needs {name} ({width}) divisible by "
                                      f"gtp.fp8_block ({s.fp8_block})")

    def setup(self, model: nn.Module) -> None:
        """Build the ``dp x gtp`` mesh over the world (``gtp = gtp.size or world``), then
        :meth:`setup_on_mesh`."""
        s = self.cfg.gtp
        gtp = s.size or self.env.world_size
        check_gtp_model(model, "strategy 'gtp'")  # before the mesh's collectives
        self.setup_on_mesh(model, build_mesh(gtp=gtp, ledger=self.env.comm.ledger))

    def setup_on_mesh(self, model: nn.Module, mesh: ParallelMesh) -> None:
        """Shard ``model`` over ``mesh.gtp`` and average gradients over ``mesh.dp`` (e.g. the mesh of one
        DiLoCo replica). ``mesh.tp`` must have size 1. The world ``self.env.comm`` is used only for the
        one-time broadcast of the initial weights from global rank 0 (all replicas start equal)."""
        if mesh.tp.size != 1:
            raise ValueError(f"strategy gtp: the mesh has tp = {mesh.tp.size}; GTPStrategy shards over "
                             "the gtp axis only (tp must be 1)")
        s = self.cfg.gtp
        self.mesh = mesh
        self.runtime = GTPRuntime(self.mesh.gtp, gather_format=s.gather,
                                  fp8_block=BlockSpec(s.fp8_block, s.fp8_block),
                                  finalize_depth=s.finalize_depth,
                                  grad_wire_dtype=_WIRE[self.cfg.strategy.grad_wire_dtype])
        muon_names = self._muon_names(model) if s.optimizer == "muon" else set()
        # one broadcast of the initial weights from rank 0 over the whole world (dp x gtp), then the
        # shard walks only verify; modules tied to another (an output head tied to the embedding)
        # stay replicated (their grads are averaged with the other replicated parameters)
        sync_module_state(model, self.env.comm)
        shard_embeddings(model, self.runtime, init_sync=False, sync_comm=self.env.comm)
        shard_linears(model, self.runtime, init_sync=False, sync_comm=self.env.comm)
        self.model = model
        o = self.cfg.optim
        if s.optimizer == "muon":
            self.optimizer = self._gtp_muon(model, muon_names)
            self._layout = GTPMuonStateLayout(model, self.optimizer)
        else:
            self.optimizer = torch_adamw(model, o)
            self._layout = GTPStateLayout(model, self.optimizer)

    def _muon_names(self, model: nn.Module) -> set[str]:
        """Names of the Muon matrices (:func:`lowband.plan.muon_split` with the model's plan), taken
        before sharding (sharding replaces modules and parameters; names stay)."""
        muon, _ = muon_split(model, self.model_plan(model))
        ids = {id(p) for p in muon if p.requires_grad}
        return {n for n, p in model.named_parameters() if id(p) in ids}

    def _gtp_muon(self, model: nn.Module, muon_names: set[str]) -> GTPMuon:
        o = self.cfg.optim
        muon = [p for n, p in model.named_parameters() if n in muon_names]
        rest = nn.ParameterList([p for n, p in model.named_parameters() if n not in muon_names])
        groups: list[dict] = []
        if muon:
            groups.append({"params": muon, "algorithm": "muon", "lr": o.muon_lr, "momentum": o.muon_momentum,
                           "nesterov": True, "weight_decay": o.weight_decay, "ns_method": o.muon_ns_method,
                           "ns_steps": 5, "ns_dtype": muon_ns_dtype(o.muon_ns_dtype, self.env.device)})
        groups += [dict(g, algorithm="adamw") for g in adamw_param_groups(rest, o.weight_decay)]
        return GTPMuon(groups, self.mesh.gtp, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                       weight_decay=o.weight_decay, bucket_mb=self.cfg.gtp.muon_bucket_mb)

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        if not last:  # as DDP.no_sync: replicated grads accumulate locally, the last backward averages
            with self.runtime.no_sync():
                yield
            return
        yield
        if last:
            # the backward callback already drained the reduce-scatters and averaged the replicated
            # grads over the GTP group (shard_linears attached the model): finalize_all is a cheap no-op
            self.runtime.finalize_all()
            if self.mesh.dp.size > 1:
                reduce_grads(self.mesh.dp, self.model.parameters(), "avg", tag="grad",
                             wire_dtype=_WIRE[self.cfg.strategy.grad_wire_dtype])

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm (:func:`lowband.parallel.clip_grad_norm_`: shard squares summed over the GTP group,
        replicated params counted once); clips only if ``max_norm > 0``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if max_norm > 0:
            return float(clip_grad_norm_(params, max_norm))
        return float(global_grad_norm(params))

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_format(self) -> str | None:
        """``"replicated"`` (``gtp.optimizer = "adamw"``): the state is saved in the logical
        (unpadded) shapes and under the same keys as ``single``/``ddp``, so a GTP checkpoint loads at any
        GTP degree and into those strategies, and theirs into GTP. ``"gtp-muon-v1"`` (``"muon"``):
        :class:`lowband.optim.gtp_muon_state.GTPMuonStateLayout`, also logical and GTP-degree
        independent, but with Muon momenta that ``single``/``ddp`` have no place for."""
        return "gtp-muon-v1" if self.cfg.gtp.optimizer == "muon" else "replicated"

    def optimizer_state_bytes(self) -> int:
        """Exact bytes of this rank's optimizer state (with Muon: :meth:`GTPMuon.state_bytes`)."""
        if isinstance(self.optimizer, GTPMuon):
            return self.optimizer.state_bytes()
        return super().optimizer_state_bytes()

    def state_dict(self) -> dict[str, Any]:
        """:meth:`lowband.parallel.gtp_state.GTPStateLayout.state_dict` (with Muon,
        :class:`~lowband.optim.gtp_muon_state.GTPMuonStateLayout`'s): every GTP shard (and its optimizer
        state) as rank-local chunks of the logical tensor holding this rank's real rows (no communication),
        under the keys of ``single``/``ddp``."""
        return self._layout.state_dict()

    def logical_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict`'s keys with whole tensors (collective over the GTP group, tag ``gtp:state``):
        for inspection and tests (DiLoCo's checkpoint stores the rank-local :meth:`state_dict`);
        :meth:`load_state_dict` takes it too."""
        return self._layout.logical_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy this rank's real rows of every GTP tensor (rank-local chunks filled by ``dcp.load``, or whole
        logical tensors) into its padded shard, then load as usual."""
        self._layout.load_state_dict(state)

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self._layout.param_shapes()

    def skip_step(self) -> None:
        self.runtime.finalize_all()
        super().skip_step()

    def log_extras(self) -> dict[str, Any]:
        hw = self.runtime.cache.high_water
        return {"gtp_live_unsharded_mb": max(hw.values(), default=0) / 2**20}

    def persistent_buffer_bytes(self) -> int:
        """Bytes of the pooled unsharded buffers (gathered weights, wgrad scratch, RS outputs)."""
        return sum(b.numel() * b.element_size() for bufs in self.runtime.cache.buffers.values()
                   for b in bufs)
