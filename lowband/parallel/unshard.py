"""Gathered evaluation and export: a plain, unsharded copy of a GTP and/or TP model.

A GTP or TP model can only run forward on *every* rank of its groups together (each forward
gathers weights, or all-reduces activations). To evaluate on one rank (nanoGPT's "rank 0 evaluates"),
export, or save a plain ``torch.save`` checkpoint, first call :func:`unsharded_copy` on every rank:
it returns an ordinary ``nn.Module`` (``nn.Linear`` / ``nn.Embedding`` with the full logical weights,
no communication left in it) that any single rank may run alone. The original model is untouched.

Which modules are sharded, and how each becomes dense, is the module's own answer: every sharded layer
implements ``lowband_dense()`` (:mod:`lowband.parallel.dense`); no list of classes here.

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

from lowband.parallel.dense import DENSE_METHOD, is_sharded_module
from lowband.parallel.tensor import TPInputGather


def _plain(module: nn.Module) -> nn.Module | None:
    """The unsharded replacement of one sharded module (collective), or ``None`` if it is not one."""
    return getattr(module, DENSE_METHOD)() if is_sharded_module(module) else None


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
