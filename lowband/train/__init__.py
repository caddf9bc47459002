"""The lowband trainer: config, strategies, the training loop and the CLI (``python -m lowband.train``).

``train`` and ``TrainResult`` load lazily, so the launcher process and config errors do not pay for
importing the training loop (torch DCP, checkpoints, data) before they need it. The config does import the
strategy modules, which define the strategies' own config sections (and validate them in any case).
"""

from typing import TYPE_CHECKING

from lowband.train.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from lowband.train.trainer import TrainResult, train

__all__ = ["Config", "ConfigError", "TrainResult", "load_config", "train"]


def __getattr__(name: str) -> object:
    if name in ("train", "TrainResult"):
        from lowband.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'lowband.train' has no attribute {name!r}")
