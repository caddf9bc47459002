"""An outside-style GPT, written the way a user's own script would be (nanoGPT-like), not by lowband's rules.

Differences from lowband's reference GPT that the external tests exercise: the token embedding is
tied to the output head (``transformer.wte.weight is lm_head.weight``), every ``nn.Linear`` has a bias,
learned absolute position embeddings (``wpe``), LayerNorm with bias, GELU MLP, other module names
(``transformer.h[i].attn.c_attn`` / ``c_proj``, ``mlp.c_fc`` / ``c_proj``), and per-rank seeding
(:func:`seeded_model` with ``seed + rank``), so ranks start from different weights unless synced.

:func:`outside_plan` is the plan a user writes for this model (:mod:`lowband.plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowband.plan import ModelPlan, ParallelLinear, SparseTableSpec


@dataclass
class OutsideConfig:
    vocab_size: int = 96
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True
    tie: bool = True


class SelfAttention(nn.Module):
    def __init__(self, cfg: OutsideConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.c_attn(x)
        width = qkv.shape[-1] // 3  # local width under a column-parallel c_attn
        q, k, v = qkv.split(width, dim=2)
        nh = width // self.head_dim  # heads held locally
        q, k, v = (z.view(b, t, nh, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, width))


class MLP(nn.Module):
    def __init__(self, cfg: OutsideConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: OutsideConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class OutsideGPT(nn.Module):
    """nanoGPT-shaped model with a tied embedding/head; ``forward(idx, targets)`` returns (logits, loss)."""

    def __init__(self, cfg: OutsideConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def seeded_model(seed: int, rank: int = 0, cfg: OutsideConfig | None = None,
                 dtype: torch.dtype = torch.float32) -> OutsideGPT:
    """nanoGPT-style per-rank init: ``torch.manual_seed(seed + rank)`` then build (ranks differ unless synced)."""
    torch.manual_seed(seed + rank)
    return OutsideGPT(cfg or OutsideConfig()).to(dtype)


def outside_plan(model: OutsideGPT) -> ModelPlan:
    """The plan a user writes for OutsideGPT: TP over c_attn (q|k|v, whole heads) / c_proj / c_fc, the
    ``wte`` as a sparse table (tied to lm_head when ``cfg.tie``: components must handle or refuse that);
    with ``tie=False`` the untied ``lm_head`` stays with AdamW under Muon."""
    cfg = model.cfg
    head_dim = cfg.n_embd // cfg.n_head
    linears = []
    for i in range(cfg.n_layer):
        b = f"transformer.h.{i}"
        linears += [ParallelLinear(f"{b}.attn.c_attn", "column", sections=3, granule=head_dim),
                    ParallelLinear(f"{b}.attn.c_proj", "row", granule=head_dim),
                    ParallelLinear(f"{b}.mlp.c_fc", "column"),
                    ParallelLinear(f"{b}.mlp.c_proj", "row")]
    units = ("transformer.wte", "transformer.wpe", *(f"transformer.h.{i}" for i in range(cfg.n_layer)),
             "transformer.ln_f")
    return ModelPlan(parallel_linears=tuple(linears),
                     sparse_tables=(SparseTableSpec("wte", "transformer.wte.weight", "none"),),
                     adamw_only=() if cfg.tie else ("lm_head.weight",),
                     fragment_units=(*units, *(() if cfg.tie else ("lm_head",))), vocab_size=cfg.vocab_size,
                     tp_divisors={"n_head": cfg.n_head, "n_embd": cfg.n_embd, "4 * n_embd": 4 * cfg.n_embd})


def random_batch(step: int, rank: int, batch: int = 4,
                 cfg: OutsideConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's deterministic (inputs, targets) for one step; the global batch is the ranks' union."""
    cfg = cfg or OutsideConfig()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()
