"""``single``: one process, torch AdamW, no communication (the reference every strategy must match)."""

from __future__ import annotations

from torch import nn

from lowband.train.optimizers import torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy


@register_strategy("single")
class SingleStrategy(Strategy):
    config_sections = ()
    max_world_size = 1

    def setup(self, model: nn.Module) -> None:
        self.model = model
        o = self.cfg.optim
        self.optimizer = torch_adamw(model, o)
