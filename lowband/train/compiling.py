"""``run.compile``: compile the distributed model in place, per transformer block where it has blocks.

:func:`compile_model` runs after the strategy has wrapped and sharded the model (so GTP / TP layers,
DDP's hooks and sharded optimizers' gradient hooks are already in place). It compiles in place with
``nn.Module.compile()`` (parameter names, state dicts, checkpoints and exports keep their keys):

* blocks: the largest ``nn.ModuleList`` (by parameter count) whose entries are modules of one type
  (a GPT's ``transformer.h`` / ``blocks`` / ``layers``); each entry
  is compiled on its own, as torchtitan does (one compiled code object shared by every block);
* otherwise the whole model (inside ``DistributedDataParallel``: its ``module``, as torch recommends when
  DDP's own bucketing is kept eager).

lowband's collectives, the GTP layers and the TP collectives are opaque to dynamo (graph breaks that run
eagerly; docs/gtp.md), so every strategy compiles. No collective.
"""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the entries of its largest ``nn.ModuleList`` of one module type
    (by parameter count); ``[]`` if it has none."""
    best: list[nn.Module] = []
    best_params = 0
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        entries = list(mod)
        if len({type(m) for m in entries}) != 1:
            continue
        n = sum(p.numel() for m in entries for p in m.parameters())
        if n > best_params:
            best, best_params = entries, n
    return best


def compile_model(model: nn.Module, **compile_kwargs) -> str:
    """Compile ``model`` in place (see the module docstring); returns ``"blocks:<n>"`` or ``"whole"``."""
    inner = getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model
    blocks = find_blocks(inner)
    if blocks:
        for block in blocks:
            block.compile(**compile_kwargs)
        return f"blocks:{len(blocks)}"
    inner.compile(**compile_kwargs)
    return "whole"


__all__ = ["compile_model", "find_blocks"]
