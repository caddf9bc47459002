"""Model factories for the trainer's ``model.factory`` key (``"tests.external.factories:outside_gpt"``).

A factory gets the trainer's :class:`~lowband.train.config.Config` and returns the model, optionally with
its :class:`~lowband.plan.ModelPlan`. These build the outside-style GPT of :mod:`tests.external.outside_gpt`
the way its own script would: nanoGPT's per-rank seed (``run.seed + rank``), so ranks start from
different weights and the strategies must make them agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowband.plan import ModelPlan, SparseTableSpec
from lowband.train.config import Config
from tests.external.outside_gpt import OutsideConfig, OutsideGPT, outside_plan, seeded_model


def outside_config(cfg: Config, *, tie: bool = True) -> OutsideConfig:
    """OutsideGPT's shape from the GPT keys of ``[model]`` (vocab, seq_len as block_size, layers, heads, width)."""
    m = cfg.model
    return OutsideConfig(vocab_size=m.vocab_size, block_size=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                         n_embd=m.n_embd, tie=tie)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def outside_gpt(cfg: Config) -> tuple[nn.Module, ModelPlan]:
    """Tied OutsideGPT seeded ``run.seed + rank`` (ranks differ) with the plan a user writes for it."""
    model = seeded_model(cfg.run.seed, _rank(), outside_config(cfg))
    return model, outside_plan(model)


def outside_gpt_untied(cfg: Config) -> tuple[nn.Module, ModelPlan]:
    """As :func:`outside_gpt` with the head untied from the embedding (sparse tables and TP apply)."""
    model = seeded_model(cfg.run.seed, _rank(), outside_config(cfg, tie=False))
    return model, outside_plan(model)


def outside_gpt_same_seed(cfg: Config) -> nn.Module:
    """Tied OutsideGPT seeded ``run.seed`` on every rank, plan-less (its forward returns (logits, loss)):
    the single-process reference the per-rank-seeded runs are compared with (rank 0 builds this model)."""
    return seeded_model(cfg.run.seed, 0, outside_config(cfg))


def hf_gpt2_config(cfg: Config):
    """A tiny random ``transformers.GPT2Config`` from ``[model]`` (no download): no dropout, eager attention,
    no KV cache, tied ``wte``/``lm_head`` (GPT-2's default)."""
    from transformers import GPT2Config

    m = cfg.model
    return GPT2Config(vocab_size=m.vocab_size, n_positions=m.seq_len, n_embd=m.n_embd, n_layer=m.n_layer,
                      n_head=m.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0, attn_implementation="eager")


def hf_gpt2_plan(model: nn.Module) -> ModelPlan:
    """The plan a user writes for ``GPT2LMHeadModel``: ``wte`` may travel row-sparse (it is tied to
    ``lm_head``, so components must refuse it), one DiLoCo fragment unit per block; no parallel linears,
    because GPT-2's projections are ``transformers``' ``Conv1D`` (a transposed weight), not ``nn.Linear``."""
    c = model.config
    units = ("transformer.wte", "transformer.wpe", *(f"transformer.h.{i}" for i in range(c.n_layer)),
             "transformer.ln_f")
    return ModelPlan(sparse_tables=(SparseTableSpec("wte", "transformer.wte.weight", "none"),),
                     fragment_units=units, vocab_size=c.vocab_size)


