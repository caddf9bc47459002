"""The strategy interface: how a model is distributed and optimized.

A strategy receives the freshly built (identical on every rank) model and returns, via ``setup``,
the module to call in forward (``self.model``) and a ``torch.optim.Optimizer`` (``self.optimizer``)
whose ``param_groups`` the trainer's LR schedule scales. The trainer loop is::

    for micro in range(accum):
        with strategy.microbatch(last=micro == accum - 1):
            (strategy.model(x, y) / accum).backward()
    grad_norm = strategy.clip_grad_norm(max_norm)
    strategy.optimizer_step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from lowband.train.config import Config
    from lowband.train.env import DistEnv


class Strategy:
    """Base class; subclasses register with :func:`lowband.train.strategies.register_strategy`."""

    name: ClassVar[str] = "base"
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None

    def __init__(self, cfg: Config, env: DistEnv) -> None:
        self.cfg = cfg
        self.env = env
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer

    @classmethod
    def validate_config(cls, cfg: Config, world_size: int) -> None:
        """Raise ``ConfigError`` if this strategy cannot run ``cfg`` on ``world_size`` ranks."""
        from lowband.train.config import ConfigError

        if world_size < cls.min_world_size or (cls.max_world_size is not None
                                                and world_size > cls.max_world_size):
            hi = "any" if cls.max_world_size is None else str(cls.max_world_size)
            raise ConfigError(f"strategy.name = {cls.name!r} needs between {cls.min_world_size} and {hi} "
                              f"ranks; run.world_size is {world_size}")

    def setup(self, model: nn.Module) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        """Context for one microbatch's forward+backward; ``last`` is False while accumulating."""
        yield

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm (clipped to ``max_norm`` if > 0); grads are already synchronized."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        total = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def log_extras(self) -> dict[str, Any]:
        """Extra per-step metrics for the log line and metrics.jsonl."""
        return {}

    def unwrapped(self) -> nn.Module:
        """The plain model (for evaluation and checkpoints)."""
        return getattr(self.model, "module", self.model)
