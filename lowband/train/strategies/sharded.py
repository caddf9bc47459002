"""``sharded-adamw`` and ``sharded-muon``: ZeRO-style sharded data parallelism through
:class:`lowband.optim.ShardedOptimizer` (no DDP wrapper).

Communication: per bucket, an async reduce-scatter of the gradients launched from backward hooks
(``strategy.grad_wire_dtype``), the owner's update of its slice, an async all-gather of the updated
slice (``sharded.param_wire_dtype``) that the next forward waits for per bucket (forward pre-hooks);
one scalar all-reduce for the global gradient norm. All of it through ``env.comm`` (counted in the
ledger).
State: every rank holds full parameters and local gradients, plus AdamW moments (and, for Muon,
momentum) of its 1/N slice only.
Gradient accumulation: non-final microbatches run under ``optimizer.no_sync()``.

``sharded-muon`` gives the 2-D hidden matrices (:func:`lowband.plan.muon_split` with the model's plan:
2-D parameters that are not embeddings, tied to one, sparse tables or ``plan.adamw_only``) to Muon at
``optim.muon_lr`` / ``optim.muon_momentum`` (Nesterov; ``optim.muon_ns_method`` NS5 or Polar Express,
run in ``optim.muon_ns_dtype``: by default bf16 on GPU and fp32 on CPU) and everything else (embeddings,
an untied head listed in ``adamw_only``, norms, biases) to AdamW at ``optim.lr``. The LR schedule scales both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowband.comm import Comm
from lowband.optim import ShardedOptimizer
from lowband.optim.sharded_state import ShardedStateLayout
from lowband.optim.sparse_rows import sparse_tables_from_plan
from lowband.parallel.mesh import ParallelMesh
from lowband.plan import muon_split
from lowband.train.errors import ConfigError
from lowband.train.optimizers import adamw_param_groups
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy

# "float32" in the config means "as stored, uncompressed" (as for ddp); "bfloat16" compresses.
_WIRE = {"float32": None, "bfloat16": torch.bfloat16, "fp8": "fp8"}  # fp8: block-scaled (codec_reduce_scatter)


@dataclass(kw_only=True)
class ShardedConfig:
    """Strategies ``sharded-adamw`` and ``sharded-muon`` (docs/sharded_optim.md)."""

    param_wire_dtype: str = "float32"
    """Updated parameters are all-gathered as float32 | bfloat16 (bf16: the owner keeps an fp32 master of
    its slice; every rank computes with the bf16-rounded weights)."""
    grad_error_feedback: bool = False
    """With strategy.grad_wire_dtype = fp8: each rank keeps what fp8 dropped of its gradients (4 bytes per
    parameter) and sends it with the next step's, so no gradient mass is lost (ShardedOptimizer
    grad_error_feedback; restarts at zero on resume)."""
    exchange: str = "ring"
    """gloo, 3 ranks or more, fp32 gradients: ring (a pipelined ring, one TCP flow per link direction: faster on a
    bandwidth-bound link) | p2p (every peer at once: less latency where links are fast and cores few); see
    ShardedOptimizer's exchange and docs/PERFORMANCE.md."""


@dataclass(kw_only=True)
class SparseConfig:
    """Row-sparse embedding-gradient exchange under ``sharded-*`` (docs/sparse.md); other strategies ignore it."""

    tables: list[str] = field(default_factory=list)
    """Tables whose gradient travels row-sparse, by the name the model plan gives them
    (``lowband.plan.SparseTableSpec.name``; lowband's GPT: bigram | tok_emb)."""
    mode: str = "auto"
    """Per step: auto (whichever is cheaper in bytes) | sparse | dense."""


def check_gpt_sparse_tables(cfg: Any) -> None:
    """``sparse.tables`` of lowband's GPT (``model.factory`` empty): only its ``bigram`` and ``tok_emb`` tables,
    the bigram table only when it exists. A factory model's tables are checked against its plan at set-up
    (:func:`lowband.optim.sparse_rows.sparse_tables_from_plan`, every rank alike, before any collective)."""
    for t in cfg.sparse.tables if not cfg.model.factory else ():
        if t not in ("bigram", "tok_emb"):
            raise ConfigError(f"sparse.tables: {t!r} is not allowed; allowed: bigram, tok_emb")
        if t == "bigram" and cfg.model.bigram_rows == 0:
            raise ConfigError("sparse.tables = ['bigram'] needs model.bigram_rows >= 2")


