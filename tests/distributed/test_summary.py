"""Honest per-step figures, the end-of-run summary, TensorBoard and a warning-free run (issue 14).

Every figure is recomputed from the training ledger's records: the worker notes where each
``ledger.mark_step()`` cut the record list, so the test sums each step's wire bytes itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lowband.comm import default_ledger, ring_wire_bytes
from lowband.testing import run_ranks
from lowband.train.config import Config, ConfigError
from lowband.train.summary import format_summary
from lowband.train.trainer import train

# float64 runs: an interval mean averages over steps then ranks, the log_every = 1 reference over ranks then
# steps; a handful (<= 10) of float64 additions in another order differ by a few ulps (eps 2.2e-16).
RTOL64 = 1e-13


def tiny_config(shard: str, world: int, strategy: str, *, steps: int, log_every: int, dtype: str = "float64",
                batch: int = 2) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype, cfg.run.log_every = world, steps, dtype, log_every
    cfg.run.val_every, cfg.run.val_batches, cfg.run.threads = 0, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 2, 8
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, batch
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.grad_clip = 1e-2, 1, 0.5
    cfg.strategy.name = strategy
    return cfg


def _recorded_run(cfg: Config, *, write_run_dir: bool = False, stop_after: int | None = None) -> dict[str, Any]:
    """Train, noting the ledger's step boundaries; return the rows, each step's wire bytes from the records,
    the summary, the reference bytes per step and this rank's peak memory afterwards."""
    from lowband.train.metrics import peak_memory_bytes

    ledger = default_ledger()
    bounds: list[int] = []
    original = ledger.mark_step

    def mark_step():
        totals = original()
        bounds.append(len(ledger.records))
        return totals

    ledger.mark_step = mark_step
    try:
        res = train(cfg, write_run_dir=write_run_dir, log=False, stop_after=stop_after)
    finally:
        del ledger.mark_step
    per_step = [sum(r.wire_bytes for r in ledger.records[a:b]) for a, b in itertools.pairwise(bounds)]
    digest = hashlib.sha256()
    for g in (t for ts in getattr(getattr(res.strategy, "diloco", None), "globals", []) for t in ts):
        digest.update(g.contiguous().view(torch.uint8).numpy().tobytes())
    nparams = sum(math.prod(s) for s, _ in res.strategy.param_shapes().values())
    return {"rows": [r for r in res.rows if "loss" in r], "val_rows": [r for r in res.rows if "val_loss" in r],
            "per_step": per_step, "summary": res.summary, "start": res.start_step, "final_loss": res.final_loss,
            "final_val_loss": res.final_val_loss, "model_path": None if res.model_path is None else str(res.model_path),
            "ref_per_step": ring_wire_bytes("all_reduce", cfg.run.world_size, 4 * nparams),
            "peak_after": peak_memory_bytes(torch.device("cpu")), "globals_sha256": digest.hexdigest()}


def _interval_of(rows: list[dict[str, Any]], i: int, first_step: int = 1) -> range:
    """The 1-based steps row ``i`` covers: from after the previous row up to its own step."""
    lo = rows[i - 1]["step"] + 1 if i else first_step
    return range(lo, rows[i]["step"] + 1)


@pytest.mark.parametrize("world", [2, 4])
def test_diloco_rows_are_interval_means_of_the_ledger_bytes(shard: str, world: int) -> None:
    """DiLoCo (one replica per rank: only sync steps send bytes), log_every = 3 over 8 steps: each row's wire
    bytes are the mean of its interval's per-step ledger bytes, so they differ from a sync step's bytes; the
    loss and grad norm are the means of the per-step values a log_every = 1 run logs."""
    cfg = tiny_config(shard, world, "diloco", steps=8, log_every=3)
    cfg.diloco.sync_every, cfg.diloco.fragments = 4, 1
    every = tiny_config(shard, world, "diloco", steps=8, log_every=1)
    every.diloco.sync_every, every.diloco.fragments = 4, 1
    out = run_ranks(_recorded_run, world, cfg, timeout=120)
    ref = run_ranks(_recorded_run, world, every, timeout=120)
    tokens = 2 * 8 * world
    for rank in range(world):
        rows, per_step, ref_rows = out[rank]["rows"], out[rank]["per_step"], ref[rank]["rows"]
        assert [r["step"] for r in rows] == [1, 3, 6, 8]  # the first, every 3rd, the last
        assert len(per_step) == 8 and per_step == ref[rank]["per_step"]
        assert any(b > 0 for b in per_step) and any(b == 0 for b in per_step)
        for i, row in enumerate(rows):
            steps = _interval_of(rows, i)
            wire = [per_step[s - 1] for s in steps]
            assert row["interval_steps"] == len(steps)
            assert row["wire_bytes"] == sum(wire) / len(steps) and row["wire_mb"] == row["wire_bytes"] / 1e6
            assert row["wire_bytes_total"] == sum(wire)
            assert row["wire_bytes_cumulative"] == sum(per_step[:row["step"]])
            assert row["allreduce_ref_bytes_cumulative"] == row["step"] * out[rank]["ref_per_step"]
            if 0 in wire and max(wire) > 0:  # a sync step and a local step: the mean is neither
                assert 0 < row["wire_bytes"] < max(wire)
            np.testing.assert_allclose(row["loss"], np.mean([ref_rows[s - 1]["loss"] for s in steps]), rtol=RTOL64)
            np.testing.assert_allclose(row["grad_norm"], np.mean([ref_rows[s - 1]["grad_norm"] for s in steps]),
                                       rtol=RTOL64)
            # tokens/s is the interval's tokens over its time: times the mean step time, one step's tokens
            np.testing.assert_allclose(row["tokens_per_s"] * row["step_time_s"], tokens, rtol=1e-12)
        assert [r["wire_bytes"] for r in ref_rows] == per_step  # log_every = 1: a row per step, its own bytes
        assert [r["interval_steps"] for r in ref_rows] == [1] * 8
    # the summary's digests of every rank's global copies (python -m lowband.bench goodput compares them across
    # groups): one per rank, each that rank's own, equal over the replicas; 8 steps, sync every 4: 2 commits
    digests = [o["globals_sha256"] for o in out]
    assert len(set(digests)) == 1
    for o in out:
        assert o["summary"]["outer_steps"] == 2 and o["summary"]["diloco_global_sha256"] == digests


