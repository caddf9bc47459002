"""``tp``: Megatron-style tensor parallelism trained with TP-REKLS (or AdamW); DP across TP groups.

Layout: the ranks form a mesh ``dp x tp`` (:func:`lowband.parallel.mesh.build_mesh`, TP innermost,
``strategy.tp_size``, 0 = the whole world). In every block ``attn.qkv`` and ``mlp.fc`` become
:class:`~lowband.parallel.tensor.ColumnParallelLinear` (qkv rows permuted so each rank holds whole
heads of q, k and v), ``attn.proj`` and ``mlp.proj`` become
:class:`~lowband.parallel.tensor.RowParallelLinear`; embeddings, norms and ``lm_head`` stay
replicated.

Data: the trainer hands every rank its own slice of the global batch; the TP ranks of a group
all-gather their slices (``tag="tp:input"``) and all compute on the union, so a step sees the same
global batch as DDP. Communication per step: TP activations (one all-reduce per row-parallel layer
forward and per column-parallel layer backward), the input gather, the optimizer's (TP-REKLS: 2
collectives), and with ``dp > 1`` one coalesced all-reduce (avg) of all gradients over DP.

Optimizer (``strategy.tp_optimizer``): ``rekls`` = :class:`~lowband.optim.tp_rekls.TpRekls` with
the layers' ``partition_dim`` (REKLS on the TP matrices, sharded factors; AdamW on embeddings,
``lm_head`` and 1-D params, no weight decay on 1-D); ``adamw`` = torch AdamW on the local shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lowband.comm import Comm
from lowband.optim.tp_rekls import TpRekls
from lowband.parallel.gtp import reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from lowband.train.optimizers import torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy


def _qkv_by_rank(linear: nn.Linear, tp: int) -> nn.Linear:
    """A copy of ``qkv`` with rows reordered so chunk r is ``[q_r; k_r; v_r]`` (rank r's heads)."""
    q, k, v = linear.weight.detach().chunk(3, dim=0)
    rows = [t for r in range(tp) for t in (q.chunk(tp, 0)[r], k.chunk(tp, 0)[r], v.chunk(tp, 0)[r])]
    out = nn.Linear(linear.in_features, linear.out_features, bias=False, dtype=linear.weight.dtype,
                    device=linear.weight.device)
    with torch.no_grad():
        out.weight.copy_(torch.cat(rows, dim=0))
    return out


def shard_gpt_tp(model: nn.Module, comm: Comm) -> nn.Module:
    """Replace the block linears of the reference GPT by column/row-parallel slices (in place)."""
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear.from_dense(_qkv_by_rank(attn.qkv, comm.size), comm)
        attn.proj = RowParallelLinear.from_dense(attn.proj, comm)
        mlp.fc = ColumnParallelLinear.from_dense(mlp.fc, comm)
        mlp.proj = RowParallelLinear.from_dense(mlp.proj, comm)
    return model


class TPInputGather(nn.Module):
    """Calls the TP model on the union of the TP group's input slices (all-gathered, rank order)."""

    def __init__(self, module: nn.Module, comm: Comm) -> None:
        super().__init__()
        self.module = module
        self.comm = comm

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return x
        x = x.contiguous()
        buf = torch.empty((self.comm.size, *x.shape), dtype=x.dtype, device=x.device)
        self.comm.all_gather(buf, x, tag="tp:input")
        return buf.reshape(-1, *x.shape[1:])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        idx = self._gather(idx)
        return self.module(idx, None if targets is None else self._gather(targets))


def _is_tp(p: torch.Tensor) -> bool:
    return getattr(p, "partition_dim", None) is not None


@register_strategy("tp")
class TPStrategy(Strategy):
    """Tensor parallelism (+ data parallelism across TP groups) with TP-REKLS or AdamW."""

    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        from lowband.train.config import ConfigError

        super().validate_config(cfg, world_size)
        s, m = cfg.strategy, cfg.model
        tp = s.tp_size or world_size
        if s.tp_size < 0 or world_size % tp:
            raise ConfigError(f"strategy.tp_size ({s.tp_size}) must be 0 (whole world) or divide "
                              f"run.world_size ({world_size})")
        for name, value in (("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                            ("model.mlp_ratio * model.n_embd", m.mlp_ratio * m.n_embd)):
            if value % tp:
                raise ConfigError(f"strategy tp: {name} ({value}) must be divisible by the TP size {tp}")

    def setup(self, model: nn.Module) -> None:
        s, o = self.cfg.strategy, self.cfg.optim
        tp = s.tp_size or self.env.world_size
        self.mesh = build_mesh(tp=tp, ledger=self.env.comm.ledger)
        shard_gpt_tp(model, self.mesh.tp)
        self.model = TPInputGather(model, self.mesh.tp)
        if s.tp_optimizer == "adamw":
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

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm: TP shards' squares summed over the TP group, replicated params counted once."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        acc = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        sq = torch.zeros(2, dtype=acc, device=params[0].device)
        for p in params:
            sq[0 if _is_tp(p) else 1] += p.grad.to(acc).square().sum()
        self.mesh.tp.all_reduce(sq[:1], "sum", tag="tp:norm")
        total = float(sq.sum().sqrt())
        if max_norm > 0:
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        return total

    def unwrapped(self) -> nn.Module:
        """The input-gathering TP model (every TP rank must call it together; parameters are shards)."""
        return self.model

    # ----------------------------------------------------------------------------------------------
    # Checkpoint hooks (docs/checkpoints.md); the layout is lowband.train.checkpoint_tp.TPStateLayout:
    # TP shards and REKLS factor rows as DTensors on the dp x tp mesh in the dense model's coordinates,
    # so a checkpoint loads at another TP size. skip_step is the default (zero_grad): the DP gradient
    # all-reduce and the TP-REKLS collectives are synchronous, nothing is in flight at the guard.

    def _ckpt_layout(self):
        from lowband.train.checkpoint_tp import TPStateLayout

        if getattr(self, "_ckpt", None) is None:
            self._ckpt = TPStateLayout(self.model.module, self.optimizer, self.mesh.tp.size, self.mesh.dp.size)
        return self._ckpt

    def checkpoint_format(self) -> str | None:
        return f"tp-{self.cfg.strategy.tp_optimizer}-v1"

    def state_dict(self) -> dict:
        return self._ckpt_layout().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ckpt_layout().load_state_dict(state)

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self._ckpt_layout().param_shapes()
