"""The lowband trainer: config, strategies, the training loop and the CLI (``python -m lowband.train``)."""

from lowband.train.config import Config, ConfigError, load_config
from lowband.train.trainer import TrainResult, train

__all__ = ["Config", "ConfigError", "TrainResult", "load_config", "train"]
