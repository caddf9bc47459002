"""Checkpoint, exact resume and the non-finite guard for strategy ``diloco``.

Schedule: H = 4, 2 fragments, delay 1, so a fragment is prepared after every odd step and synced after
every even one; a checkpoint after an odd step holds an in-flight fragment. States are compared as the
checkpoint holds them (``Strategy.state_dict()`` with the per-replica DTensors gathered to ``(R, ...)``).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.optim.tp_state import full_state
from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import nan_loss_at, resume_error

GLOBAL_BATCH = 4


def diloco_config(shard: str, world: int, *, replicas: int = 0, steps: int = 6, ckpt_dir: str = "",
                  every: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 2, 8
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, GLOBAL_BATCH // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 1, 0.1, 0.5
    cfg.strategy.name = "diloco"
    cfg.diloco.num_replicas, cfg.diloco.sync_every, cfg.diloco.fragments, cfg.diloco.delay = replicas, 4, 2, 1
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def gather_chunks(state: dict) -> dict:
    """``{key: value}`` with every :class:`~lowband.dcp_chunks.LocalChunks` made whole from every rank's pieces
    (one ``all_gather_object``; test inspection only, not what a checkpoint does), each element covered."""
    import torch.distributed as dist

    from lowband.dcp_chunks import LocalChunks

    mine = {k: [(o, t.detach().cpu().clone()) for o, t in v.pieces] for k, v in state.items()
            if isinstance(v, LocalChunks)}
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    out = dict(state)
    for k in mine:
        v = state[k]
        full = torch.zeros(tuple(v.shape), dtype=v.dtype)
        seen = torch.zeros(tuple(v.shape), dtype=torch.bool)
        for pieces in everyone:
            for o, t in pieces[k]:
                box = tuple(slice(a, a + n) for a, n in zip(o, t.shape, strict=True))
                full[box], seen[box] = t, True
        assert bool(seen.all()), f"{k}: the ranks' pieces do not cover the tensor"
        out[k] = full
    return out


def _snapshot(res) -> dict:
    def conv(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, bytes):
            return pickle.loads(v) if v else None
        return v

    state = {k: conv(v) for k, v in gather_chunks(full_state(res.strategy.state_dict())).items()}
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state,
            "start": res.start_step, "skipped": list(res.skipped_steps)}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


def _run_nan(cfg: Config, nan_step: int, nan_rank: int) -> dict:
    with nan_loss_at(nan_step, nan_rank):
        return _run(cfg)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def assert_same_state(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k not in skip:
            assert _equal(a[k], b[k]), k


@pytest.mark.parametrize(("world", "replicas", "stop"), [(1, 0, 3), (2, 0, 3), (2, 0, 2), (4, 2, 3)])
def test_diloco_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, world: int, replicas: int,
                                                 stop: int) -> None:
    """stop 3: a fragment is in flight at the checkpoint; stop 2: right after a sync. World 4: 2 replicas
    of DDP 2."""
    full = run_ranks(_run, world, diloco_config(shard, world, replicas=replicas))
    cfg = diloco_config(shard, world, replicas=replicas, ckpt_dir=str(tmp_path), every=stop)
    first = run_ranks(_run, world, cfg, stop_after=stop)
    assert [c.step for c in list_checkpoints(tmp_path)] == [stop]
    assert (first[0]["state"]["diloco.inflight"] is not None) == (stop == 3)
    second = run_ranks(_run, world, cfg)
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == stop
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same_state(second[r]["state"], full[r]["state"])
    st = full[0]["state"]
    assert st["diloco.counters"] == {"committed": 3, "local_step": 0}
    n_rep = replicas or world
    assert st["model.tok_emb.weight"].shape[0] == n_rep and st["diloco.global.tok_emb.weight"].dim() == 2


def test_diloco_nonfinite_step_is_skipped_on_every_rank(shard: str) -> None:
    """NaN loss on rank 1 at step 4, while fragment 1 is in flight: every rank keeps the step-3 state."""
    world = 2
    at3 = run_ranks(_run, world, diloco_config(shard, world, steps=4), stop_after=3)
    out = run_ranks(_run_nan, world, diloco_config(shard, world, steps=4), 4, 1)
    for r in range(world):
        assert out[r]["skipped"] == [4]
        lr_keys = tuple(k for k in at3[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr"))
        assert lr_keys
        assert_same_state(out[r]["state"], at3[r]["state"], skip=lr_keys)


def test_diloco_resumes_with_another_ddp_size_per_replica(shard: str, tmp_path: Path) -> None:
    """2 replicas x DDP 1 (2 ranks) -> 2 replicas x DDP 2 (4 ranks), in flight at the checkpoint: the state
    loads bit for bit and training continues like the 4-rank run (1e-10; DDP averages two half batches)."""
    saved = run_ranks(_run, 2, diloco_config(shard, 2, replicas=2, ckpt_dir=str(tmp_path), every=3), stop_after=3)
    cfg = diloco_config(shard, 4, replicas=2, ckpt_dir=str(tmp_path), every=3)
    loaded = run_ranks(_run, 4, cfg, stop_after=3)
    for r in range(4):
        assert loaded[r]["start"] == 3
        assert_same_state(loaded[r]["state"], saved[0]["state"])
    cont = run_ranks(_run, 4, cfg)
    ref = run_ranks(_run, 4, diloco_config(shard, 4, replicas=2))
    for r in range(4):
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (4, 5, 6)], [ref[r]["losses"][s] for s in (4, 5, 6)],
                                   rtol=1e-10)
        for k, v in ref[r]["state"].items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                torch.testing.assert_close(cont[r]["state"][k], v, rtol=1e-10, atol=1e-10, msg=k)


def test_diloco_other_replica_count_is_refused(shard: str, tmp_path: Path) -> None:
    run_ranks(_run, 2, diloco_config(shard, 2, steps=2, ckpt_dir=str(tmp_path), every=2))
    out = run_ranks(resume_error, 4, diloco_config(shard, 4, steps=4, ckpt_dir=str(tmp_path), every=2))
    assert out[0] == out[1]
    assert ("strategy: checkpoint 'diloco' (state format 'diloco-r2-v1'), this run 'diloco' (state format "
            "'diloco-r4-v1')") in out[0]


def test_diloco_other_fragment_schedule_is_refused_by_name(shard: str, tmp_path: Path) -> None:
    """A checkpoint holds its position inside a fragment period: resuming under another sync_every or
    fragments is refused before loading, naming the keys (it once failed at the first step with an
    unexpected ValueError about the local step, or trained on from a position that meant something else)."""
    run_ranks(_run, 2, diloco_config(shard, 2, steps=2, ckpt_dir=str(tmp_path), every=2))
    cfg = diloco_config(shard, 2, steps=4, ckpt_dir=str(tmp_path), every=2)
    cfg.diloco.sync_every, cfg.diloco.fragments, cfg.diloco.delay = 2, 1, 0
    out = run_ranks(resume_error, 2, cfg)
    assert out[0] == out[1]
    assert ("does not match this run: diloco.sync_every: checkpoint 4, this run 2; diloco.fragments: checkpoint 2, "
            "this run 1; diloco.delay: checkpoint 1, this run 0") in out[0], out[0]


def test_diloco_error_feedback_change_is_refused_by_name(shard: str, tmp_path: Path) -> None:
    """Residuals exist only with error feedback in effect (auto: on for int4/int2/topk*): resuming an int4
    checkpoint under fp32 dropped the residuals' unsent mass silently, the other way failed with DCP's 'Missing
    key'. Refused before loading, naming the setting."""
    cfg = diloco_config(shard, 2, steps=2, ckpt_dir=str(tmp_path), every=2)
    cfg.diloco.wire = "int4"
    run_ranks(_run, 2, cfg)
    cfg.run.steps, cfg.diloco.wire = 4, "fp32"
    out = run_ranks(resume_error, 2, cfg)
    assert out[0] == out[1]
    assert ("does not match this run: diloco.error_feedback (in effect, auto follows diloco.wire): checkpoint 'on', "
            "this run 'off'") in out[0], out[0]


