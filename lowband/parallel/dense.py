"""Plain dense modules from gathered weights: what each sharded layer's ``lowband_dense()`` returns.

Every sharded module of :mod:`lowband.parallel` (GTP, TP and GTP x TP layers) implements
``lowband_dense() -> nn.Module``: a collective over its groups that returns the ordinary ``nn.Linear`` /
``nn.Embedding`` it stands for, with the whole logical weights (the same on every rank).
:func:`lowband.parallel.unsharded_copy` and the trainer's export ask that method instead of keeping a list
of layer classes. This module holds the pieces they share: the TP all-gather of a slice and the
construction of the plain module. Communication: :func:`gather_tp` only (one all-gather, tag ``"tp:state"``).
"""

from __future__ import annotations

import torch
from torch import nn

from lowband.comm import Comm

DENSE_METHOD = "lowband_dense"
"""The method a sharded module implements (see the module docstring)."""


def gather_tp(comm: Comm, local: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather ``local`` over ``comm`` and concatenate along ``dim`` in rank order (collective)."""
    x = local.detach().contiguous()
    if comm.size == 1:
        return x.clone()
    buf = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(buf, x, tag="tp:state")
    return torch.cat(list(buf.unbind(0)), dim=dim)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Parameter) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` / ``bias`` (copies), ``requires_grad`` as ``like``'s."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                    device=weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.weight.requires_grad_(like.requires_grad)
    return lin


def dense_embedding(weight: torch.Tensor, like: nn.Parameter) -> nn.Embedding:
    """An ``nn.Embedding`` holding ``weight`` (a copy), ``requires_grad`` as ``like``'s."""
    emb = nn.Embedding(weight.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        emb.weight.copy_(weight)
    emb.weight.requires_grad_(like.requires_grad)
    return emb


def is_sharded_module(module: nn.Module) -> bool:
    """True if ``module`` is a sharded layer (implements ``lowband_dense``)."""
    return callable(getattr(type(module), DENSE_METHOD, None))
