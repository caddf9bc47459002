"""Checkpoint, exact resume, resharding and the non-finite guard for ``sharded-adamw`` / ``sharded-muon``.

States are compared as the checkpoint holds them (``Strategy.state_dict()`` with the ``Shard(0)``
DTensors gathered: full parameters, per-parameter moments / momentum, hyperparameters), so states at
different world sizes are comparable. Float64 with Muon's Newton-Schulz in float64, so that a run at
another world size (another reduce-scatter summation order) agrees to 1e-10.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.checkpoint_tp import full_state
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import nan_loss_at

GLOBAL_BATCH = 4


def sharded_config(shard: str, world: int, strategy: str, *, steps: int = 4, ckpt_dir: str = "",
                   every: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 2, 8
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, GLOBAL_BATCH // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 1, 0.1, 0.5
    cfg.optim.muon_ns_dtype = "float64"
    cfg.strategy.name, cfg.strategy.bucket_mb = strategy, 0.002  # several buckets, boundaries inside params
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _snapshot(res) -> dict:
    state = full_state(res.strategy.state_dict(),
                       lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v)
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state,
            "start": res.start_step, "skipped": list(res.skipped_steps)}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


def _run_nan(cfg: Config, nan_step: int, nan_rank: int) -> dict:
    """Train with the loss made NaN on ``nan_rank`` at training step ``nan_step`` (1-based)."""
    with nan_loss_at(nan_step, nan_rank):
        return _run(cfg)


def assert_same_state(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k in skip:
            continue
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize(("strategy", "world", "sparse"), [("sharded-adamw", 1, ()), ("sharded-adamw", 2, ()),
                                                           ("sharded-adamw", 4, ()), ("sharded-muon", 2, ()),
                                                           ("sharded-muon", 4, ()), ("sharded-adamw", 2, ("tok_emb",))])
def test_sharded_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, strategy: str, world: int,
                                                  sparse: tuple[str, ...]) -> None:
    """The last case sends the token embedding's gradient row-sparse (its AdamW state is an ordinary unit)."""
    base = sharded_config(shard, world, strategy)
    base.sparse.tables = list(sparse)
    full = run_ranks(_run, world, base)
    cfg = sharded_config(shard, world, strategy, ckpt_dir=str(tmp_path), every=2)
    cfg.sparse.tables = list(sparse)
    first = run_ranks(_run, world, cfg, stop_after=2)
    second = run_ranks(_run, world, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same_state(second[r]["state"], full[r]["state"])
    keys = set(full[0]["state"])
    if strategy == "sharded-adamw":
        assert {"optim.state.tok_emb.weight.exp_avg", "optim.state.blocks.0.mlp.fc.weight.step"} <= keys
    else:
        assert {"optim.state.blocks.0.mlp.fc.weight.momentum_buffer", "optim.state.tok_emb.weight.exp_avg"} <= keys


@pytest.mark.parametrize(("strategy", "saved_world", "new_world"),
                         [("sharded-adamw", 4, 2), ("sharded-adamw", 2, 4), ("sharded-muon", 4, 2),
                          ("sharded-muon", 2, 4)])
def test_sharded_reshard_loads_and_continues(shard: str, tmp_path: Path, strategy: str, saved_world: int,
                                             new_world: int) -> None:
    saved = run_ranks(_run, saved_world, sharded_config(shard, saved_world, strategy, ckpt_dir=str(tmp_path),
                                                        every=2), stop_after=2)
    cfg_new = sharded_config(shard, new_world, strategy, ckpt_dir=str(tmp_path), every=2)
    loaded = run_ranks(_run, new_world, cfg_new, stop_after=2)  # loads, takes no step
    for r in range(new_world):
        assert loaded[r]["start"] == 2
        assert_same_state(loaded[r]["state"], saved[0]["state"])  # every byte of the moments re-split
    cont = run_ranks(_run, new_world, cfg_new)
    ref = run_ranks(_run, new_world, sharded_config(shard, new_world, strategy))
    for r in range(new_world):
        assert sorted(cont[r]["losses"]) == [3, 4]
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (3, 4)], [ref[r]["losses"][s] for s in (3, 4)],
                                   rtol=1e-10)
        for k, v in ref[r]["state"].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(cont[r]["state"][k], v, rtol=1e-10, atol=1e-10, msg=k)
            else:
                assert cont[r]["state"][k] == v, k


@pytest.mark.parametrize("strategy", ["sharded-adamw", "sharded-muon"])
def test_sharded_nonfinite_step_is_skipped_on_every_rank(shard: str, strategy: str) -> None:
    """A NaN loss on rank 2 at step 3 of 3: every rank keeps the step-2 state bit for bit."""
    world = 4
    at2 = run_ranks(_run, world, sharded_config(shard, world, strategy, steps=3), stop_after=2)
    out = run_ranks(_run_nan, world, sharded_config(shard, world, strategy, steps=3), 3, 2)
    for r in range(world):
        assert out[r]["skipped"] == [3]
        lr_keys = tuple(k for k in at2[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr"))
        assert lr_keys  # the LR schedule advances over a skipped step; nothing else changes
        assert_same_state(out[r]["state"], at2[r]["state"], skip=lr_keys)


@pytest.mark.parametrize(("strategy", "dtype"), [("sharded-adamw", "float32"), ("sharded-muon", "float32"),
                                               ("sharded-adamw", "bfloat16")])
def test_sharded_fp32_masters_resume_bitwise(shard: str, tmp_path: Path, strategy: str, dtype: str) -> None:
    """bf16 parameter all-gathers (float32 params) or bf16 params: the owners' fp32 masters are saved too."""
    world = 2

    def config(**kw) -> Config:
        cfg = sharded_config(shard, world, strategy, **kw)
        cfg.run.dtype, cfg.sharded.param_wire_dtype = dtype, "bfloat16"
        cfg.optim.muon_ns_dtype = "float32"
        return cfg

    full = run_ranks(_run, world, config())
    first = run_ranks(_run, world, config(ckpt_dir=str(tmp_path), every=2), stop_after=2)
    second = run_ranks(_run, world, config(ckpt_dir=str(tmp_path), every=2))
    for r in range(world):
        assert second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]
        assert_same_state(second[r]["state"], full[r]["state"])
    assert any(k.endswith(".master") for k in full[0]["state"])
