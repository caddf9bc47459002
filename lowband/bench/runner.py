"""Per-rank entry point of ``python -m lowband.bench`` (importable, so spawned ranks can run it)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from lowband.bench import SUITES


def rank_main(suite: str, opts: dict[str, Any]) -> dict[str, Any] | None:
    import torch.distributed as dist

    from lowband.train.env import init_distributed

    torch.set_num_threads(opts.get("threads") or 1)
    env = init_distributed(opts.get("device", "cpu"))
    mod = importlib.import_module(SUITES[suite])
    body = mod.run(env, opts)
    doc = {"suite": suite, "world_size": env.world_size,
           "backend": dist.get_backend() if dist.is_initialized() else "none",
           "device": str(env.device) if env.device.type == "cpu" else torch.cuda.get_device_name(env.device),
           "torch": torch.__version__, **body}
    return doc if env.rank == 0 else None
