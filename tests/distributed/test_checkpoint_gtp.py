"""Checkpoint, exact resume, resharding (4->2) and the non-finite guard for strategy ``gtp``.

GTP saves its state gathered, in logical (unpadded) shapes under the ``single``/``ddp`` keys (format
``replicated``; see ``GTPStrategy.state_dict``); ``tests/distributed/test_gtp.py`` covers 2->4 and
GTP->DDP. Here: stop/resume bit for bit at GTP 2, GTP 4 and GTP 2 x DP 2 (vocabulary rows not a
multiple of the GTP size, so shards are tail-padded), 4->2 resharding, and a skipped non-finite step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import nan_loss_at

GLOBAL_BATCH = 4


def gtp_config(shard: str, world: int, *, steps: int = 4, ckpt_dir: str = "", every: int = 0,
               gtp_size: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 2, 8
    cfg.model.vocab_size = 258  # not a multiple of 4: padded shards
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, GLOBAL_BATCH // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 1, 0.1, 0.5
    cfg.strategy.name, cfg.gtp.size = "gtp", gtp_size
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _snapshot(res) -> dict:
    sd = res.strategy.state_dict()  # logical (gathered) tensors
    state = {f"{top}.{k}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
             for top, sub in sd.items() for k, v in sub.items()}
    local = {n: p.detach().clone() for n, p in res.strategy.model.named_parameters()}  # padded shards
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state, "local": local,
            "start": res.start_step, "skipped": list(res.skipped_steps)}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


def _run_nan(cfg: Config, nan_step: int, nan_rank: int) -> dict:
    with nan_loss_at(nan_step, nan_rank):
        return _run(cfg)


def assert_same(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k in skip:
            continue
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize(("world", "gtp_size"), [(1, 0), (2, 0), (4, 0), (4, 2)])
def test_gtp_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, world: int, gtp_size: int) -> None:
    full = run_ranks(_run, world, gtp_config(shard, world, gtp_size=gtp_size))
    cfg = gtp_config(shard, world, gtp_size=gtp_size, ckpt_dir=str(tmp_path), every=2)
    first = run_ranks(_run, world, cfg, stop_after=2)
    second = run_ranks(_run, world, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same(second[r]["state"], full[r]["state"])
        assert_same(second[r]["local"], full[r]["local"])  # padded shards too (padding rows stay zero)


def test_gtp_reshard_4_to_2_loads_and_continues(shard: str, tmp_path: Path) -> None:
    saved = run_ranks(_run, 4, gtp_config(shard, 4, ckpt_dir=str(tmp_path), every=2), stop_after=2)
    cfg_new = gtp_config(shard, 2, ckpt_dir=str(tmp_path), every=2)
    loaded = run_ranks(_run, 2, cfg_new, stop_after=2)
    for r in range(2):
        assert loaded[r]["start"] == 2
        assert_same(loaded[r]["state"], saved[0]["state"])
    cont = run_ranks(_run, 2, cfg_new)
    ref = run_ranks(_run, 2, gtp_config(shard, 2))
    for r in range(2):
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (3, 4)], [ref[r]["losses"][s] for s in (3, 4)],
                                   rtol=1e-10)
        for k, v in ref[r]["state"].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(cont[r]["state"][k], v, rtol=1e-10, atol=1e-10, msg=k)


def test_gtp_nonfinite_step_is_skipped_on_every_rank(shard: str) -> None:
    world = 4
    at2 = run_ranks(_run, world, gtp_config(shard, world, steps=3, gtp_size=2), stop_after=2)
    out = run_ranks(_run_nan, world, gtp_config(shard, world, steps=3, gtp_size=2), 3, 3)
    for r in range(world):
        assert out[r]["skipped"] == [3]
        lr_keys = tuple(k for k in at2[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr"))
        assert lr_keys
        assert_same(out[r]["state"], at2[r]["state"], skip=lr_keys)
        assert_same(out[r]["local"], at2[r]["local"])
