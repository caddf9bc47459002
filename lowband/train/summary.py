"""The end-of-run summary: one dict, printed as a short block on rank 0 and written as ``summary.json``.

:func:`run_summary` is collective (every rank calls it once at the end of a run): one all-reduce
(``max``) of two float64 numbers on the metrics ``Comm`` (tag ``summary``, not training traffic) gives
the peak memory and the largest per-rank wire total over ranks. Everything else is this rank's own
count (rank 0's is the one printed and written). Byte counts are per rank, by the ledger's ring model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lowband.comm import Comm
from lowband.train.metrics import format_bytes

SUMMARY_FILE = "summary.json"


def run_summary(comm: Comm, *, strategy: str, world_size: int, start_step: int, end_step: int,
                tokens_per_step: int, wall_time_s: float, train_time_s: float, final_loss: float | None,
                final_val_loss: float | None, wire_bytes_total: int, wire_bytes_cumulative: int,
                allreduce_ref_bytes_total: int, peak_mem_bytes: int, skipped_steps: list[int],
                checkpoint: str | None, model_path: str | None, stopped_by: int = 0,
                steps_trained: int | None = None, extras: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary of a run (collective over ``comm``; see the module docstring).

    Args:
        start_step, end_step: the run trained steps ``start_step + 1 .. end_step`` (``start_step`` > 0 when
            resumed).
        tokens_per_step: global tokens per optimizer step.
        wall_time_s: wall time of the whole run (setup, validation and checkpoints included).
        train_time_s: the sum of the optimizer steps' times (what ``tokens_per_s`` divides by).
        wire_bytes_total: this rank's training wire bytes in this run; ``wire_bytes_cumulative``: since step 0.
        allreduce_ref_bytes_total: what an fp32 ring all-reduce of the model's gradients would have sent per
            rank over this run's steps.
        peak_mem_bytes: this rank's peak memory (the summary holds the maximum over ranks).
        skipped_steps: 1-based steps the non-finite guard skipped (the whole run, checkpointed part included).
        checkpoint: the last checkpoint this run wrote, or ``None``; model_path: the exported model, or ``None``.
        steps_trained: the optimizer steps this run trained when fewer than ``end_step - start_step`` (a
            fault-tolerant DiLoCo group healed from a peer jumps to the peer's step); ``steps`` and ``tokens``
            count only these.
        extras: the strategy's own fields (:meth:`Strategy.summary_extras`), added as they are.

    Returns:
        A JSON-ready dict: ``strategy``, ``world_size``, ``start_step``, ``end_step``, ``steps``,
        ``wall_time_s``, ``train_time_s``, ``tokens``, ``tokens_per_s``, ``final_loss`` (the last logged
        interval's mean), ``final_val_loss``, ``wire_bytes_total``, ``wire_bytes_total_max_rank``,
        ``wire_bytes_cumulative``, ``allreduce_ref_bytes_total``, ``allreduce_ref_ratio`` (total / reference,
        ``None`` when the reference is 0), ``allreduce_ref_saved_bytes`` (reference - total),
        ``peak_mem_bytes``, ``skipped_steps``, ``skipped_total``, ``checkpoint``, ``model_path``,
        ``stopped_by``.
    """
    most = torch.tensor([float(peak_mem_bytes), float(wire_bytes_total)], dtype=torch.float64)
    comm.all_reduce(most, "max", tag="summary")
    steps = end_step - start_step if steps_trained is None else steps_trained
    tokens = steps * tokens_per_step
    return {
        "strategy": strategy, "world_size": world_size, "start_step": start_step, "end_step": end_step,
        "steps": steps, "wall_time_s": wall_time_s, "train_time_s": train_time_s, "tokens": tokens,
        "tokens_per_s": tokens / train_time_s if train_time_s > 0 else None,
        "final_loss": final_loss, "final_val_loss": final_val_loss,
        "wire_bytes_total": wire_bytes_total, "wire_bytes_total_max_rank": int(most[1]),
        "wire_bytes_cumulative": wire_bytes_cumulative, "allreduce_ref_bytes_total": allreduce_ref_bytes_total,
        "allreduce_ref_ratio": wire_bytes_total / allreduce_ref_bytes_total if allreduce_ref_bytes_total else None,
        "allreduce_ref_saved_bytes": allreduce_ref_bytes_total - wire_bytes_total,
        "peak_mem_bytes": int(most[0]), "skipped_steps": list(skipped_steps), "skipped_total": len(skipped_steps),
        "checkpoint": checkpoint, "model_path": model_path, "stopped_by": stopped_by, **(extras or {}),
    }


def _mb(n: float) -> str:
    return format_bytes(n)


def _loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def format_summary(s: dict[str, Any]) -> str:
    """The printed block (a few lines, every one prefixed ``lowband.train:``)."""
    resumed = f" (resumed at step {s['start_step']})" if s["start_step"] else ""
    tps = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
    if s["allreduce_ref_ratio"] is None:
        ref = "no all-reduce reference on one rank"
    else:
        ref = (f"fp32 all-reduce would send {_mb(s['allreduce_ref_bytes_total'])}: "
               f"{s['allreduce_ref_ratio']:.3f}x, {_mb(s['allreduce_ref_saved_bytes'])} saved")
    span = f"steps {s['start_step'] + 1}..{s['end_step']}" if s["steps"] else "no step trained"
    if s["steps"] and s["steps"] < s["end_step"] - s["start_step"]:
        span += f" ({s['steps']} trained here, the others healed from a peer)"
    elif s["steps"] > s["end_step"] - s["start_step"]:
        span += f" ({s['steps']} trained here: a heal from a peer went back)"
    lines = [
        f"summary: {s['strategy']} on {s['world_size']} rank(s), {span}{resumed}, {s['wall_time_s']:.1f} s wall "
        f"({s['train_time_s']:.1f} s in steps)",
        f"  tokens      {s['tokens']:,} ({tps} tok/s)",
        f"  loss        train {_loss(s['final_loss'])} | val {_loss(s['final_val_loss'])}",
        f"  wire        {_mb(s['wire_bytes_total'])} per rank ({ref})",
        f"  peak memory {s['peak_mem_bytes'] / 2**20:,.0f} MiB (max over ranks)",
        f"  skipped     {s['skipped_total']} step(s)",
        f"  checkpoint  {s['checkpoint'] or '-'}",
        f"  model       {s['model_path'] or '-'}",
    ]
    return "\n".join(f"lowband.train: {line}" for line in lines)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``<run_dir>/summary.json`` (rank 0)."""
    path = run_dir / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path
