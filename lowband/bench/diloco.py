"""``diloco`` suite: Streaming DiLoCo against ``ddp`` after the same tokens: wire bytes vs final loss.

Each contender is one full training run of the trainer (``configs/diloco-bench.toml`` unless ``--config``;
its strategy is replaced by ddp or diloco, and its ``sparse.tables`` dropped unless ``diloco.inner`` is a
sharded one: ``--config configs/demo.toml`` runs too),
same seed, same data (the built-in corpus, each rank its slice of every global batch), same number
of steps; runs go one after the other (not alternated: each is a whole training run). Contenders:
``ddp``, then either every ``--sync-every`` x ``--wires`` pair with the shared outer settings, or the
``--runs`` list (``;``-separated, each ``key=value,...`` over the ``[diloco]`` keys ``sync_every``,
``wire``, ``outer_lr``, ``outer_momentum``, ``fragments``, ``delay``, ``alpha``, ``block_size``,
``topk_chunk``, ``topk_k``, ``error_feedback``, ``ef_decay``, plus ``name``). Defaults: the comparison of
docs/PERFORMANCE.md's diloco section: H = 4, 8, 16 x fp32, fp8, int8 wires, delay 0, outer SGD lr 1.0
without momentum (parameter averaging, the settings that section found to reach ddp's loss).

Reported per contender: median step time, wire bytes per inner step per rank and in total over the run
(all training collectives in the ledger; DiLoCo's one-time initial broadcast and settings check are
reported apart as ``one_time_wire_bytes``), optimizer state bytes per rank (DiLoCo: inner AdamW + CPU
global copies + outer momentum + residuals), final training loss, and the validation loss after the
run: ``val_loss`` of each rank's own (local) weights averaged over ranks, and for DiLoCo also
``val_loss_global`` of the global copies (the last agreed weights of every fragment: the model every
replica holds in common). ``val_loss_final`` is the model a run ends with (ddp: its weights; DiLoCo:
the global copies); ``wire_ratio_vs_ddp`` (total bytes) and ``val_loss_ratio_vs_ddp`` compare it
with the ``ddp`` run, and ``pareto`` marks the rows no other row beats on both. Rank 0 also
writes ``<out>-pareto.md`` (the table) and ``<out>-pareto.png`` (final validation loss vs
total wire bytes, log x, ddp marked).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path
from typing import Any

import torch

from lowband.bench.harness import add_ratios, result_row
from lowband.train.config import load_config
from lowband.train.env import DistEnv

ONE_TIME_TAGS = ("diloco:init", "validate")


QUICK = {"steps": 16, "val_batches": 1}
"""``--quick`` settings (lowband.bench.__main__.apply_quick); ``--quick`` also shrinks the config's model to
:data:`QUICK_MODEL` and its batch to 2 sequences."""
QUICK_MODEL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "bigram_rows": 0}
DEFAULT_CONFIG = "configs/diloco-bench.toml"
"""The bench's model (2 blocks, 64 wide, ddp; docs/PERFORMANCE.md's diloco section); a relative path is
looked up in the working directory, then in the lowband checkout."""


def resolve_config(path: str) -> Path | None:
    """The trainer config ``--config`` names: as given, else (a relative path) inside the lowband
    checkout; ``None`` for the built-in default config only when the default file is absent."""
    p = Path(path)
    if p.is_file():
        return p
    repo = Path(__file__).resolve().parents[2] / path
    if not p.is_absolute() and repo.is_file():
        return repo
    if path == DEFAULT_CONFIG:
        return None  # an installed lowband without its configs/: the trainer's defaults
    raise ValueError(f"diloco bench --config {path!r}: no such file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="trainer config (the model, data and optimizer of "
                   "every run; its strategy is replaced by ddp / diloco)")
    p.add_argument("--steps", type=int, default=300, help="inner (optimizer) steps per run")
    p.add_argument("--sync-every", default="4,8,16", help="H; comma-separated for several DiLoCo runs")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--delay", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.0)
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--wires", default="fp32,fp8,int8", help="comma-separated DiLoCo wire formats")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--topk-chunk", type=int, default=256)
    p.add_argument("--topk-k", type=int, default=8)
    p.add_argument("--error-feedback", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--ef-decay", type=float, default=1.0,
                   help="error-feedback decay (diloco.ef_decay, in (0, 1]; 1 = plain error feedback)")
    p.add_argument("--runs", default="", help="';'-separated DiLoCo runs, each 'key=value,...' (see above)")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


@torch.no_grad()
def _global_val_loss(strategy: Any, cfg: Any, env: DistEnv) -> float:
    from lowband.data import DistributedLoader
    from lowband.train.trainer import evaluate, load_token_arrays

    model = copy.deepcopy(strategy.unwrapped())
    names = dict(model.named_parameters())
    for frag, gs in zip(strategy.diloco.frags, strategy.diloco.globals, strict=True):
        for name, g in zip(frag.names, gs, strict=True):
            names[name].copy_(g)
    _, val_tokens = load_token_arrays(cfg, env)
    micro = cfg.data.batch_size // cfg.data.grad_accum
    loader = DistributedLoader(val_tokens, micro, cfg.model.seq_len, env.rank, env.world_size,
                               seed=cfg.run.seed + 1)
    return evaluate(model, loader, cfg.run.val_batches, env)


def run(env: DistEnv, opts: dict[str, Any]) -> dict[str, Any]:
    from lowband.train.config import validate
    from lowband.train.trainer import train

    base = load_config(resolve_config(opts["config"]))
    if base.diloco.inner not in ("sharded-adamw", "sharded-muon"):
        base.sparse.tables = []  # only those inner strategies send sparse rows; ddp and the others send dense ones
    if opts.get("quick"):
        for k, v in QUICK_MODEL.items():
            setattr(base.model, k, v)
        base.data.batch_size, base.data.grad_accum = 2, 1
    base.run.steps = opts["steps"]
    base.run.world_size = env.world_size
    base.run.log_every = 1
    base.run.val_every = 0
    base.run.val_batches = opts["val_batches"]
    base.run.seed = opts["seed"]
    base.run.threads = opts.get("threads") or 1
    runs: list[tuple[str, Any]] = []
    ddp = copy.deepcopy(base)
    ddp.strategy.name = "ddp"
    runs.append(("ddp", ddp))
    shared = dict(fragments=opts["fragments"], delay=opts["delay"], alpha=opts["alpha"],
                  outer_lr=opts["outer_lr"], outer_momentum=opts["outer_momentum"],
                  block_size=opts["block_size"], topk_chunk=opts["topk_chunk"], topk_k=opts["topk_k"],
                  error_feedback=opts["error_feedback"], ef_decay=opts["ef_decay"])
    for name, spec in _diloco_specs(opts):
        c = copy.deepcopy(base)
        c.strategy.name = "diloco"
        for k, v in {**shared, **spec}.items():
            setattr(c.diloco, k, v)
        runs.append((name, c))
    for _, c in runs:
        validate(c, world_size=env.world_size)  # every rank alike, before any training collective
    ledger = env.ledger
    results = []
    model_params = 0
    for name, c in runs:
        start = len(ledger.records)
        res = train(c, env, write_run_dir=False, log=False)
        model_params = model_params or sum(p.numel() for p in res.strategy.unwrapped().parameters())
        recs = ledger.records[start:]
        one_time = sum(r.wire_bytes for r in recs if r.tag in ONE_TIME_TAGS)
        steady = sum(r.wire_bytes for r in recs if r.tag not in ONE_TIME_TAGS)
        times = [r["step_time_s"] for r in res.rows if "step_time_s" in r]
        strategy = res.strategy
        row = result_row(name, times, wire_bytes=steady // c.run.steps,
                         optimizer_state_bytes=strategy.optimizer_state_bytes(), peak_memory_bytes=max(
                             (r.get("peak_mem_bytes", 0) for r in res.rows), default=0),
                         final_loss=res.final_loss, val_loss=res.final_val_loss,
                         wire_bytes_total=steady, one_time_wire_bytes=one_time, steps=c.run.steps,
                         step_time_s_mean=statistics.fmean(times) if times else None)
        if c.strategy.name == "diloco":
            d = c.diloco
            row.update(sync_every=d.sync_every, fragments=d.fragments, delay=d.delay, alpha=d.alpha, wire=d.wire,
                       outer_lr=d.outer_lr, outer_momentum=d.outer_momentum, block_size=d.block_size,
                       topk_chunk=d.topk_chunk, topk_k=d.topk_k, error_feedback=strategy.diloco.error_feedback,
                       ef_decay=d.ef_decay,
                       outer_steps=strategy.diloco.committed, val_loss_global=_global_val_loss(strategy, c, env))
            row["val_loss_final"] = row["val_loss_global"]
            strategy.diloco.close()
        else:
            row["val_loss_final"] = row["val_loss"]
        results.append(row)
        del strategy, res
    ref = results[0]
    for r in results:
        r["wire_ratio_vs_ddp"] = (r["wire_bytes_total"] / ref["wire_bytes_total"]
                                  if ref["wire_bytes_total"] else None)
        r["val_loss_ratio_vs_ddp"] = (r["val_loss_final"] / ref["val_loss_final"]
                                      if ref["val_loss_final"] else None)
    mark_pareto(results)
    add_ratios(results, {r["name"]: ["ddp"] for r in results if r["name"] != "ddp"})
    keys = ("sync_every", "fragments", "delay", "alpha", "outer_lr", "outer_momentum", "block_size",
            "topk_chunk", "topk_k", "error_feedback", "ef_decay", "runs")
    doc = {"config": {"base_config": opts["config"], "steps": opts["steps"], "model": vars(base.model),
                      "model_params": model_params, "seed": opts["seed"],
                      "batch_size_per_rank": base.data.batch_size, "seq_len": base.model.seq_len,
                      "diloco": {k: opts[k] for k in keys}, "val_batches": opts["val_batches"],
                      "threads_per_rank": base.run.threads,
                      "note": "runs are sequential full trainings, not alternated; step times indicative"},
           "results": results}
    if env.rank == 0:
        stem = Path(opts.get("out") or f"bench_out/diloco-w{env.world_size}.json").with_suffix("")
        stem.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{stem}-pareto.md").write_text(pareto_markdown(results))
        pareto_plot(results, Path(f"{stem}-pareto.png"), title=f"diloco bench: {opts['steps']} inner steps, "
                    f"world {env.world_size}")
    return doc


_SPEC_TYPES = {"sync_every": int, "fragments": int, "delay": int, "alpha": float, "outer_lr": float,
               "outer_momentum": float, "block_size": int, "topk_chunk": int, "topk_k": int, "wire": str,
               "error_feedback": str, "ef_decay": float, "name": str}


def _diloco_specs(opts: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, overrides) of every DiLoCo run: ``--runs`` if given, else ``--sync-every`` x ``--wires``."""
    if opts.get("runs"):
        out = []
        for item in str(opts["runs"]).split(";"):
            if not item.strip():
                continue
            spec: dict[str, Any] = {}
            for kv in item.split(","):
                k, _, v = kv.partition("=")
                k = k.strip()
                if k not in _SPEC_TYPES:
                    raise ValueError(f"diloco bench --runs: unknown key {k!r}; allowed: {sorted(_SPEC_TYPES)}")
                spec[k] = _SPEC_TYPES[k](v.strip())
            name = spec.pop("name", None) or "diloco-" + "-".join(
                f"H{v}" if k == "sync_every" else str(v) if k == "wire" else f"{k}{v}" for k, v in spec.items())
            out.append((name, spec))
        return out
    hs = [int(h) for h in str(opts["sync_every"]).split(",") if h]
    wires = [w for w in str(opts["wires"]).split(",") if w]
    return [(f"diloco-H{h}-{w}" if len(hs) > 1 else f"diloco-{w}", {"sync_every": h, "wire": w})
            for h in hs for w in wires]


