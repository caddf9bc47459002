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
``"tp:state"``); GTP x TP layers do both (GTP first).

Memory: the copy holds the full model, on the model's device by default. A model that fits its devices
only sharded can still be copied out: ``device="cpu"`` moves each layer to host memory right after its
gather (the device then holds one gathered layer at a time beside the live model, and the replicated
rest is copied straight to the host), and ``keep=False`` (the ranks that will not use the copy, e.g.
every rank but the one that writes it) takes part in every gather and keeps nothing (returns ``None``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from lowband.parallel.dense import DENSE_METHOD, is_sharded_module
from lowband.parallel.tensor import TPInputGather


def _plain(module: nn.Module) -> nn.Module | None:
    """The unsharded replacement of one sharded module (collective), or ``None`` if it is not one."""
    return getattr(module, DENSE_METHOD)() if is_sharded_module(module) else None


def _copy_onto(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of parameter or buffer ``t`` made directly on ``device`` (what ``copy.deepcopy`` would make there:
    a parameter of ``t``'s type with its ``requires_grad``; a buffer with its ``requires_grad``)."""
    data = t.detach().to(device=device, copy=True)
    if isinstance(t, nn.Parameter):
        return type(t)(data, t.requires_grad)
    return data.requires_grad_(t.requires_grad) if t.is_leaf else data


def holds_shards(model: nn.Module) -> bool:
    """True if ``model`` holds GTP or tensor-parallel layers (its weights are shards, so running or writing it
    whole needs :func:`unsharded_copy`); local, the same on every rank."""
    return any(is_sharded_module(m) or isinstance(m, TPInputGather) for m in model.modules())


def replicated_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model``'s parameters and buffers outside every sharded layer (registration order, tied
    ones once under their first name): what :func:`unsharded_copy` copies as they are (no communication)."""
    prefixes = [f"{n}." for n, m in model.named_modules() if is_sharded_module(m)]
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen and not any(name.startswith(p) for p in prefixes):
            seen.add(id(t))
            out.append((name, t))
    return out


@torch.no_grad()
def unsharded_copy(model: nn.Module, *, device: str | torch.device | None = None, keep: bool = True,
                   each_layer: Callable[[nn.Module], None] | None = None) -> nn.Module | None:
    """A plain deep copy of ``model`` with every GTP / TP layer replaced by its dense equivalent.

    Collective: every rank of the model's GTP and TP groups must call it (see the module docstring),
    with any ``device`` and ``keep``. A :class:`~lowband.parallel.tensor.TPInputGather` wrapper is
    dropped (the copy takes the whole batch itself). Tied parameters stay tied; parameters keep
    ``requires_grad``. The copy's weights are identical on every rank, so rank 0 may evaluate it alone.

    Args:
        model: the sharded (or plain) model; untouched.
        device: where the copy's tensors live; ``None`` (default): where the model's are. ``"cpu"`` bounds the
            accelerator's extra memory to one gathered layer (see the module docstring).
        keep: ``False`` takes part in the gathers, keeps nothing and returns ``None``.
        each_layer: called with each gathered dense layer, still on the model's device, before it moves to
            ``device`` (every rank, in ``named_modules()`` order; it may change the layer in place and issue
            collectives of its own, e.g. the trainer's export averages each layer over DiLoCo replicas).

    With ``device``, tensors a module keeps as plain attributes (neither parameter nor buffer) are deep-copied
    where they are, as ``nn.Module.to`` leaves them.
    """
    if isinstance(model, TPInputGather):
        model = model.module
    target = None if device is None else torch.device(device)
    memo: dict[int, object] = {}
    replaced: list[str] = []
    for name, module in model.named_modules():
        if id(module) in memo or any(name.startswith(f"{r}.") for r in replaced):
            continue  # already gathered, or inside a replaced layer (a GTP x TP layer's inner GTPLinear)
        plain = _plain(module)
        if plain is not None:
            replaced.append(name)
            if each_layer is not None:
                each_layer(plain)
            if target is not None:
                plain = plain.to(target)  # leaves the device before the next layer is gathered
            memo[id(module)] = plain if keep else None
            del plain
    if not keep:
        return None
    if id(model) in memo:
        return memo[id(model)]  # type: ignore[return-value]
    if target is not None:  # the replicated rest straight onto the target (deepcopy would copy it on the model's
        # device first); ties stay ties: one copy per tensor, found again through the memo
        for _, t in replicated_tensors(model):  # not the shards: the gathered layers replace them
            memo[id(t)] = _copy_onto(t, target)
    return copy.deepcopy(model, memo)
