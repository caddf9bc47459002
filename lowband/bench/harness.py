"""Shared machinery for benchmark suites: alternating timing, result rows, JSON and Markdown output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowband.comm import Comm


def timed_alternating(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int, comm: Comm,
                      sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Time each callable ``repeats`` times, alternating between them (rotating which goes first).

    Every sample is the slowest rank's time (max-reduced over ``comm``), after a barrier.
    """
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            comm.barrier(tag="bench")
            t0 = time.perf_counter()
            fns[name]()
            if sync is not None:
                sync()
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            comm.all_reduce(dt, "max", tag="bench")
            if rep >= warmup:
                times[name].append(float(dt))
    return times


def max_over_ranks(value: int, comm: Comm) -> int:
    """The largest ``value`` over the ranks of ``comm`` (one scalar all-reduce; call on every rank)."""
    t = torch.tensor(float(value), dtype=torch.float64)
    comm.all_reduce(t, "max", tag="bench")
    return int(t)


def result_row(name: str, times: list[float], *, wire_bytes: int = 0, optimizer_state_bytes: int = 0,
               peak_memory_bytes: int = 0, final_loss: float | None = None, **extra: Any) -> dict[str, Any]:
    row = {"name": name, "step_time_s_median": statistics.median(times), "step_time_s": times,
           "wire_bytes_per_step_per_rank": int(wire_bytes),
           "optimizer_state_bytes_per_rank": int(optimizer_state_bytes),
           "peak_memory_bytes": int(peak_memory_bytes), "final_loss": final_loss, "ratio_vs": {}}
    row.update(extra)
    return row


def _add_ratios(results: list[dict[str, Any]], baselines: dict[str, list[str]], value: str, out: str) -> None:
    """``row[out][b] = row[value] / b's row[value]`` for each named baseline b (present, non-zero) of each row."""
    by_name = {r["name"]: r for r in results}
    for name, bases in baselines.items():
        row = by_name.get(name)
        if row is None:
            continue
        for b in bases:
            if b in by_name and by_name[b][value] > 0:
                row.setdefault(out, {})[b] = row[value] / by_name[b][value]


def add_ratios(results: list[dict[str, Any]], baselines: dict[str, list[str]]) -> None:
    """``ratio_vs[b] = this median / b's median`` for each named baseline b of each row."""
    _add_ratios(results, baselines, "step_time_s_median", "ratio_vs")


def add_state_ratios(results: list[dict[str, Any]], baselines: dict[str, list[str]]) -> None:
    """``optimizer_state_ratio_vs[b] = this row's optimizer_state_bytes_per_rank / b's`` for each named b."""
    _add_ratios(results, baselines, "optimizer_state_bytes_per_rank", "optimizer_state_ratio_vs")


def markdown_table(doc: dict[str, Any]) -> str:
    lines = [f"### `{doc['suite']}` — world {doc['world_size']}, {doc['backend']}, {doc['device']}, "
             f"torch {doc['torch']}", "",
             "| name | median s | wire bytes/step/rank | opt state bytes/rank | peak mem bytes | final loss "
             "| ratio vs |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in doc["results"]:
        if "step_time_s_median" not in r:  # a contender that failed: its row carries the error
            lines.append(f"| {r['name']} | error: {r.get('error', 'no result')} | | | | | |")
            continue
        ratios = ", ".join(f"{k}: {v:.3f}" for k, v in r.get("ratio_vs", {}).items())
        loss = "" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        lines.append(f"| {r['name']} | {r['step_time_s_median']:.4f} | {r['wire_bytes_per_step_per_rank']:,} | "
                     f"{r['optimizer_state_bytes_per_rank']:,} | {r['peak_memory_bytes']:,} | {loss} | "
                     f"{ratios} |")
    return "\n".join(lines) + "\n"


def launcher_doc(suite: str, world_size: int, body: dict[str, Any]) -> dict[str, Any]:
    """The bench document of a suite that launches its own CPU gloo ranks (``link``, ``goodput``): DESIGN.md's
    header fields around the suite's ``{"config", "results"}``."""
    return {"suite": suite, "world_size": world_size, "backend": "gloo", "device": "cpu",
            "torch": torch.__version__, **body}


def write_outputs(doc: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown_table(doc))
    return out, md
