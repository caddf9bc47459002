"""The logging interval: rows hold means and totals over the steps since the previous row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.comm import ring_wire_bytes
from lowband.train.metrics import (
    IntervalMeter,
    RunWriter,
    allreduce_reference_bytes,
    format_bytes,
    format_duration,
    format_log_line,
)


def _steps(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"loss": float(rng.uniform(2, 6)), "grad_norm": float(rng.uniform(0.1, 3)),
             "time": float(rng.uniform(0.01, 0.2)), "wire": int(rng.integers(0, 10_000)),
             "coll": int(rng.integers(1, 9)), "skip": bool(rng.random() < 0.3)} for _ in range(n)]


def _feed(meter: IntervalMeter, steps: list[dict]) -> None:
    for s in steps:
        meter.add(torch.tensor(s["loss"], dtype=torch.float64), s["grad_norm"], s["time"], s["wire"], s["coll"],
                  s["skip"])


def _seq_sum(xs: list[float]) -> float:
    """Left-to-right float64 sum: the meter's own order, so its means are compared bitwise."""
    total = 0.0
    for x in xs:
        total += x
    return total


@pytest.mark.parametrize("sizes", [[1], [1, 5, 3], [7, 1, 10]])
def test_rows_are_interval_means_and_totals(sizes: list[int]) -> None:
    tokens, ref = 4096, 123_456
    meter = IntervalMeter(tokens, ref, recent=4)
    cum = 0
    done = 0
    all_steps = _steps(sum(sizes), seed=len(sizes))
    for n in sizes:
        steps = all_steps[done:done + n]
        done += n
        _feed(meter, steps)
        assert meter.steps == n
        local = meter.local_loss_mean()
        assert local.dtype == torch.float64 and local.device.type == "cpu"
        assert float(local) == _seq_sum([s["loss"] for s in steps]) / n  # same order: bitwise
        row = meter.row(float(local), remaining_steps=10)
        wire = [s["wire"] for s in steps]
        times = [s["time"] for s in steps]
        cum += sum(wire)
        assert row["interval_steps"] == n
        assert row["loss"] == float(local)
        assert row["grad_norm"] == _seq_sum([s["grad_norm"] for s in steps]) / n
        assert row["step_time_s"] == _seq_sum(times) / n
        assert row["tokens_per_s"] == tokens * n / _seq_sum(times)
        assert row["wire_bytes"] == sum(wire) / n and row["wire_mb"] == sum(wire) / n / 1e6
        assert row["wire_bytes_total"] == sum(wire)
        assert row["wire_bytes_cumulative"] == cum
        assert row["allreduce_ref_bytes_cumulative"] == ref * done
        assert row["collectives"] == sum(s["coll"] for s in steps) / n
        assert row["skipped_in_interval"] == sum(s["skip"] for s in steps)
        assert row["skipped"] == any(s["skip"] for s in steps)
        recent = [s["time"] for s in all_steps[:done]][-4:]
        assert row["eta_s"] == _seq_sum(recent) / len(recent) * 10
        assert meter.steps == 0  # the next interval starts empty
    assert meter.run_steps == done and meter.run_wire_bytes == cum and meter.run_ref_bytes == ref * done
    assert meter.run_time_s == _seq_sum([s["time"] for s in all_steps])


def test_empty_interval_raises() -> None:
    meter = IntervalMeter(1, 0)
    with pytest.raises(RuntimeError, match="no step since the last row"):
        meter.local_loss_mean()
    with pytest.raises(RuntimeError, match="no step since the last row"):
        meter.row(0.0, 0)


def test_nonfinite_step_makes_its_interval_nonfinite() -> None:
    """A skipped step's NaN loss is part of its interval's mean (the row says so with skipped = True)."""
    meter = IntervalMeter(1, 0)
    meter.add(torch.tensor(2.0, dtype=torch.float64), 1.0, 0.1, 0, 0, False)
    meter.add(torch.tensor(float("nan"), dtype=torch.float64), 1.0, 0.1, 0, 0, True)
    row = meter.row(float(meter.local_loss_mean()), 0)
    assert np.isnan(row["loss"]) and row["skipped"] and row["skipped_in_interval"] == 1


