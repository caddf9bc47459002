"""The DiLoCo scaling sweep: bytes vs DDP and loss vs DDP per model size and replica count, over seeds.

``python -m lowband.bench.diloco_sweep A.json B.json ... --out bench_out/diloco-scaling``

Each input is one ``python -m lowband.bench diloco`` invocation: one model (``--config``), one world (one
replica per rank), one ``--seed``, its own ``ddp`` run and any DiLoCo runs. The inputs are grouped by
(model parameters, replicas, tokens of the horizon), so runs of different lengths are never averaged together;
inside a group a **seed** is identified by its ``ddp`` row (a ddp run is a deterministic function of the seed:
two files with the same ddp final loss and bytes are the same seed), and
a **configuration** by its settings (wire, H, outer lr and momentum, fragments, delay, alpha, error feedback
and its decay; top-k chunk and k for the top-k wires, block size for the block codecs), not by its name.

Per group the report gives ddp's mean final validation loss over its seeds and its **spread** (sample
standard deviation / mean, the noise any "within x %" claim must exceed), the tokens per parameter of the
horizon, and per configuration: its bytes vs ddp (exact, the same at every seed), the mean of its final
validation loss over the seeds it ran divided by ddp's mean over **the same seeds**, and the per-seed
ratios. Writes ``<out>.json`` (the rows), ``<out>.md`` (the table) and ``<out>.png`` (loss ratio vs bytes
ratio, log x, one marker per model size, one colour per replica count; needs matplotlib).

Refuses (exit 2, one line) an input without a ``ddp`` row, and the same configuration at the same seed
with two different results (runs are bitwise reproducible; a difference means the inputs are not what
they claim).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowband.bench.diloco import save_log_x_plot
from lowband.bench.diloco_report import report_args, write_report

SETTINGS = ("wire", "sync_every", "outer_lr", "outer_momentum", "fragments", "delay", "alpha",
            "error_feedback", "ef_decay")
"""Settings every DiLoCo row carries that make up a configuration's identity."""


def config_key(row: dict[str, Any]) -> tuple:
    """The identity of a DiLoCo row's configuration (see the module docstring); ``("ddp",)`` for ddp."""
    if row["name"] == "ddp":
        return ("ddp",)
    wire = row["wire"]
    key: list[Any] = [(k, row.get(k)) for k in SETTINGS]
    if wire.startswith("topk"):
        key += [("topk_chunk", row["topk_chunk"]), ("topk_k", row["topk_k"])]
    if wire not in ("fp32", "bf16", "fp64"):
        key.append(("block_size", row["block_size"]))
    return tuple(key)


def config_label(row: dict[str, Any]) -> str:
    """A short readable label: ``topk-rice-int2 40/4096, H4, EF decay 0.95`` (outer settings when not 1 / 0)."""
    if row["name"] == "ddp":
        return "ddp"
    wire = row["wire"]
    head = f"{wire} {row['topk_k']}/{row['topk_chunk']}" if wire.startswith("topk") else wire
    parts = [head, f"H{row['sync_every']}"]
    if row.get("error_feedback"):
        parts.append("EF" if row.get("ef_decay", 1.0) == 1.0 else f"EF decay {row['ef_decay']:g}")
    if (row.get("outer_lr"), row.get("outer_momentum")) != (1.0, 0.0):
        parts.append(f"outer {row.get('outer_lr')} / {row.get('outer_momentum')}")
    return ", ".join(parts)


def count_model_params(config: dict[str, Any]) -> int:
    """Parameters of a bench document's model: ``config["model_params"]`` when recorded, else the model
    built from its ``base_config`` with the recorded model settings (documents written before the field)."""
    if config.get("model_params"):
        return int(config["model_params"])
    import torch

    from lowband.bench.diloco import resolve_config
    from lowband.train.config import load_config
    from lowband.train.trainer import build_model

    cfg = load_config(resolve_config(config["base_config"]))
    for k, v in config["model"].items():
        setattr(cfg.model, k, v)
    return sum(p.numel() for p in build_model(cfg, torch.device("cpu")).parameters())