@pytest.mark.parametrize("world", [2, 4])
def test_summary_fields_are_consistent(shard: str, world: int, tmp_path: Path) -> None:
    """DDP, float32, 4 steps, log_every 3, checkpoint every 2: summary.json holds the run's tokens, the
    ledger's total bytes, the fp32 all-reduce reference (DDP's float32 bucket all-reduce is exactly that
    reference: ratio 1, nothing saved), peak memory over ranks, the last checkpoint and the model file."""
    cfg = tiny_config(shard, world, "ddp", steps=4, log_every=3, dtype="float32")
    cfg.run.out_dir, cfg.run.name, cfg.checkpoint.every = str(tmp_path), "r", 2
    out = run_ranks(_recorded_run, world, cfg, write_run_dir=True, timeout=120)
    written = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert written == out[0]["summary"]
    for _rank, o in enumerate(out):
        s, rows = o["summary"], o["rows"]
        assert (s["strategy"], s["world_size"], s["start_step"], s["end_step"], s["steps"]) == ("ddp", world, 0, 4, 4)
        assert s["tokens"] == 4 * cfg.data.batch_size * cfg.model.seq_len * world
        assert s["tokens_per_s"] == s["tokens"] / s["train_time_s"]
        np.testing.assert_allclose(s["train_time_s"], sum(r["step_time_s"] * r["interval_steps"] for r in rows),
                                   rtol=1e-12)
        assert s["wall_time_s"] >= s["train_time_s"]
        assert s["final_loss"] == rows[-1]["loss"] == o["final_loss"]
        assert s["final_val_loss"] == o["final_val_loss"] == o["val_rows"][-1]["val_loss"]
        assert s["wire_bytes_total"] == sum(o["per_step"]) == s["wire_bytes_cumulative"] == rows[-1][
            "wire_bytes_cumulative"]
        assert s["wire_bytes_total_max_rank"] == max(sum(x["per_step"]) for x in out)
        assert s["allreduce_ref_bytes_total"] == 4 * o["ref_per_step"] > 0
        assert s["allreduce_ref_ratio"] == s["wire_bytes_total"] / s["allreduce_ref_bytes_total"] == 1.0
        assert s["allreduce_ref_saved_bytes"] == 0
        row_peaks = [x["rows"][-1]["peak_mem_bytes"] for x in out]
        assert max(row_peaks) <= s["peak_mem_bytes"] <= max(x["peak_after"] for x in out)
        assert s["skipped_steps"] == [] and s["skipped_total"] == 0 and s["stopped_by"] == 0
        assert s["checkpoint"] == str(tmp_path / "r" / "checkpoint" / "step-4")
        assert s["model_path"] == o["model_path"]
    assert Path(out[0]["summary"]["checkpoint"], "lowband_checkpoint.json").is_file()
    text = format_summary(out[0]["summary"])
    assert f"{out[0]['summary']['tokens']:,}" in text and "1.000x" in text and "step-4" in text


