"""``diloco`` suite: Streaming DiLoCo against ``ddp`` on the demo model, after the same tokens.

Each contender is one full training run of the trainer (``configs/demo.toml`` unless ``--config``),
same seed, same data (the built-in corpus, each rank its slice of every global batch), same number
of steps; runs go one after the other (not alternated: each is a whole training run). Reported per
contender: median step time, wire bytes per inner step per rank (all training collectives in the
ledger over the run, divided by the steps; DiLoCo's one-time initial broadcast and settings check
are reported apart as ``one_time_wire_bytes``), optimizer state bytes per rank (DiLoCo: inner AdamW +
CPU global copies + outer momentum), final training loss, and the validation loss after the run:
``val_loss`` of each rank's own (local) weights averaged over ranks, and for DiLoCo also
``val_loss_global`` of the global copies (the last agreed weights of every fragment).
``wire_ratio_vs_ddp`` and ``val_loss_ratio_vs_ddp`` compare with the ``ddp`` run.
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/demo.toml", help="trainer config (the demo model)")
    p.add_argument("--steps", type=int, default=300, help="inner (optimizer) steps per run")
    p.add_argument("--sync-every", default="32", help="H; comma-separated for several DiLoCo runs")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--delay", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.0)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--wires", default="fp32,fp8,int8", help="comma-separated DiLoCo wire formats")
    p.add_argument("--block-size", type=int, default=256)
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

    base = load_config(opts["config"] if Path(opts["config"]).is_file() else None)
    base.run.steps = opts["steps"]
    base.run.world_size = env.world_size
    base.run.log_every = 1
    base.run.val_every = 0
    base.run.val_batches = opts["val_batches"]
    base.run.seed = opts["seed"]
    base.run.threads = opts.get("threads") or 1
    wires = [w for w in str(opts["wires"]).split(",") if w]
    runs: list[tuple[str, Any]] = []
    ddp = copy.deepcopy(base)
    ddp.strategy.name = "ddp"
    runs.append(("ddp", ddp))
    hs = [int(h) for h in str(opts["sync_every"]).split(",") if h]
    for h in hs:
        for w in wires:
            c = copy.deepcopy(base)
            c.strategy.name = "diloco"
            d = c.diloco
            d.sync_every, d.fragments, d.delay, d.alpha = h, opts["fragments"], opts["delay"], opts["alpha"]
            d.outer_lr, d.outer_momentum, d.wire, d.block_size = (opts["outer_lr"], opts["outer_momentum"], w,
                                                                  opts["block_size"])
            runs.append((f"diloco-H{h}-{w}" if len(hs) > 1 else f"diloco-{w}", c))
    for _, c in runs:
        validate(c, world_size=env.world_size)  # every rank alike, before any training collective
    ledger = env.ledger
    results = []
    for name, c in runs:
        start = len(ledger.records)
        res = train(c, env, write_run_dir=False, log=False)
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
            row.update(sync_every=c.diloco.sync_every, fragments=c.diloco.fragments, delay=c.diloco.delay,
                       wire=c.diloco.wire, outer_steps=strategy.diloco.committed,
                       val_loss_global=_global_val_loss(strategy, c, env))
            strategy.diloco.close()
        results.append(row)
        del strategy, res
    ref = results[0]
    for r in results:
        r["wire_ratio_vs_ddp"] = (r["wire_bytes_per_step_per_rank"] / ref["wire_bytes_per_step_per_rank"]
                                  if ref["wire_bytes_per_step_per_rank"] else None)
        r["val_loss_ratio_vs_ddp"] = r["val_loss"] / ref["val_loss"] if ref["val_loss"] else None
        if "sync_every" in r:
            h = r["sync_every"]
            r["wire_target"] = 1 / h if r["wire"] in ("fp32", "bf16") else 1 / (4 * h)
    add_ratios(results, {r["name"]: ["ddp"] for r in results if r["name"] != "ddp"})
    keys = ("sync_every", "fragments", "delay", "alpha", "outer_lr", "outer_momentum", "block_size")
    return {"config": {"base_config": opts["config"], "steps": opts["steps"], "model": vars(base.model),
                       "batch_size_per_rank": base.data.batch_size, "seq_len": base.model.seq_len,
                       "diloco": {k: opts[k] for k in keys}, "val_batches": opts["val_batches"],
                       "threads_per_rank": base.run.threads,
                       "note": "runs are sequential full trainings, not alternated; step times indicative"},
            "results": results}
