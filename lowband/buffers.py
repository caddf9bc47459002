"""Module buffers as ``state_dict()`` sees them (shared by the checkpoint layouts and the trainer's checkpoints)."""

from __future__ import annotations

import torch
from torch import nn


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s buffers that its ``state_dict()`` holds (torch's rule: ``persistent=False`` ones and ``None``
    are left out), by state-dict name, in module order (a buffer shared by two modules under each name)."""
    out = []
    for mod_name, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out