def hf_gpt2(cfg: Config) -> tuple[nn.Module, ModelPlan]:
    """Hugging Face ``GPT2LMHeadModel`` from a tiny random config, seeded ``run.seed + rank``, with its plan."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(cfg.run.seed + _rank())
    model = GPT2LMHeadModel(hf_gpt2_config(cfg))
    return model, hf_gpt2_plan(model)



class ConditionalLM(nn.Module):
    """A token model with parameters that get no gradient on some steps (issue 20), for the trainer.

    With ``conditional=True``: ``emb`` is a frozen embedding; ``proj`` an ordinary linear; ``branch``
    runs only when the forward counter ``calls`` (a buffer updated in forward) is even, so on odd steps
    no rank uses it; ``expert_a`` / ``expert_b`` route each sequence by the parity of its first token
    (MoE-style), so a rank whose sequences all go one way leaves the other expert without a gradient
    while another rank uses it. ``mix`` is a buffer drawn per rank at construction. With
    ``conditional=False`` every parameter is trainable and used on every step (both experts see every
    sequence): what GTP needs, whose layers must run on every rank of the group; ``route=False`` keeps
    the frozen embedding and the branch but sends every sequence through both experts. ``forward(idx,
    targets)`` returns the mean next-token cross-entropy. Built from ``nn.Linear`` / ``nn.Embedding``
    only and returned without a plan (the plan-free GTP path shards every linear).
    """

    def __init__(self, vocab: int, dim: int, conditional: bool = True, route: bool = True) -> None:
        import torch

        super().__init__()
        self.conditional, self.route = conditional, conditional and route
        self.emb = nn.Embedding(vocab, dim)
        self.emb.weight.requires_grad_(not conditional)
        self.proj = nn.Linear(dim, dim)
        self.branch = nn.Linear(dim, dim)
        self.expert_a = nn.Linear(dim, dim, bias=False)
        self.expert_b = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mix", 0.5 + torch.rand(dim))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, idx, targets):
        import torch
        import torch.nn.functional as F

        h = torch.tanh(self.proj(self.emb(idx) * self.mix))
        if not self.conditional or int(self.calls) % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        if self.route:
            route_a = idx[:, 0] % 2 == 0
            out = torch.zeros_like(h)
            if bool(route_a.any()):
                out[route_a] = torch.tanh(self.expert_a(h[route_a]))
            if bool((~route_a).any()):
                out[~route_a] = torch.tanh(self.expert_b(h[~route_a]))
        else:
            out = torch.tanh(self.expert_a(h)) + torch.tanh(self.expert_b(h))
        logits = self.head(h + out)
        with torch.no_grad():
            self.calls += 1
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def conditional_lm(cfg: Config) -> nn.Module:
    """:class:`ConditionalLM` (vocab ``model.vocab_size``, width ``model.n_embd``) with its frozen, conditional
    and routed parameters, seeded ``run.seed + rank`` (ranks start with different weights and buffers); a
    bare module, no plan."""
    import torch

    torch.manual_seed(cfg.run.seed + _rank())
    return ConditionalLM(cfg.model.vocab_size, cfg.model.n_embd)


def branch_lm(cfg: Config) -> nn.Module:
    """:class:`ConditionalLM` with ``route=False``: the frozen embedding and the branch unused on odd steps
    (on every rank alike), no routing; seeded ``run.seed + rank``, no plan."""
    import torch

    torch.manual_seed(cfg.run.seed + _rank())
    return ConditionalLM(cfg.model.vocab_size, cfg.model.n_embd, route=False)


def plain_lm(cfg: Config) -> nn.Module:
    """:class:`ConditionalLM` with ``conditional=False`` (every parameter trainable and used on every step),
    seeded ``run.seed + rank``; a bare module without a plan (plan-free GTP)."""
    import torch

    torch.manual_seed(cfg.run.seed + _rank())
    return ConditionalLM(cfg.model.vocab_size, cfg.model.n_embd, conditional=False)


class _RunningLossGPT(OutsideGPT):
    """OutsideGPT with a persistent buffer its training forwards update (like BatchNorm's running
    statistics): an average of the loss that also scales it, so a buffer lost or mixed up across ranks at a
    resume changes the losses. It differs per rank (each rank sees its own batches)."""

    def __init__(self, cfg: OutsideConfig) -> None:
        super().__init__(cfg)
        self.register_buffer("running_loss", torch.zeros(()))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits, loss = super().forward(idx, targets)
        if loss is not None and self.training:
            with torch.no_grad():
                self.running_loss.mul_(0.5).add_(0.5 * loss.detach().to(self.running_loss.dtype))
            loss = loss * (1 + self.running_loss.to(loss.dtype))
        return logits, loss


def outside_gpt_running_loss(cfg: Config) -> tuple[nn.Module, ModelPlan]:
    """As :func:`outside_gpt`, with a per-rank persistent buffer (:class:`_RunningLossGPT`)."""
    torch.manual_seed(cfg.run.seed + _rank())
    model = _RunningLossGPT(outside_config(cfg))
    return model, outside_plan(model)


def outside_gpt_dropout(cfg: Config) -> tuple[nn.Module, ModelPlan]:
    """Untied OutsideGPT seeded ``run.seed + rank`` with dropout (p = 0.1) on the residual stream after every
    attention and MLP block (GPT-2's ``resid_pdrop``), as forward hooks, and its plan."""
    model = seeded_model(cfg.run.seed, _rank(), outside_config(cfg, tie=False))
    for block in model.transformer.h:  # a submodule of the block, so model.eval() turns it off
        block.resid_drop = nn.Dropout(0.1)
        block.attn.register_forward_hook(lambda mod, args, out, b=block: b.resid_drop(out))
        block.mlp.register_forward_hook(lambda mod, args, out, b=block: b.resid_drop(out))
    return model, outside_plan(model)
