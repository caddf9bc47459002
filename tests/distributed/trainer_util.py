"""Helpers for tests that run the trainer inside `run_ranks` workers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

import lowband.train.trainer as trainer_mod
from lowband.train.checkpoint import CheckpointError


@contextlib.contextmanager
def nan_loss_at(nan_step: int, nan_rank: int) -> Iterator[None]:
    """While active, models the trainer builds output NaN on ``nan_rank`` at forward call ``nan_step``
    (1-based; one forward per step without accumulation)."""
    original = trainer_mod.build_model
    rank = dist.get_rank()

    def build(cfg, device):
        model = original(cfg, device)
        calls = {"n": 0}

        def hook(module, args, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] == nan_step and rank == nan_rank else output

        model.register_forward_hook(hook)
        return model

    trainer_mod.build_model = build
    try:
        yield
    finally:
        trainer_mod.build_model = original


def resume_error(cfg) -> str:  # type: ignore[no-untyped-def]
    """Run the trainer (no run directory, no log) and return the :class:`CheckpointError` it raises at resume,
    or ``"no error"``: for tests of refused resumes, run on every rank with ``run_ranks``."""
    try:
        trainer_mod.train(cfg, write_run_dir=False, log=False)
    except CheckpointError as e:
        return str(e)
    return "no error"