def mark_pareto(results: list[dict[str, Any]]) -> None:
    """``pareto = True`` on every row that no other row beats on both total bytes and final val loss."""
    for r in results:
        r["pareto"] = not any(
            o is not r and o["wire_bytes_total"] <= r["wire_bytes_total"] and o["val_loss_final"] <= r["val_loss_final"]
            and (o["wire_bytes_total"] < r["wire_bytes_total"] or o["val_loss_final"] < r["val_loss_final"])
            for o in results)


def pareto_markdown(results: list[dict[str, Any]]) -> str:
    """The bytes-vs-loss table: one row per run, ddp first, sorted by total bytes after it."""
    lines = ["| run | wire | H | outer lr / momentum | EF | total wire bytes / rank | bytes vs ddp "
             "| final val loss | val loss vs ddp | local val loss | Pareto |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    rows = [results[0], *sorted(results[1:], key=lambda r: r["wire_bytes_total"])]
    for r in rows:
        ratio = r["wire_ratio_vs_ddp"]
        inv = "1" if ratio == 1 else (f"1/{1 / ratio:,.0f}" if ratio else "-")
        outer = f"{r['outer_lr']} / {r['outer_momentum']}" if "outer_lr" in r else "-"
        ef = ("off" if not r.get("error_feedback") else "on" if r.get("ef_decay", 1.0) == 1.0
              else f"on, decay {r['ef_decay']:g}") if "wire" in r else "-"
        lines.append(f"| {r['name']} | {r.get('wire', 'fp32 grads')} | {r.get('sync_every', 1)} | {outer} | {ef} "
                     f"| {r['wire_bytes_total']:,} | {inv} | {r['val_loss_final']:.4f} "
                     f"| {r['val_loss_ratio_vs_ddp']:.4f} | {r['val_loss']:.4f} | {'yes' if r['pareto'] else ''} |")
    return "\n".join(lines) + "\n"


def pareto_plot(results: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Final validation loss vs total wire bytes per rank (log x), Pareto front joined, ddp marked.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        is_ref = r["name"] == "ddp"
        ax.scatter(r["wire_bytes_total"], r["val_loss_final"], marker="*" if is_ref else "o",
                   s=160 if is_ref else 40, color="black" if is_ref else ("C0" if r["pareto"] else "C7"), zorder=3)
        ax.annotate(r["name"], (r["wire_bytes_total"], r["val_loss_final"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    front = sorted((r for r in results if r["pareto"]), key=lambda r: r["wire_bytes_total"])
    ax.plot([r["wire_bytes_total"] for r in front], [r["val_loss_final"] for r in front], color="C0", lw=1)
    ref = results[0]
    ax.axhline(ref["val_loss_final"] * 1.03, color="C3", ls="--", lw=0.8, label="ddp val loss + 3 %")
    ax.axvline(ref["wire_bytes_total"] / 300, color="C2", ls=":", lw=0.8, label="ddp bytes / 300")
    ax.axvline(ref["wire_bytes_total"] / 1000, color="C2", ls="-.", lw=0.8, label="ddp bytes / 1000")
    save_log_x_plot(fig, ax, path, xlabel="total wire bytes per rank over the run (log)",
                    ylabel="final validation loss", title=title)
    return True


def save_log_x_plot(fig: Any, ax: Any, path: Path, *, xlabel: str, ylabel: str, title: str) -> None:
    """Finish a bytes plot: log x, labels, title, legend; save to ``path`` and close the figure."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
