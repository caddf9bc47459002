"""The trainer end to end: DDP on 2 ranks equals single-process training on the concatenated batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.config import Config
from lowband.train.trainer import train


def tiny_config(shard: str, world: int, strategy: str, batch: int, accum: int = 1) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, 4, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every = 0, 1, 1
    cfg.run.threads = 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 2, 16
    cfg.data.source, cfg.data.train_bin = "bin", shard
    cfg.data.batch_size, cfg.data.grad_accum = batch, accum
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = 1e-2, 2, 0.1
    cfg.optim.grad_clip = 0.5
    cfg.strategy.name = strategy
    return cfg


def _train_and_return_params(cfg: Config) -> dict[str, torch.Tensor]:
    res = train(cfg, write_run_dir=False, log=False)
    losses = [r["loss"] for r in res.rows if "loss" in r]
    sd = {k: v.detach().clone() for k, v in res.strategy.unwrapped().state_dict().items()}
    return {"params": sd, "losses": losses, "wire": [r["wire_bytes"] for r in res.rows if "loss" in r]}


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_equals_single_process_on_concatenated_batch(shard: str, world: int) -> None:
    ref = run_ranks(_train_and_return_params, 1, tiny_config(shard, 1, "single", 2 * world, accum=2))[0]
    out = run_ranks(_train_and_return_params, world, tiny_config(shard, world, "ddp", 2, accum=2))
    nparams = sum(v.numel() for v in ref["params"].values())
    for rank_out in out:
        for k, v in ref["params"].items():
            torch.testing.assert_close(rank_out["params"][k], v, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rank_out["losses"], ref["losses"], rtol=1e-10)
        # one bucketed all-reduce of every gradient per step: 2(N-1)/N of the float64 gradient bytes
        assert rank_out["wire"] == [2 * (world - 1) * nparams * 8 // world] * 4


def test_single_run_writes_run_directory(shard: str, tmp_path: Path) -> None:
    cfg = tiny_config(shard, 1, "single", 2)
    cfg.run.out_dir, cfg.run.name, cfg.run.dtype = str(tmp_path), "r", "float32"
    res = run_ranks(_train_in_dir, 1, cfg)[0]
    run_dir = tmp_path / "r"
    assert res == str(run_dir)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 5  # 4 train rows + final validation
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert "[model]" in (run_dir / "config.toml").read_text()


def _train_in_dir(cfg: Config) -> str:
    return str(train(cfg, log=False).run_dir)


@pytest.mark.parametrize("world", [2])
def test_ddp_bf16_wire_hook_runs_and_counts_bf16_bytes(shard: str, world: int) -> None:
    cfg = tiny_config(shard, world, "ddp", 2)
    cfg.run.dtype, cfg.run.steps = "float32", 2
    cfg.strategy.grad_wire_dtype = "bfloat16"
    out = run_ranks(_train_and_return_params, world, cfg, timeout=120)
    ref = run_ranks(_train_and_return_params, 1, tiny_config(shard, 1, "single", 2 * world))[0]
    nparams = sum(v.numel() for v in ref["params"].values())
    for rank_out in out:
        # bf16 all-reduce as RS + AG: 2(N-1)/N of the bf16 bucket bytes (the bucket is padded to N)
        assert all(abs(w - nparams * 2) <= 2 * world for w in rank_out["wire"])
    for k in ref["params"]:
        assert torch.equal(out[0]["params"][k], out[1]["params"][k])  # replicas stay identical


def _val(cfg: Config) -> float:
    return train(cfg, write_run_dir=False, log=False).final_val_loss


def test_validation_set_does_not_depend_on_grad_accum_or_world_size(shard: str) -> None:
    """run.val_batches batches of data.batch_size sequences: the same validation windows with grad_accum 1, 2, 4 and
    at 2 ranks with the same global batch (it evaluated val_batches microbatches, a set that shrank with
    grad_accum). float64; the runs train the same parameters to ~1e-16, so the losses agree to ~1e-14."""
    vals = [run_ranks(_val, 1, tiny_config(shard, 1, "single", 4, accum=a))[0] for a in (1, 2, 4)]
    vals.append(run_ranks(_val, 2, tiny_config(shard, 2, "ddp", 2, accum=2))[0])
    np.testing.assert_allclose(vals, [vals[0]] * 4, rtol=1e-12)