def test_counters_state_roundtrip() -> None:
    a = IntervalMeter(1, 10)
    _feed(a, _steps(3, seed=0))
    b = IntervalMeter(1, 10)
    b.load_state_dict(a.state_dict())
    assert (b.cumulative, b.ref_cumulative) == (a.cumulative, a.ref_cumulative) and b.ref_cumulative == 30
    assert b.run_wire_bytes == 0  # this run's own counts start at 0 on resume


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_allreduce_reference_is_fp32_ring_allreduce_of_the_logical_params(world: int) -> None:
    shapes = {"wte.weight": ([320, 16], "float64"), "h.0.w": ([48, 16], "bfloat16"), "ln.bias": ([16], "float32")}
    p = 320 * 16 + 48 * 16 + 16
    assert allreduce_reference_bytes(shapes, world) == ring_wire_bytes("all_reduce", world, 4 * p)
    assert allreduce_reference_bytes(shapes, world) == (0 if world == 1 else 2 * (world - 1) * 4 * p // world)


def test_format_duration_and_eta_in_log_line() -> None:
    assert [format_bytes(n) for n in (0, 999, 1000, 26720, 13.4e6, 2.05e9)] == [
        "0 B", "999 B", "1 kB", "26.7 kB", "13.4 MB", "2.05 GB"]
    assert [format_duration(s) for s in (0, 44.6, 192, 3599, 7500)] == ["0s", "45s", "3m12s", "59m59s", "2h05m"]
    row = {"step": 10, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 1000.0, "wire_bytes": 26720.0, "wire_mb": 0.02672,
           "wire_bytes_cumulative": 13_400_000, "peak_mem_bytes": 2**20, "step_time_s": 0.1, "grad_norm": 1.0,
           "eta_s": 192.0}
    line = format_log_line(row, 100)
    assert "eta 3m12s" in line and "wire 26.7 kB/step" in line and "sent 13.4 MB" in line
    assert "eta" not in format_log_line(dict(row, step=100), 100)  # nothing left at the last step


def test_plot_shows_cumulative_bytes_and_reference(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    meter = IntervalMeter(64, 1000)
    for step in range(1, 7):
        _feed(meter, _steps(1, seed=step))
        if step % 2 == 0:
            w.write({"step": step, **meter.row(float(meter.local_loss_mean()), 6 - step)})
    w.write({"step": 6, "val_loss": 3.0})
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["allreduce_ref_bytes_cumulative"] for r in rows[:3]] == [2000, 4000, 6000]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_plot_off_writes_the_metrics_and_no_png(tmp_path: Path) -> None:
    from lowband.train.config import load_config

    assert load_config(None, []).run.plot is True and load_config(None, ["--run.plot=false"]).run.plot is False
    w = RunWriter(tmp_path, plot=False)
    w.write({"step": 1, "loss": 3.0})
    w.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 3.0}
    assert not (tmp_path / "loss.png").exists()


def _one_rank_summary(**kw):
    from lowband.comm import Comm, CommLedger
    from lowband.train.summary import run_summary

    args = dict(strategy="single", world_size=1, start_step=0, end_step=5, tokens_per_step=256, wall_time_s=2.0,
                train_time_s=1.0, final_loss=3.5, final_val_loss=3.6, wire_bytes_total=0, wire_bytes_cumulative=0,
                allreduce_ref_bytes_total=0, peak_mem_bytes=123, skipped_steps=[2], checkpoint=None,
                model_path=None)
    args.update(kw)
    return run_summary(Comm(name="world", ledger=CommLedger()), **args)


def test_one_rank_summary_and_its_printed_block() -> None:
    from lowband.train.summary import format_summary

    s = _one_rank_summary()
    assert (s["steps"], s["tokens"], s["tokens_per_s"], s["peak_mem_bytes"]) == (5, 1280, 1280.0, 123)
    assert s["allreduce_ref_ratio"] is None and s["allreduce_ref_saved_bytes"] == 0  # no reference on one rank
    assert s["skipped_total"] == 1 and s["wire_bytes_total_max_rank"] == 0
    text = format_summary(s)
    assert "steps 1..5" in text and "1,280 (1,280 tok/s)" in text and "no all-reduce reference" in text
    assert all(line.startswith("lowband.train: ") for line in text.splitlines())
    resumed = format_summary(_one_rank_summary(start_step=5, end_step=5, train_time_s=0.0, final_loss=None))
    assert "no step trained (resumed at step 5)" in resumed and "train - |" in resumed
