"""Parameter grouping shared by strategies."""

from __future__ import annotations

from torch import nn


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
