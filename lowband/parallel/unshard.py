"""Gathered evaluation and export: a plain, unsharded copy of a GTP and/or TP model.

A GTP or TP model can only run forward on *every* rank of its groups together (each forward
gathers weights, or all-reduces activations). To evaluate on one rank (nanoGPT's "rank 0 evaluates"),
export, or save a plain ``torch.save`` checkpoint, first call :func:`unsharded_copy` on every rank:
it returns an ordinary ``nn.Module`` (``nn.Linear`` / ``nn.Embedding`` with the full logical weights,
no communication left in it) that any single rank may run alone. The original model is untouched.

Communication pattern (every rank of every group involved must call it, in the same program order):
per sharded module, in ``named_modules()`` order: a :class:`~lowband.parallel.gtp.GTPLinear` /
:class:`~lowband.parallel.gtp.GTPEmbedding` weight is all-gathered over its GTP group (tag
``"gtp:state"``); a :class:`~lowband.parallel.tensor.ColumnParallelLinear` weight and bias, and a
:class:`~lowband.parallel.tensor.RowParallelLinear` weight, are all-gathered over the TP group (tag
``"tp:state"``); GTP x TP layers do both (GTP first). Memory: the copy holds the full model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lowband.comm import Comm
from lowband.parallel.gtp import GTPEmbedding, GTPLinear
from lowband.parallel.gtp_tp import GTPColumnParallelLinear, GTPRowParallelLinear
from lowband.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPInputGather, unpermute_sections


def _gather_tp(comm: Comm, local: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather ``local`` over ``comm`` and concatenate along ``dim`` in rank order."""
    x = local.detach().contiguous()
    if comm.size == 1:
        return x.clone()
    buf = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(buf, x, tag="tp:state")
    return torch.cat(list(buf.unbind(0)), dim=dim)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Parameter) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                    device=weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.weight.requires_grad_(like.requires_grad)
    return lin


def _plain(module: nn.Module) -> nn.Module | None:
    """The unsharded replacement of one sharded module (collective), or ``None`` if it is not one."""
    if isinstance(module, GTPLinear):
        w = module.runtime.full_weight(module.gtp)
        return _linear(w, None if module.bias is None else module.bias.detach(), module.weight)
    if isinstance(module, GTPEmbedding):
        emb = nn.Embedding(module.num_embeddings, module.embedding_dim, dtype=module.weight.dtype,
                           device=module.weight.device)
        with torch.no_grad():
            emb.weight.copy_(module.runtime.full_weight(module.gtp))
        emb.weight.requires_grad_(module.weight.requires_grad)
        return emb
    if isinstance(module, ColumnParallelLinear):
        sections = getattr(module, "sections", 1)
        n = module.tp_comm.size
        w = unpermute_sections(_gather_tp(module.tp_comm, module.weight, 0), sections, n)
        b = None if module.bias is None else unpermute_sections(_gather_tp(module.tp_comm, module.bias, 0),
                                                                 sections, n)
        return _linear(w, b, module.weight)
    if isinstance(module, RowParallelLinear):
        w = _gather_tp(module.tp_comm, module.weight, 1)
        return _linear(w, None if module.bias is None else module.bias.detach(), module.weight)
    if isinstance(module, GTPColumnParallelLinear):
        inner = module.inner
        w = _gather_tp(module.tp_comm, inner.runtime.full_weight(inner.gtp), 0)
        b = None if inner.bias is None else _gather_tp(module.tp_comm, inner.bias, 0)
        return _linear(w, b, inner.weight)
    if isinstance(module, GTPRowParallelLinear):
        inner = module.inner
        w = _gather_tp(module.tp_comm, inner.runtime.full_weight(inner.gtp), 1)
        return _linear(w, None if module.bias is None else module.bias.detach(), inner.weight)
    return None


@torch.no_grad()
def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain deep copy of ``model`` with every GTP / TP layer replaced by its dense equivalent.

    Collective: every rank of the model's GTP and TP groups must call it (see the module docstring).
    A :class:`~lowband.parallel.tensor.TPInputGather` wrapper is dropped (the copy takes the whole
    batch itself). Tied parameters stay tied; parameters keep ``requires_grad``. The copy's weights
    are identical on every rank, so rank 0 may evaluate it alone.
    """
    if isinstance(model, TPInputGather):
        model = model.module
    memo: dict[int, object] = {}
    replaced: list[str] = []
    for name, module in model.named_modules():
        if id(module) in memo or any(name.startswith(f"{r}.") for r in replaced):
            continue  # already gathered, or inside a replaced layer (a GTP x TP layer's inner GTPLinear)
        plain = _plain(module)
        if plain is not None:
            memo[id(module)] = plain
            replaced.append(name)
    if id(model) in memo:
        return memo[id(model)]  # type: ignore[return-value]
    return copy.deepcopy(model, memo)