@pytest.mark.parametrize("before, after", [(0.9, 0.0), (0.0, 0.9)])
def test_diloco_outer_momentum_on_off_is_refused_by_name(shard: str, tmp_path: Path, before: float,
                                                         after: float) -> None:
    """The outer SGD's momentum buffers are saved only with momentum on: resuming a 0.9 checkpoint at 0 dropped
    them silently, 0 -> 0.9 failed with DCP's 'Missing key ... momentum_buffer'. Refused before loading, by name."""
    cfg = diloco_config(shard, 2, steps=2, ckpt_dir=str(tmp_path), every=2)
    cfg.diloco.outer_momentum = before
    run_ranks(_run, 2, cfg)
    cfg.run.steps, cfg.diloco.outer_momentum = 4, after
    out = run_ranks(resume_error, 2, cfg)
    assert out[0] == out[1]
    on, off = ("'on'", "'off'") if before else ("'off'", "'on'")
    assert f"does not match this run: diloco.outer_momentum (in effect): checkpoint {on}, this run {off}" in out[0], \
        out[0]


def _run_stdout(cfg: Config) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _run(cfg)
    return out.getvalue()


def test_diloco_outer_hyperparameter_changes_are_announced(shard: str, tmp_path: Path) -> None:
    """The checkpoint holds the outer momentum buffers, not the outer SGD's lr, momentum or Nesterov flag: a resume
    trains with its own config's (as for the inner optimizer's lr) and rank 0 now says so, naming both values."""
    cfg = diloco_config(shard, 2, steps=2, ckpt_dir=str(tmp_path), every=2)
    run_ranks(_run, 2, cfg)
    cfg.run.steps, cfg.diloco.outer_lr, cfg.diloco.outer_nesterov = 4, 0.5, False
    out = run_ranks(_run_stdout, 2, cfg)
    notice = [ln for ln in out[0].splitlines() if ln.startswith("lowband.train: resumed with this run's settings")]
    assert notice == ["lowband.train: resumed with this run's settings, not the checkpoint's: diloco.outer_lr 0.7 -> "
                      "0.5; diloco.outer_nesterov True -> False"], out[0]
    assert "resumed with this run's settings" not in out[1]  # rank 0 alone
