"""Model factories for the trainer's ``model.factory`` key (``"tests.external.factories:outside_gpt"``).

A factory gets the trainer's :class:`~lowband.train.config.Config` and returns the model, optionally with
its :class:`~lowband.plan.ModelPlan`. These build the outside-style GPT of :mod:`tests.external.outside_gpt`
the way its own script would: nanoGPT's per-rank seed (``run.seed + rank``), so ranks start from
different weights and the strategies must make them agree.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lowband.plan import ModelPlan, SparseTableSpec
from lowband.train.config import Config
from tests.external.outside_gpt import OutsideConfig, outside_plan, seeded_model


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
