"""Module buffers as ``state_dict()`` sees them (shared by the checkpoint layouts and the trainer's checkpoints)."""

from __future__ import annotations

from collections.abc import Iterable

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


def drop_unsaved(model_state: dict, names: Iterable[str], saved_keys: set[str]) -> list[str]:
    """Fit a load template's ``"model"`` dict to a checkpoint written without some of ``names`` (buffers, before
    a layout saved them): drop each name whose ``model.<name>`` is not among ``saved_keys`` (the checkpoint's
    flattened DCP keys relative to the layout's state), so ``dcp.load`` does not stop at a missing key; the
    layout's ``load_state_dict`` then leaves those tensors as they are. Returns the dropped names."""
    dropped = [n for n in names if n in model_state and f"model.{n}" not in saved_keys]
    for n in dropped:
        del model_state[n]
    return dropped
