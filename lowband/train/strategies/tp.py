"""``tp``: Megatron-style tensor parallelism trained with TP-REKLS (or AdamW); DP across TP groups.

Layout: the ranks form a mesh ``dp x tp`` (:func:`lowband.parallel.mesh.build_mesh`, TP innermost,
``tp.size``, 0 = the whole world). The model plan's ``parallel_linears``
(:func:`lowband.parallel.shard_tp`; for the reference GPT ``attn.qkv`` and ``mlp.fc`` column-parallel,
qkv rows permuted so each rank holds whole heads of q, k and v, ``attn.proj`` and ``mlp.proj``
row-parallel) are split; embeddings, norms and ``lm_head`` stay replicated. Initial weights are
broadcast from rank 0 over the world first.

Data: the trainer hands every rank its own slice of the global batch; the TP ranks of a group
all-gather their slices (``tag="tp:input"``) and all compute on the union, so a step sees the same
global batch as DDP. Communication per step: TP activations (one all-reduce per row-parallel layer
forward and per column-parallel layer backward), the input gather (a 128-word shape header, tag
``tp:input_shapes``, then each input), the optimizer's (TP-REKLS: 2
collectives), and with ``dp > 1`` one coalesced all-reduce (avg) of all gradients over DP.

RNG: after sharding, every rank's torch RNG is seeded ``run.seed + dp_rank``, the same on the ranks of a
TP group, so a dropout draws the same masks on them (:class:`~lowband.parallel.tensor.TPInputMismatchError`
otherwise) and other masks in each TP group; a resume restores each rank's saved RNG state after this.

Optimizer (``tp.optimizer``): ``rekls`` = :class:`~lowband.optim.tp_rekls.TpRekls` with
the layers' placements (REKLS on the TP matrices, sharded factors; AdamW on embeddings,
``lm_head`` and 1-D params, no weight decay on 1-D); ``adamw`` = torch AdamW on the local shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lowband.comm import Comm
from lowband.optim.tp_rekls import TpRekls
from lowband.parallel.clip import clip_grad_norm_, global_grad_norm
from lowband.parallel.gtp import reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.parallel.tensor import TPInputGather
from lowband.parallel.tp_shard import shard_tp
from lowband.plan import plan_for
from lowband.sharding import cut_of
from lowband.train.errors import ConfigError
from lowband.train.optimizers import torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy


@dataclass(kw_only=True)
class TPConfig:
    """Strategy ``tp``: tensor parallelism with TP-REKLS or AdamW (docs/rekls.md)."""

    size: int = 0
    """Tensor-parallel group size (0 = the whole world); must divide the world size (the rest is DP)."""
    optimizer: str = "rekls"
    """rekls (TP-REKLS on the sharded block matrices, AdamW elsewhere) | adamw."""


def shard_gpt_tp(model: nn.Module, comm: Comm) -> nn.Module:
    """Replace the block linears of the reference GPT by column/row-parallel slices (in place), from
    its plan (``GPT.lowband_plan()``; a convenience over :func:`lowband.parallel.shard_tp`)."""
    shard_tp(model, plan_for(model), comm)
    return model


def _is_tp(p: torch.Tensor) -> bool:
    return cut_of(p, "tp") is not None


@register_strategy("tp")
class TPStrategy(Strategy):
    """Tensor parallelism (+ data parallelism across TP groups) with TP-REKLS or AdamW."""

    config_sections = ("tp",)
    needs_parallel_linears = True

    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        super().validate_config(cfg, world_size)
        s, m = cfg.tp, cfg.model
        tp = s.size or world_size
        if s.size < 0 or world_size % tp:
            raise ConfigError(f"tp.size ({s.size}) must be 0 (whole world) or divide "
                              f"run.world_size ({world_size})")
        for name, value in (("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                            ("model.mlp_ratio * model.n_embd", m.mlp_ratio * m.n_embd)):
            if value % tp:
                raise ConfigError(f"strategy tp: {name} ({value}) must be divisible by the TP size {tp}")

    def setup(self, model: nn.Module) -> None:
        s, o = self.cfg.tp, self.cfg.optim
        tp = s.size or self.env.world_size
        self.mesh = build_mesh(tp=tp, ledger=self.env.comm.ledger)
        # the model's plan names the parallel linears; initial weights broadcast from rank 0 over the world
        shard_tp(model, self.model_plan(model), self.mesh.tp, sync_comm=self.env.comm)
        self.model = TPInputGather(model, self.mesh.tp)
        # the forward's random ops (dropout) must draw alike on the ranks of a TP group, which compute one layer
        # from the same replicated activations (a factory may have left per-rank seeds: nanoGPT's seed + rank),
        # and apart across TP groups, which train on other data
        torch.manual_seed(self.cfg.run.seed + self.mesh.dp.rank)
        if s.optimizer == "adamw":
            self.optimizer = torch_adamw(model, o)
            return
        params = [p for p in model.parameters() if p.requires_grad]
        tp_mats = [p for p in params if _is_tp(p) and p.dim() == 2]
        other_mats = [p for p in params if not _is_tp(p) and p.dim() >= 2]
        vectors = [p for p in params if p.dim() < 2]
        groups = [{"params": tp_mats, "weight_decay": o.weight_decay}]
        if other_mats:  # embeddings and lm_head: AdamW (max_precond_dim=1 routes them there)
            groups.append({"params": other_mats, "weight_decay": o.weight_decay, "max_precond_dim": 1})
        if vectors:
            groups.append({"params": vectors, "weight_decay": 0.0})
        self.optimizer = TpRekls(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                 weight_decay=o.weight_decay, tp_comm=self.mesh.tp)

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        yield
        if last and self.mesh.dp.size > 1:
            reduce_grads(self.mesh.dp, self.model.parameters(), "avg", tag="grad")

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm (:func:`lowband.parallel.clip_grad_norm_`: TP slices' squares summed over the TP
        group, replicated params counted once); clips only if ``max_norm > 0``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if max_norm > 0:
            return float(clip_grad_norm_(params, max_norm))
        return float(global_grad_norm(params))

    def unwrapped(self) -> nn.Module:
        """The input-gathering TP model (every TP rank must call it together; parameters are shards)."""
        return self.model

    # ----------------------------------------------------------------------------------------------
    # Checkpoint hooks (docs/checkpoints.md); the layout is lowband.optim.tp_state.TPStateLayout:
    # TP shards and REKLS factor rows as DTensors on the dp x tp mesh in the dense model's coordinates,
    # so a checkpoint loads at another TP size. skip_step is the default (zero_grad): the DP gradient
    # all-reduce and the TP-REKLS collectives are synchronous, nothing is in flight at the guard.

    def _ckpt_layout(self):
        from lowband.optim.tp_state import TPStateLayout

        if getattr(self, "_ckpt", None) is None:
            dm = self.mesh.device_mesh(self.env.device.type)["dp", "tp"] if self.env.world_size > 1 else None
            self._ckpt = TPStateLayout(self.model.module, self.optimizer, self.mesh.tp.size, self.mesh.dp.size,
                                       device_mesh=dm, include_buffers=False)  # the trainer saves every rank's
        return self._ckpt

    def checkpoint_format(self) -> str | None:
        return f"tp-{self.cfg.tp.optimizer}-v1"

    def state_dict(self) -> dict:
        return self._ckpt_layout().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ckpt_layout().load_state_dict(state)

    def fit_resume_template(self, state: dict, saved_keys: set[str]) -> None:
        """Checkpoints written before :class:`~lowband.optim.tp_state.TPStateLayout` saved module buffers load
        without them (:meth:`~lowband.optim.tp_state.TPStateLayout.fit_template`)."""
        self._ckpt_layout().fit_template(state, saved_keys)

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self._ckpt_layout().param_shapes()
