"""Checkpoint, resume and reshard through the trainer (``single`` and ``ddp``; DCP on gloo ranks).

Resume is checked bit for bit against the uninterrupted run; resharding 4->2 and 2->4 checks that the
loaded state equals the saved state bit for bit and that training continues like a run at the new size
(float64, 1e-10: the first steps ran at the other size, whose all-reduce sums in another order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.testing import run_ranks
from lowband.train.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointManager,
    latest_checkpoint,
    list_checkpoints,
)
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import resume_error


def tiny_config(shard: str, world: int, strategy: str, batch: int, *, dtype: str = "float64", steps: int = 6,
                ckpt_dir: str = "", every: int = 0, accum: int = 1) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, dtype
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 2, 16
    cfg.data.source, cfg.data.train_bin = "bin", shard
    cfg.data.batch_size, cfg.data.grad_accum = batch, accum
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 2, 0.1, 0.5
    cfg.strategy.name = strategy
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _snapshot(res) -> dict:
    model = res.strategy.unwrapped()
    opt = res.strategy.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                optim[f"{names[id(p)]}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r},
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": optim, "lrs": [g["lr"] for g in opt.param_groups], "start": res.start_step,
            "rng": torch.get_rng_state()}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


class _SimulatedCrash(Exception):
    pass


def _run_crashing_at_commit(cfg: Config, crash_step: int) -> str:
    """Train, but 'die' after every rank wrote checkpoint ``crash_step`` and before its commit."""
    original = CheckpointManager._commit

    def crashing(self, step, tmp, meta):
        if step == crash_step:
            raise _SimulatedCrash(f"simulated crash before committing step {step}")
        return original(self, step, tmp, meta)

    CheckpointManager._commit = crashing
    try:
        train(cfg, write_run_dir=False, log=False)
    except _SimulatedCrash as e:
        return str(e)
    finally:
        CheckpointManager._commit = original
    return "no crash"


def assert_same_state(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for k in a["optim"]:
        assert torch.equal(torch.as_tensor(a["optim"][k]), torch.as_tensor(b["optim"][k])), k
    assert a["lrs"] == b["lrs"]


def assert_close_state(a: dict, b: dict, tol: float) -> None:
    for k in a["params"]:
        torch.testing.assert_close(a["params"][k], b["params"][k], rtol=tol, atol=tol)
    for k in a["optim"]:
        torch.testing.assert_close(torch.as_tensor(a["optim"][k]), torch.as_tensor(b["optim"][k]), rtol=tol,
                                   atol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, world: int, dtype: str) -> None:
    accum = 2 if dtype == "float32" else 1  # float32 runs also accumulate two microbatches (no_sync)
    full = run_ranks(_run, world, tiny_config(shard, world, "ddp", 2, dtype=dtype, accum=accum))
    cfg = tiny_config(shard, world, "ddp", 2, dtype=dtype, ckpt_dir=str(tmp_path), every=3, accum=accum)
    first = run_ranks(_run, world, cfg, stop_after=3)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]
    second = run_ranks(_run, world, cfg)  # resume = "latest" by default
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 6]
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 3
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact float equality
        assert sorted(second[r]["losses"]) == [4, 5, 6]
        assert_same_state(second[r], full[r])
        assert torch.equal(second[r]["rng"], full[r]["rng"])


def test_single_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path) -> None:
    full = run_ranks(_run, 1, tiny_config(shard, 1, "single", 4, dtype="float32"))[0]
    cfg = tiny_config(shard, 1, "single", 4, dtype="float32", ckpt_dir=str(tmp_path), every=2)
    first = run_ranks(_run, 1, cfg, stop_after=3)[0]  # saves at 2 and at the stop (3)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    second = run_ranks(_run, 1, cfg)[0]
    assert second["start"] == 3
    assert {**first["losses"], **second["losses"]} == full["losses"]
    assert_same_state(second, full)


def test_async_save_resumes_exactly_and_snapshots_at_save_time(shard: str, tmp_path: Path) -> None:
    """Async: step-2 is written in the background while steps 3-4 train; it must hold the step-2 state."""
    world = 2
    full = run_ranks(_run, world, tiny_config(shard, world, "ddp", 2, dtype="float32"))
    cfg = tiny_config(shard, world, "ddp", 2, dtype="float32", ckpt_dir=str(tmp_path), every=2)
    cfg.checkpoint.async_save, cfg.checkpoint.keep_last = True, 3
    run_ranks(_run, world, cfg, stop_after=4)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    cfg.checkpoint.resume = str(tmp_path / "step-2")
    cfg.checkpoint.overwrite = True  # step-4 is newer than the resumed step: replacing it must be asked for
    second = run_ranks(_run, world, cfg)
    for r in range(world):
        assert second[r]["start"] == 2
        assert sorted(second[r]["losses"]) == [3, 4, 5, 6]
        assert second[r]["losses"] == {k: v for k, v in full[r]["losses"].items() if k > 2}
        assert_same_state(second[r], full[r])


def _run_recording_async_commits(cfg: Config, ckpt_dir: str, step: int) -> list[tuple[int, bool]]:
    """Train with every rank's part of an async save finished by the next step (the background write is waited
    for where the trainer asks whether it is still running: timing taken out), recording at each step's guard
    check whether checkpoint ``step`` is committed."""
    from lowband.train.guards import NonFiniteGuard

    original_busy, original_check = CheckpointManager.save_in_flight, NonFiniteGuard.check
    seen: list[tuple[int, bool]] = []

    def finished_busy(self):  # type: ignore[no-untyped-def]
        if self._pending is not None:
            self._pending[0].result()
        return original_busy(self)

    def recording_check(self, s, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((s, (Path(ckpt_dir) / f"step-{step}" / MARKER).is_file()))
        return original_check(self, s, *args, **kwargs)

    CheckpointManager.save_in_flight, NonFiniteGuard.check = finished_busy, recording_check
    try:
        train(cfg, write_run_dir=False, log=False)
    finally:
        CheckpointManager.save_in_flight, NonFiniteGuard.check = original_busy, original_check
    return seen


def test_async_save_commits_at_the_first_step_after_every_rank_finished(shard: str, tmp_path: Path) -> None:
    """An async save is committed as soon as every rank's part is written (agreed in the guard's per-step flags),
    not at the next save: a crash in between kept only the older checkpoint although this one was on disk."""
    world = 2
    cfg = tiny_config(shard, world, "ddp", 2, dtype="float32", ckpt_dir=str(tmp_path), every=3)
    cfg.checkpoint.async_save = True
    seen = run_ranks(_run_recording_async_commits, world, cfg, str(tmp_path), 3)
    for r in range(world):
        # saved after step 3, finished during step 4's check, committed at the end of step 4
        assert seen[r] == [(1, False), (2, False), (3, False), (4, False), (5, True), (6, True)], seen[r]
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 6]


def test_pruning_deletes_only_what_the_marker_lists(shard: str, tmp_path: Path) -> None:
    """keep_last pruning removes a checkpoint's marker and the files it recorded, nothing else: a file the user put
    into the folder (eval results; another run's checkpoint saved inside it) stays, with the folder (shutil.rmtree
    deleted it)."""
    cfg = tiny_config(shard, 1, "single", 4, dtype="float32", ckpt_dir=str(tmp_path), every=2, steps=2)
    cfg.checkpoint.keep_last = 1
    run_ranks(_run, 1, cfg)
    mine = tmp_path / "step-2" / "eval.json"
    mine.write_text("{}")
    nested = tmp_path / "step-2" / "other-run" / "step-2"
    nested.mkdir(parents=True)
    (nested / MARKER).write_text("{}")
    cfg.run.steps = 4
    run_ranks(_run, 1, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [4]
    assert sorted(p.name for p in (tmp_path / "step-2").iterdir()) == ["eval.json", "other-run"]
    assert mine.read_text() == "{}" and (nested / MARKER).is_file()
    # a folder holding only what the marker lists is removed whole
    cfg.run.steps = 6
    run_ranks(_run, 1, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [6] and not (tmp_path / "step-4").exists()


@pytest.mark.parametrize(("saved_world", "new_world"), [(4, 2), (2, 4)])
def test_ddp_reshard_loads_and_continues(shard: str, tmp_path: Path, saved_world: int, new_world: int) -> None:
    global_batch = 8
    cfg_saved = tiny_config(shard, saved_world, "ddp", global_batch // saved_world, ckpt_dir=str(tmp_path), every=3)
    saved = run_ranks(_run, saved_world, cfg_saved, stop_after=3)
    cfg_new = tiny_config(shard, new_world, "ddp", global_batch // new_world, ckpt_dir=str(tmp_path), every=3)
    # 1) the state loaded at the new size equals the saved state bit for bit (stop right after loading)
    loaded = run_ranks(_run, new_world, cfg_new, stop_after=3)
    for r in range(new_world):
        assert loaded[r]["start"] == 3
        assert_same_state(loaded[r], saved[0])
    # 2) training continues like a run that was at the new size all along (float64)
    cont = run_ranks(_run, new_world, cfg_new)
    ref = run_ranks(_run, new_world, tiny_config(shard, new_world, "ddp", global_batch // new_world))
    for r in range(new_world):
        assert sorted(cont[r]["losses"]) == [4, 5, 6]
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (4, 5, 6)],
                                   [ref[r]["losses"][s] for s in (4, 5, 6)], rtol=1e-10)
        assert_close_state(cont[r], ref[r], 1e-10)
        assert_same_state(cont[r], cont[0])  # replicas stay identical


def test_single_process_checkpoint_continues_under_ddp(shard: str, tmp_path: Path) -> None:
    """``single`` and ``ddp`` share the replicated layout: a 1-process checkpoint resumes on 2 DDP ranks."""
    saved = run_ranks(_run, 1, tiny_config(shard, 1, "single", 4, ckpt_dir=str(tmp_path), every=3), stop_after=3)[0]
    ref = run_ranks(_run, 1, tiny_config(shard, 1, "single", 4))[0]
    cont = run_ranks(_run, 2, tiny_config(shard, 2, "ddp", 2, ckpt_dir=str(tmp_path), every=3))
    for r in range(2):
        assert cont[r]["start"] == 3
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (4, 5, 6)], [ref["losses"][s] for s in (4, 5, 6)],
                                   rtol=1e-10)
        assert_close_state(cont[r], ref, 1e-10)
    assert saved["losses"] == {k: v for k, v in ref["losses"].items() if k <= 3}


def test_killed_save_leaves_previous_checkpoint_loadable(shard: str, tmp_path: Path) -> None:
    world = 2
    full = run_ranks(_run, world, tiny_config(shard, world, "ddp", 2, steps=4))
    cfg = tiny_config(shard, world, "ddp", 2, steps=4, ckpt_dir=str(tmp_path), every=2)
    out = run_ranks(_run_crashing_at_commit, world, cfg, 4)
    assert out == ["simulated crash before committing step 4"] * world
    tmp = tmp_path / ".tmp-step-4"
    assert (tmp / ".metadata").is_file() and list(tmp.glob("*.distcp"))  # fully written ...
    assert not (tmp / MARKER).exists()  # ... but never committed
    assert latest_checkpoint(tmp_path).step == 2
    resumed = run_ranks(_run, world, cfg)
    for r in range(world):
        assert resumed[r]["start"] == 2
        assert resumed[r]["losses"] == {k: v for k, v in full[r]["losses"].items() if k > 2}
        assert_same_state(resumed[r], full[r])
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    assert not tmp.exists()  # the next commit removed the stale temporary folder


def test_keep_last_and_resume_none(shard: str, tmp_path: Path) -> None:
    cfg = tiny_config(shard, 1, "single", 4, steps=5, ckpt_dir=str(tmp_path), every=1)
    cfg.checkpoint.keep_last = 2
    run_ranks(_run, 1, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]
    meta = json.loads((tmp_path / "step-5" / MARKER).read_text())
    assert meta["step"] == 5 and meta["strategy"] == "single" and meta["world_size"] == 1
    assert set(meta["files"]) >= {".metadata", "__0_0.distcp"}
    cfg.checkpoint.resume = "none"  # a fresh run into a folder of another run's checkpoints: refused ...
    with pytest.raises(CheckpointError, match=r"holds checkpoints this run would not continue: step-4, step-5 "
                                              r"\(written by another run\)"):
        train(cfg, write_run_dir=False, log=False)
    cfg.checkpoint.overwrite = True  # ... unless asked to replace them
    assert run_ranks(_run, 1, cfg)[0]["start"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]
    assert json.loads((tmp_path / "step-5" / MARKER).read_text())["lineage"] != meta["lineage"]


def _error_cases(shard: str, root: str) -> dict[str, str]:
    root_p = Path(root)
    good = root_p / "good"
    train(tiny_config(shard, 1, "single", 4, steps=2, ckpt_dir=str(good), every=2), write_run_dir=False, log=False)
    src = good / "step-2"

    def variant(name: str) -> Path:
        dst = root_p / name / "step-2"
        shutil.copytree(src, dst)
        return dst

    def resume(path: Path, **changes) -> str:
        cfg = tiny_config(shard, 1, "single", changes.pop("batch", 4), steps=4, ckpt_dir=str(root_p / "unused"),
                          every=2, dtype=changes.pop("dtype", "float64"))
        for k, v in changes.items():
            setattr(cfg.model, k, v)
        cfg.checkpoint.resume = str(path)
        return resume_error(cfg)

    out = {}
    p = variant("truncated")
    data = p / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    out["truncated"] = resume(p)
    p = variant("flipped")
    raw = bytearray(data_bytes := (p / "__0_0.distcp").read_bytes())
    raw[len(data_bytes) // 2] ^= 0xFF
    (p / "__0_0.distcp").write_bytes(bytes(raw))
    out["flipped"] = resume(p)
    p = variant("no_metadata")
    (p / ".metadata").unlink()
    out["no_metadata"] = resume(p)
    p = variant("bad_marker")
    (p / MARKER).write_text("{not json")
    out["bad_marker"] = resume(p)
    p = variant("uncommitted")
    (p / MARKER).unlink()
    out["uncommitted"] = resume(p)
    # the marker does not know about .metadata and it is gone: the pre-load check names it
    p = variant("metadata_gone")
    meta = json.loads((p / MARKER).read_text())
    del meta["files"][".metadata"]
    (p / MARKER).write_text(json.dumps(meta))
    (p / ".metadata").unlink()
    out["metadata_gone"] = resume(p)
    # the marker does not know about the data file and it is truncated: DCP itself fails, wrapped
    p = variant("dcp_fails")
    meta = json.loads((p / MARKER).read_text())
    del meta["files"]["__0_0.distcp"]
    (p / MARKER).write_text(json.dumps(meta))
    (p / "__0_0.distcp").write_bytes(b"\0" * 10)
    out["dcp_fails"] = resume(p)
    p = variant("other_strategy")
    meta = json.loads((p / MARKER).read_text())
    meta["strategy"], meta["state_format"] = "gtp", "gtp-sharded"
    (p / MARKER).write_text(json.dumps(meta))
    out["other_strategy"] = resume(p)
    out["other_shape"] = resume(src, n_embd=64)
    out["other_layers"] = resume(src, n_layer=3)
    out["other_dtype"] = resume(src, dtype="float32")
    out["other_batch"] = resume(src, batch=2)
    out["missing"] = resume(root_p / "nowhere" / "step-9")
    return out


def test_corrupt_and_mismatched_checkpoints_give_clear_errors(shard: str, tmp_path: Path) -> None:
    out = run_ranks(_error_cases, 1, shard, str(tmp_path))[0]
    assert "is corrupt: file '__0_0.distcp' has 100 bytes, the marker recorded" in out["truncated"]
    assert "is corrupt: file '__0_0.distcp' does not match its recorded SHA-256" in out["flipped"]
    assert "is corrupt: file '.metadata' is missing" in out["no_metadata"]
    assert f"is corrupt: {MARKER} is not valid JSON" in out["bad_marker"]
    assert f"is not committed: {MARKER} is missing" in out["uncommitted"]
    assert "is corrupt: file '.metadata' (DCP's index of the saved tensors) cannot be read (FileNotFoundError" \
        in out["metadata_gone"]
    assert "could not be loaded" in out["dcp_fails"]
    assert ("does not match this run: strategy: checkpoint 'gtp' (state format 'gtp-sharded'), this run 'single' "
            "(state format 'replicated')") in out["other_strategy"]
    assert "model.n_embd: checkpoint 32, this run 64" in out["other_shape"]
    assert "model.n_layer: checkpoint 2, this run 3" in out["other_layers"]
    assert "run.dtype: checkpoint 'float64', this run 'float32'" in out["other_dtype"]
    assert "global batch (data.batch_size x world size): checkpoint 4, this run 2" in out["other_batch"]
    assert "does not exist" in out["missing"]
    for k, msg in out.items():
        assert msg != "no error", k
        assert "step-" in msg, k  # every message names the checkpoint


def _corrupt_at_world(cfg: Config, path: str) -> str:
    cfg.checkpoint.resume = path
    return resume_error(cfg)


def test_corrupt_checkpoint_fails_identically_on_every_rank(shard: str, tmp_path: Path) -> None:
    world = 2
    cfg = tiny_config(shard, world, "ddp", 2, steps=2, ckpt_dir=str(tmp_path), every=2)
    run_ranks(_run, world, cfg)
    data = sorted((tmp_path / "step-2").glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:-10])
    out = run_ranks(_corrupt_at_world, world, cfg, str(tmp_path / "step-2"))
    assert out[0] == out[1]
    assert f"is corrupt: file '{data.name}' has" in out[0]


# ---------------------------------------------------------------------------------------------------
# The path sharded strategies take: DTensor state through CheckpointManager, resharded on load.

def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(10, 3, generator=g, dtype=torch.float64),  # 10 rows: uneven over 4 ranks
            "m": torch.randn(7, generator=g, dtype=torch.float64)}


def _dtensor_state(zero: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _full_tensors()
    state = {k: distribute_tensor(torch.zeros_like(v) if zero else v, mesh, [Shard(0)]) for k, v in full.items()}
    state["step"] = torch.tensor(0.0 if zero else 5.0)  # replicated
    return state


def _dtensor_save(directory: str) -> None:
    from lowband.train.env import init_distributed

    manager = CheckpointManager(directory, init_distributed().metrics_comm, keep_last=1)
    manager.save(5, {"strategy": _dtensor_state(zero=False)}, {"world_size": 4})


def _dtensor_load(directory: str) -> dict:
    from lowband.train.env import init_distributed

    manager = CheckpointManager(directory, init_distributed().metrics_comm)
    info = manager.inspect(None)
    state = {"strategy": _dtensor_state(zero=True)}
    manager.load(info, state)
    s = state["strategy"]
    return {"step": info.step, "local_w": s["w"].to_local().clone(), "local_m": s["m"].to_local().clone(),
            "full_w": s["w"].full_tensor(), "full_m": s["m"].full_tensor(), "opt_step": float(s["step"])}


@pytest.mark.parametrize(("saved_world", "new_world"), [(4, 2), (2, 4)])
def test_dtensor_state_reshards_through_the_manager(tmp_path: Path, saved_world: int, new_world: int) -> None:
    run_ranks(_dtensor_save, saved_world, str(tmp_path))
    assert [c.step for c in list_checkpoints(tmp_path)] == [5]
    out = run_ranks(_dtensor_load, new_world, str(tmp_path))
    full = _full_tensors()
    for r, o in enumerate(out):
        assert o["step"] == 5 and o["opt_step"] == 5.0
        assert torch.equal(o["full_w"], full["w"]) and torch.equal(o["full_m"], full["m"])
        for key, local in (("w", o["local_w"]), ("m", o["local_m"])):
            rows = -(-full[key].shape[0] // new_world)  # torch's Shard(0): ceil-sized chunks
            assert torch.equal(local, full[key][r * rows:(r + 1) * rows]), (key, r)