def check_grad_error_feedback(cfg: Any) -> None:
    """``sharded.grad_error_feedback`` keeps the error of a lossy gradient wire: it needs one."""
    if cfg.sharded.grad_error_feedback and cfg.strategy.grad_wire_dtype != "fp8":
        raise ConfigError(f"sharded.grad_error_feedback = true needs strategy.grad_wire_dtype = 'fp8' (it keeps what "
                          f"fp8 drops); strategy.grad_wire_dtype is {cfg.strategy.grad_wire_dtype!r}")


class _ShardedBase(Strategy):
    config_sections = ("strategy", "sharded", "sparse")
    fp8_grads = True
    diloco_inner = True
    sparse_rows = True
    ft_agreed_sections = ("sharded",)
    optimizer: ShardedOptimizer

    @classmethod
    def validate_config(cls, cfg: Any, world_size: int) -> None:
        super().validate_config(cfg, world_size)
        check_gpt_sparse_tables(cfg)
        check_grad_error_feedback(cfg)

    @classmethod
    def validate_inner(cls, cfg: Any, per_replica: int) -> None:
        """An fp32 master copy of the owned slices (kept for bf16 gathers or bf16 parameters) would not see the
        weights DiLoCo writes at every sync (the next inner step would overwrite them from it): refused."""
        where = f"diloco.inner = {cls.name}"
        if cfg.sharded.param_wire_dtype != "float32":
            raise ConfigError(f"sharded.param_wire_dtype = {cfg.sharded.param_wire_dtype} is not supported with "
                              f"{where} (its fp32 master copy would not see the weights DiLoCo writes at a sync); "
                              "use float32")
        if cfg.run.dtype == "bfloat16":
            raise ConfigError(f"run.dtype = bfloat16 is not supported with {where} (the sharded optimizer's fp32 "
                              "master copy would not see the weights DiLoCo writes at a sync); use float32 or "
                              "float64, or diloco.inner = ddp")
        check_gpt_sparse_tables(cfg)
        check_grad_error_feedback(cfg)

    @classmethod
    def accepts_fp8_grads_inner(cls, cfg: Any) -> bool:
        """The reduce-scatter inside the replica carries the fp8 gradients."""
        return True

    def prepare_inner(self) -> None:
        """Inside DiLoCo the updated slices are all-gathered within ``step()`` (``param_gather = "step"``):
        DiLoCo's step hook reads the updated weights."""
        self.param_gather = "step"

    def _groups(self, model: nn.Module) -> list[dict]:
        raise NotImplementedError

    param_gather: str = "forward"
    """When the updated slices' all-gathers are waited for: ``"forward"`` (by the next forward, per bucket)
    or ``"step"`` (at the end of ``step()``; set by DiLoCo before :meth:`setup_on_mesh`, whose step
    post-hook reads the updated, gathered weights)."""

    def setup(self, model: nn.Module) -> None:
        """The sharded optimizer over the world ``Comm``."""
        self._setup(model, self.env.comm)

    def setup_on_mesh(self, model: nn.Module, mesh: ParallelMesh) -> None:
        """The sharded optimizer over ``mesh.dp`` (e.g. the ranks of one DiLoCo replica): gradients are
        reduce-scattered and updated slices all-gathered over that group only; its ``init_sync`` broadcasts
        the weights from the group's first rank. ``mesh.gtp`` and ``mesh.tp`` must have size 1; replicas
        are made equal by the caller (DiLoCo's ``init_sync`` over ``mesh.replica``)."""
        if mesh.gtp.size != 1 or mesh.tp.size != 1:
            raise ValueError(f"strategy {self.name}: the mesh has gtp = {mesh.gtp.size}, tp = {mesh.tp.size}; "
                             "the sharded optimizer shards over the dp axis only (both must be 1)")
        self.mesh = mesh
        self._setup(model, mesh.dp)

    def _setup(self, model: nn.Module, comm: Comm) -> None:
        self.model = model
        o, s, sp = self.cfg.optim, self.cfg.strategy, self.cfg.sparse
        self.optimizer = ShardedOptimizer(
            self._groups(model), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            momentum=o.muon_momentum, comm=comm, bucket_mb=s.bucket_mb,
            grad_wire_dtype=_WIRE[s.grad_wire_dtype], param_wire_dtype=_WIRE[self.cfg.sharded.param_wire_dtype],
            grad_error_feedback=self.cfg.sharded.grad_error_feedback, exchange=self.cfg.sharded.exchange,
            module=model, param_gather=self.param_gather,
            sparse_tables=sparse_tables_from_plan(model, list(sp.tables), plan=self.model_plan(model),
                                                  where="sparse.tables"),
            sparse_mode=sp.mode)

    def observe_batch(self, tokens: torch.Tensor) -> None:
        """Sparse tables: record the step's touched rows and exchange the counts now, before forward."""
        if self.optimizer.sparse_units:
            self.optimizer.observe_tokens(tokens)
            self.optimizer.plan_sparse()

    def log_extras(self) -> dict[str, Any]:
        """Per sparse table: this step's mode, wire MB and touched-row density (this rank)."""
        out: dict[str, Any] = {}
        for name, st in self.optimizer.sparse_stats().items():
            out[f"{name}_mode"] = st.mode
            out[f"{name}_mb"] = st.wire_bytes / 1e6
            out[f"{name}_density"] = st.density
        return out

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        if last:
            yield
        else:
            with self.optimizer.no_sync():
                yield

    def clip_grad_norm(self, max_norm: float) -> float:
        """Norm of the averaged gradient from the owned shards (one scalar all-reduce); clips if > 0."""
        return float(self.optimizer.clip_grad_norm(max_norm if max_norm > 0 else float("inf")))

    def optimizer_state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def persistent_buffer_bytes(self) -> int:
        """Flat gradient buffers and reduced gradient shards (parameters live in the flat parameter
        buffers, so they are already counted as parameters)."""
        return self.optimizer.buffer_bytes()

    def unwrapped(self) -> nn.Module:
        self.optimizer.wait_for_params()
        return self.model

    def skip_step(self) -> None:
        """Non-finite guard verdict: :meth:`ShardedOptimizer.discard_step` waits for every reduce-scatter
        in flight and drops the step (clip_grad_norm already waited for the parameter all-gathers), so
        no shard is half-updated."""
        self.optimizer.discard_step()

    # Checkpoint hooks (docs/checkpoints.md); layout: lowband.optim.sharded_state.ShardedStateLayout.

    def checkpoint_format(self) -> str | None:
        return f"{self.name}-v1"

    def _ckpt_layout(self) -> ShardedStateLayout:
        if getattr(self, "_ckpt", None) is None:
            # buffers: the trainer saves each rank's own (TrainCheckpointer, buffers_rank<r>)
            self._ckpt = ShardedStateLayout(self.model, self.optimizer, include_buffers=False)
        return self._ckpt

    def state_dict(self) -> dict[str, Any]:
        return self._ckpt_layout().state_dict()

    def logical_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict`'s keys with whole tensors (collective, ``tag="state"``): for inspection and
        tests (DiLoCo's checkpoint stores the rank-local :meth:`state_dict`); :meth:`load_state_dict` takes it
        too."""
        return self._ckpt_layout().logical_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ckpt_layout().load_state_dict(state)

    def resume_settings(self) -> dict[str, Any]:
        """``sharded.param_wire_dtype``: it decides whether the checkpoint holds fp32 masters (a narrower gather
        keeps them); under another value a resume would drop them silently, or miss them."""
        return {"sharded.param_wire_dtype": self.cfg.sharded.param_wire_dtype}


@register_strategy("sharded-adamw")
class ShardedAdamWStrategy(_ShardedBase):
    def _groups(self, model: nn.Module) -> list[dict]:
        return [dict(g, algorithm="adamw") for g in adamw_param_groups(model, self.cfg.optim.weight_decay)]


def muon_ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on accelerators (the reference choice), fp32 on CPU, where bf16 matmuls are
    emulated and several times slower than fp32 ones."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}[name]


@register_strategy("sharded-muon")
class ShardedMuonStrategy(_ShardedBase):
    def _groups(self, model: nn.Module) -> list[dict]:
        o = self.cfg.optim
        muon, adam = muon_split(model, self.model_plan(model))
        muon = [p for p in muon if p.requires_grad]
        muon_ids = {id(p) for p in muon}
        groups: list[dict] = []
        if muon:
            groups.append({"params": muon, "algorithm": "muon", "lr": o.muon_lr, "momentum": o.muon_momentum,
                           "nesterov": True, "weight_decay": o.weight_decay, "ns_method": o.muon_ns_method,
                           "ns_steps": 5, "ns_dtype": muon_ns_dtype(o.muon_ns_dtype, self.env.device)})
        rest = nn.ParameterList([p for p in adam if id(p) not in muon_ids])
        groups += [dict(g, algorithm="adamw") for g in adamw_param_groups(rest, o.weight_decay)]
        return groups
