"""A model factory for tests/cli/test_train_ft.py: lowband's GPT whose forward waits while any of the files
named by ``LOWBAND_TEST_HOLD`` (``os.pathsep``-separated) exists, so a test can hold a replica group between
steps while it stays in the run (torchft's heartbeats come from a Rust thread that keeps running)."""

from __future__ import annotations

import os
import time
from typing import Any

from torch import nn

from lowband.train.models import gpt_factory


def held_gpt(cfg: Any) -> nn.Module:
    model = gpt_factory(cfg)
    holds = [path for path in os.environ.get("LOWBAND_TEST_HOLD", "").split(os.pathsep) if path]

    def wait(_module: nn.Module, _args: Any) -> None:
        while any(os.path.exists(path) for path in holds):
            time.sleep(0.02)

    model.register_forward_pre_hook(wait)
    return model
