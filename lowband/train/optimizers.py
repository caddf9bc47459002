"""Parameter grouping and the torch AdamW that strategies share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lowband.train.config import OptimConfig


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (>= 2-D) with ``weight_decay``, and 1-D params / embeddings' peers
    without. Only trainable parameters; order follows ``model.named_parameters()``."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def torch_adamw(model: nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` (foreach) over :func:`adamw_param_groups` with the ``[optim]`` settings."""
    return torch.optim.AdamW(adamw_param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                             eps=o.eps, foreach=True)