def sweep(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model parameters, replicas, tokens of the horizon, configuration), ddp first in each group
    (see the module docstring for the fields).

    Raises:
        ValueError: a document without a ddp row; one configuration with two results at one seed.
    """
    groups: dict[tuple[int, int, int], dict[tuple, dict]] = {}  # group -> configuration -> seed -> row
    for i, doc in enumerate(docs):
        ddp = [r for r in doc["results"] if r["name"] == "ddp"]
        if not ddp:
            raise ValueError(f"diloco_sweep: input {i} has no ddp row")
        cfg, replicas = doc["config"], int(doc["world_size"])
        params = count_model_params(cfg)
        tokens = cfg["steps"] * cfg["batch_size_per_rank"] * replicas * cfg["seq_len"]
        configs = groups.setdefault((params, replicas, tokens), {})
        seed = (ddp[0]["val_loss_final"], ddp[0]["wire_bytes_total"])
        for r in doc["results"]:
            per_seed = configs.setdefault(config_key(r), {})
            old = per_seed.get(seed)
            if old is not None and (old["val_loss_final"], old["wire_bytes_total"]) != (
                    r["val_loss_final"], r["wire_bytes_total"]):
                raise ValueError(f"diloco_sweep: {config_label(r)!r} at one seed has two results "
                                 f"({old['val_loss_final']} and {r['val_loss_final']}) in a group of "
                                 f"{params:,} parameters x {replicas} replicas")
            per_seed.setdefault(seed, r)
    rows: list[dict[str, Any]] = []
    for (params, replicas, tokens), configs in sorted(groups.items()):
        ddp_runs = configs[("ddp",)]
        ddp_losses = [d["val_loss_final"] for d in ddp_runs.values()]
        ddp_mean = statistics.fmean(ddp_losses)
        spread = statistics.stdev(ddp_losses) / ddp_mean if len(ddp_losses) > 1 else None
        ddp_bytes = _bytes(ddp_runs)
        for _key, per_seed in sorted(configs.items(), key=lambda kv: (kv[0] != ("ddp",), _bytes(kv[1]))):
            seeds = list(per_seed)
            losses = [per_seed[s]["val_loss_final"] for s in seeds]
            ref = statistics.fmean(ddp_runs[s]["val_loss_final"] for s in seeds)
            first = per_seed[seeds[0]]
            rows.append({
                "model_params": params, "replicas": replicas, "tokens_per_param": tokens / params,
                "config": config_label(first), "seeds": len(seeds),
                "ddp_seeds": len(ddp_losses), "ddp_val_loss_mean": ddp_mean, "ddp_spread": spread,
                "wire_bytes_total": first["wire_bytes_total"],
                "wire_ratio_vs_ddp": first["wire_bytes_total"] / ddp_bytes,
                "val_loss_mean": statistics.fmean(losses), "val_loss_ratio_vs_ddp": statistics.fmean(losses) / ref,
                "per_seed_ratio": [per_seed[s]["val_loss_final"] / ddp_runs[s]["val_loss_final"] for s in seeds],
            })
    return rows


def _bytes(per_seed: dict) -> int:
    return next(iter(per_seed.values()))["wire_bytes_total"]


def sweep_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table: one line per (size, replicas, configuration)."""
    lines = ["| model params | replicas | tokens / param | configuration | bytes vs ddp | seeds "
             "| final val loss, mean | vs ddp (same seeds) | per seed | ddp spread (std / mean, seeds) |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        ratio = r["wire_ratio_vs_ddp"]
        inv = "1" if ratio == 1 else f"1/{1 / ratio:,.0f}"
        spread = "-" if r["ddp_spread"] is None else f"{100 * r['ddp_spread']:.1f} %"
        per = " / ".join(f"{x:.3f}" for x in r["per_seed_ratio"])
        lines.append(f"| {r['model_params']:,} | {r['replicas']} | {r['tokens_per_param']:.1f} | {r['config']} "
                     f"| {inv} | {r['seeds']} | {r['val_loss_mean']:.4f} | {r['val_loss_ratio_vs_ddp']:.4f} "
                     f"| {per} | {spread} ({r['ddp_seeds']}) |")
    return "\n".join(lines) + "\n"


def sweep_plot(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Loss ratio vs bytes ratio (log x) of every DiLoCo configuration; marker = model size, colour =
    replicas, error bar = the per-seed ratios' standard deviation. False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    markers = "osD^v<>p*h"
    sizes = sorted({r["model_params"] for r in rows})
    reps = sorted({r["replicas"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        if r["config"] == "ddp":
            continue
        sd = statistics.stdev(r["per_seed_ratio"]) if len(r["per_seed_ratio"]) > 1 else 0.0
        m, c = markers[sizes.index(r["model_params"]) % len(markers)], f"C{reps.index(r['replicas'])}"
        ax.errorbar(r["wire_ratio_vs_ddp"], r["val_loss_ratio_vs_ddp"], yerr=sd, fmt=m, color=c, ms=6, capsize=2)
        ax.annotate(r["config"], (r["wire_ratio_vs_ddp"], r["val_loss_ratio_vs_ddp"]), fontsize=6,
                    xytext=(4, 3), textcoords="offset points")
    for s in sizes:
        ax.plot([], [], markers[sizes.index(s) % len(markers)], color="gray", label=f"{s / 1e6:.2f}M parameters")
    for n in reps:
        ax.plot([], [], "s", color=f"C{reps.index(n)}", label=f"{n} replicas")
    xs = [r["wire_ratio_vs_ddp"] for r in rows if r["config"] != "ddp"]
    if xs and min(xs) == max(xs):  # one bytes ratio: give the log axis a decade around it
        ax.set_xlim(min(xs) / 3, max(xs) * 3)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.01, color="C3", ls="--", lw=0.8, label="ddp + 1 %")
    ax.axvline(1 / 1000, color="C2", ls="-.", lw=0.8, label="1/1000 of ddp's bytes")
    save_log_x_plot(fig, ax, path, xlabel="total wire bytes per rank vs ddp (log)",
                    ylabel="final validation loss vs ddp (mean over seeds)", title=title)
    return True


def main(argv: list[str] | None = None) -> int:
    a = report_args("diloco_sweep", "diloco bench JSON files (any sizes, worlds and seeds)", "DiLoCo scaling sweep",
                    argv)
    try:
        rows = sweep([json.loads(Path(f).read_text()) for f in a.inputs])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    except (OSError, KeyError) as e:
        print(f"diloco_sweep: not a readable diloco bench document ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    write_report(a.out, {"rows": rows, "inputs": a.inputs}, sweep_markdown(rows),
                 lambda path: sweep_plot(rows, path, title=a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
