"""The reference GPT: pre-norm transformer with RoPE, ReLU² MLP, RMSNorm and an optional hashed bigram table.

Layout (module attribute names are part of the API: tensor-parallel and GTP components swap the
linears in place, so the model only ever *calls* them as modules)::

    tok_emb   nn.Embedding(vocab_size, n_embd)
    bigram    HashedBigramEmbedding(bigram_rows, n_embd) or None; its output is added to tok_emb's
    blocks[i] Block: x = x + attn(norm1(x)); x = x + mlp(norm2(x))
        .norm1, .norm2   RMSNorm (learnable 1-D weight)
        .attn.qkv        nn.Linear(n_embd, 3 * n_embd, bias=False), output layout [q | k | v]
        .attn.proj       nn.Linear(n_embd, n_embd, bias=False)
        .mlp.fc          nn.Linear(n_embd, mlp_ratio * n_embd, bias=False)
        .mlp.proj        nn.Linear(mlp_ratio * n_embd, n_embd, bias=False)
    norm      RMSNorm
    lm_head   nn.Linear(n_embd, vocab_size, bias=False), untied from tok_emb

Attention derives its head count from the width ``qkv`` actually returns (``n_heads = width // 3 //
head_dim``), so a column-parallel ``qkv`` that returns the local ``[q_local | k_local | v_local]`` (whole
heads of each of q, k and v) and a row-parallel ``proj`` work unchanged. RoPE uses the half-split
convention on each head; cos/sin are computed once per forward in float64 and cast to the activation
dtype. The MLP activation is ReLU² (``relu(x)**2``, as in modded-nanogpt): cheap, and once
differentiable, so float64 gradient checks pass.

Init (:meth:`GPT.init_weights`, deterministic from ``torch.manual_seed`` or a given generator):
normal(0, 0.02) for ``tok_emb``, ``qkv``, ``mlp.fc`` and ``lm_head``; normal(0, 0.02 / sqrt(2 * n_layer))
for the residual projections ``attn.proj`` and ``mlp.proj`` (GPT-2 scaling); zeros for the bigram table;
ones for the RMSNorm weights.

No communication happens in this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowband.model.bigram import HashedBigramEmbedding
from lowband.plan import ModelPlan, ParallelLinear, SparseTableSpec

INIT_STD = 0.02


def _check_pos_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"GPTConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"GPTConfig.{name} must be >= 1, got {value}")


@dataclass
class GPTConfig:
    """Shape of the reference GPT.

    Attributes:
        vocab_size: rows of ``tok_emb`` and outputs of ``lm_head`` (the byte tokenizer uses 320).
        seq_len: longest sequence ``forward`` accepts.
        n_layer: number of transformer blocks.
        n_head: attention heads; ``n_embd % n_head == 0`` and ``head_dim = n_embd // n_head`` even (RoPE).
        n_embd: model width.
        mlp_ratio: MLP hidden width is ``mlp_ratio * n_embd``.
        bigram_rows: rows of the hashed bigram table; 0 disables it, otherwise >= 2.
        rope_base: RoPE frequency base (> 0).
        norm_eps: RMSNorm epsilon (> 0); fixed rather than dtype-dependent so float32 and float64
            compute the same function.
    """

    vocab_size: int = 320
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    bigram_rows: int = 0
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            _check_pos_int(name, getattr(self, name))
        if isinstance(self.bigram_rows, bool) or not isinstance(self.bigram_rows, int):
            raise TypeError(f"GPTConfig.bigram_rows must be an int, got {type(self.bigram_rows).__name__}")
        if self.bigram_rows == 1 or self.bigram_rows < 0:
            raise ValueError(f"GPTConfig.bigram_rows must be 0 (no bigram table) or >= 2, "
                             f"got {self.bigram_rows}")
        for name in ("rope_base", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"GPTConfig.{name} must be a float, got {type(value).__name__} {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a finite number > 0, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by GPTConfig.n_head "
                             f"({self.n_head})")
        if (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"GPTConfig.n_head: head_dim = n_embd // n_head = {self.n_embd // self.n_head} "
                             "must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


def rope_cos_sin(seq_len: int, head_dim: int, base: float, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``(seq_len, head_dim // 2)``, computed in float64, cast to ``dtype``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)`` by position (half-split pairs ``(x[j], x[j + D/2])``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim; ``weight`` is a 1-D learnable Parameter."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on q and k, via ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)
        width = qkv.shape[-1]
        if width % (3 * self.head_dim) != 0:
            raise ValueError(f"attn.qkv returned width {width}, which is not a multiple of 3 * head_dim "
                             f"(= {3 * self.head_dim}); a sharded qkv must return whole heads of q, k and v")
        q_width = width // 3
        n_local_heads = q_width // self.head_dim
        q, k, v = (t.view(B, T, n_local_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.split(q_width, dim=-1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, q_width))


class MLP(nn.Module):
    """``proj(relu(fc(x)) ** 2)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Reference decoder-only language model (see the module docstring for the layout and init).

    Args:
        config: a :class:`GPTConfig`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.bigram = HashedBigramEmbedding(config.bigram_rows, config.n_embd) if config.bigram_rows else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialize every parameter deterministically, in a fixed order (see module docstring).

        Args:
            generator: optional ``torch.Generator``; the global RNG is used when None.
        """
        std_res = INIT_STD / math.sqrt(2 * self.config.n_layer)
        self.tok_emb.weight.normal_(0.0, INIT_STD, generator=generator)
        if self.bigram is not None:
            self.bigram.weight.zero_()
        for block in self.blocks:
            block.norm1.weight.fill_(1.0)
            block.norm2.weight.fill_(1.0)
            block.attn.qkv.weight.normal_(0.0, INIT_STD, generator=generator)
            block.attn.proj.weight.normal_(0.0, std_res, generator=generator)
            block.mlp.fc.weight.normal_(0.0, INIT_STD, generator=generator)
            block.mlp.proj.weight.normal_(0.0, std_res, generator=generator)
        self.norm.weight.fill_(1.0)
        self.lm_head.weight.normal_(0.0, INIT_STD, generator=generator)

    def lowband_plan(self) -> ModelPlan:
        """What lowband's strategies need to know about this model (see :mod:`lowband.plan`).

        Column-parallel ``attn.qkv`` (3 sections q|k|v, whole heads per rank) and ``mlp.fc``,
        row-parallel ``attn.proj`` (whole heads) and ``mlp.proj``; sparse tables ``tok_emb`` (token ids)
        and, when present, ``bigram`` (bigram hash); ``lm_head`` stays with AdamW under Muon; one
        fragment unit per block, the embeddings and the final norm + head.
        """
        c = self.config
        linears: list[ParallelLinear] = []
        for i in range(c.n_layer):
            b = f"blocks.{i}"
            linears += [ParallelLinear(f"{b}.attn.qkv", "column", sections=3, granule=c.head_dim),
                        ParallelLinear(f"{b}.attn.proj", "row", granule=c.head_dim),
                        ParallelLinear(f"{b}.mlp.fc", "column"),
                        ParallelLinear(f"{b}.mlp.proj", "row")]
        tables = [SparseTableSpec("tok_emb", "tok_emb.weight", "none")]
        if self.bigram is not None:
            tables.append(SparseTableSpec("bigram", "bigram.weight", "bigram"))
        units = ["tok_emb"] + (["bigram"] if self.bigram is not None else [])
        units += [f"blocks.{i}" for i in range(c.n_layer)] + ["norm", "lm_head"]
        return ModelPlan(parallel_linears=tuple(linears), sparse_tables=tuple(tables), adamw_only=("lm_head.weight",),
                         fragment_units=tuple(units), vocab_size=c.vocab_size,
                         tp_divisors={"model.n_head": c.n_head, "model.n_embd": c.n_embd,
                                      "model.mlp_ratio * model.n_embd": c.mlp_ratio * c.n_embd})

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters; with ``non_embedding`` the token and bigram tables are left out."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.bigram is not None:
                n -= self.bigram.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` is given.

        Args:
            idx: token ids, int64 (or int32) of shape ``(B, T)`` with ``1 <= T <= config.seq_len``.
            targets: optional next-token ids of the same shape; entries equal to -100 are ignored.

        Returns:
            logits ``(B, T, vocab_size)`` in the model's dtype if ``targets`` is None, else the scalar
            mean cross-entropy (computed in float32 for half-precision logits, else in their dtype).
        """
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must be an int64 or int32 tensor, got "
                            f"{idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        if not 1 <= T <= self.config.seq_len:
            raise ValueError(f"idx has T={T} positions; GPTConfig.seq_len allows 1..{self.config.seq_len}")
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(f"targets must have the shape of idx {(B, T)}, got {tuple(targets.shape)}")

        x = self.tok_emb(idx)
        if self.bigram is not None:
            x = x + self.bigram(idx)
        cos, sin = rope_cos_sin(T, self.config.head_dim, self.config.rope_base, x.dtype, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T).long())