def test_resumed_run_continues_the_cumulative_bytes(shard: str, tmp_path: Path) -> None:
    """Stopped after 2 of 4 steps and resumed: the rows and summary carry the cumulative bytes of an
    uninterrupted run; the resumed summary's own totals cover steps 3-4 only."""
    world = 2
    cfg = tiny_config(shard, world, "ddp", steps=4, log_every=1)
    cfg.checkpoint.dir, cfg.checkpoint.every = str(tmp_path / "ckpt"), 2
    first = run_ranks(_recorded_run, world, cfg, stop_after=2, timeout=120)
    resumed = run_ranks(_recorded_run, world, cfg, timeout=120)
    whole = run_ranks(_recorded_run, world, tiny_config(shard, world, "ddp", steps=4, log_every=1), timeout=120)
    for rank in range(world):
        f, r, w = first[rank], resumed[rank], whole[rank]
        assert f["summary"]["checkpoint"] == str(tmp_path / "ckpt" / "step-2") and f["summary"]["end_step"] == 2
        assert r["start"] == 2 and [x["step"] for x in r["rows"]] == [3, 4]
        assert [x["wire_bytes_cumulative"] for x in r["rows"]] == [x["wire_bytes_cumulative"] for x in w["rows"][2:]]
        assert [x["allreduce_ref_bytes_cumulative"] for x in r["rows"]] == [
            x["allreduce_ref_bytes_cumulative"] for x in w["rows"][2:]]
        s = r["summary"]
        assert (s["start_step"], s["end_step"], s["steps"]) == (2, 4, 2)
        assert s["tokens"] == 2 * cfg.data.batch_size * cfg.model.seq_len * world
        assert s["wire_bytes_total"] == sum(r["per_step"]) and len(r["per_step"]) == 2
        assert s["wire_bytes_cumulative"] == w["summary"]["wire_bytes_cumulative"] == sum(w["per_step"])
        assert s["allreduce_ref_bytes_total"] == 2 * r["ref_per_step"]


# ------------------------------------------------------------------------------------------ TensorBoard
def _tb_run(cfg: Config) -> list[dict[str, Any]]:
    return [r for r in train(cfg, log=False).rows]


def test_tensorboard_event_file_holds_the_logged_scalars(shard: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(shard, 1, "single", steps=3, log_every=1)
    cfg.run.out_dir, cfg.run.name, cfg.run.tensorboard = str(tmp_path), "tb", True
    rows = run_ranks(_tb_run, 1, cfg, timeout=120)[0]
    tb_dir = tmp_path / "tb" / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    train_rows = [r for r in rows if "loss" in r]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == [float(np.float32(r["loss"])) for r in train_rows]  # stored as float32
    cum = acc.Scalars("wire/bytes_cumulative")
    assert [e.value for e in cum] == [float(np.float32(r["wire_bytes_cumulative"])) for r in train_rows]
    assert [e.step for e in acc.Scalars("val/loss")] == [3]
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "wire/mb_per_step",
            "wire/allreduce_ref_bytes_cumulative"} <= set(acc.Tags()["scalars"])


def _tb_missing(cfg: Config) -> str:
    original = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a, **k: None if name == "tensorboard" else original(name, *a, **k)
    try:
        train(cfg, log=False)
    except ConfigError as e:
        return str(e)
    finally:
        importlib.util.find_spec = original
    return "no error"


def test_tensorboard_missing_is_a_config_error_before_anything_runs(shard: str, tmp_path: Path) -> None:
    cfg = tiny_config(shard, 2, "ddp", steps=1, log_every=1)
    cfg.run.out_dir, cfg.run.name, cfg.run.tensorboard = str(tmp_path), "tb", True
    msgs = run_ranks(_tb_missing, 2, cfg, timeout=120)
    assert all("run.tensorboard = true needs the tensorboard package" in m and "pip install 'lowband[tb]'" in m
               for m in msgs), msgs
    assert not (tmp_path / "tb").exists()


# ------------------------------------------------------------------------------------------ no warnings
STRATEGIES = {"single": 1, "ddp": 2, "sharded-adamw": 2, "sharded-muon": 2, "gtp": 2, "tp": 2, "diloco": 2}


def _warnings_of_run(cfg: Config) -> list[tuple[str, str, int, str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # overrides pyproject's filterwarnings and the once-per-place registry
        train(cfg, log=True)
    return [(w.category.__name__, w.filename, w.lineno, str(w.message)) for w in caught]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_normal_run_prints_no_warning_from_lowband(shard: str, tmp_path: Path, strategy: str) -> None:
    """Two steps of each strategy with a run directory (log line, plot, summary, export): no warning
    originates from a file under lowband/ (torch's own deprecations triggered by a lowband call, like DDP's
    ``broadcast_buffers``, are attributed to the calling lowband line by their stacklevel)."""
    world = STRATEGIES[strategy]
    cfg = tiny_config(shard, world, strategy, steps=2, log_every=1, dtype="float32", batch=4 // world)
    cfg.run.out_dir, cfg.run.name = str(tmp_path), strategy
    caught = run_ranks(_warnings_of_run, world, cfg, timeout=120)
    lowband_dir = str(Path(__file__).resolve().parents[2] / "lowband")
    ours = [w for ws in caught for w in ws if str(Path(w[1]).resolve()).startswith(lowband_dir)]
    assert ours == [], ours
