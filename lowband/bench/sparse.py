"""``sparse`` suite: the bigram table's gradient reduce-scatter, row-sparse against dense, in a real
training step of the demo model under the sharded optimizer.

Contenders (same model, seed and batches; steps alternate):

* ``dense``: ``sparse.tables = ["bigram"]`` with ``sparse.mode = "dense"`` (the table is its own
  row-aligned unit; its gradient travels by a dense reduce-scatter, tag ``sparse:bigram:dense``);
* ``sparse``: the same with ``sparse.mode = "sparse"`` (count all-gather + index and row all-to-alls);
* ``auto``: the density-adaptive choice.

Each step passes the host batch to ``strategy.observe_batch`` first, as the trainer does. Reported per
contender, besides the shared fields: ``table_wire_bytes`` (median over timed steps of the bytes per
rank under the ``sparse:bigram`` tag, counts included), ``table_dense_bytes`` (the dense reduce-scatter
of the padded table), ``touched_fraction`` (median unique rows touched per rank / rows),
``index_overhead`` (index bytes / row bytes), ``table_bytes_bound`` = ``touched_fraction * 1.1 +
index_overhead`` and ``table_bytes_ratio`` = ``table_wire_bytes / table_dense_bytes``, which the
acceptance check wants at most ``table_bytes_bound``; ``table_exchange_s_median``: the table's
gradient exchange alone (count all-gather + sparse or dense reduce-scatter + merge, on a gradient
with one batch's touched rows), timed alternating over ``3 x repeats`` samples, because on a busy CPU
the whole-step medians are dominated by compute noise.

Data: the built-in corpus (as the demo trains), or ``--data random`` (uniform tokens 0..255: the worst
case for a hashed table, every bigram distinct).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import numpy as np
import torch

from lowband.bench.harness import add_ratios, result_row, timed_alternating
from lowband.train.config import Config
from lowband.train.env import DistEnv
from lowband.train.trainer import build_model

CONTENDERS = ("dense", "sparse", "auto")


QUICK = {"bigram_rows": 256, "n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "batch_size": 2}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated of {CONTENDERS}")
    p.add_argument("--strategy", default="sharded-adamw", choices=["sharded-adamw", "sharded-muon"])
    p.add_argument("--bigram-rows", type=int, default=65536)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--data", default="builtin", choices=["builtin", "random"])
    p.add_argument("--grad-wire-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--baseline", default="dense")


def bench_config(opts: dict[str, Any], world: int) -> Config:
    """The demo model (configs/demo.toml sizes) with a large bigram table."""
    cfg = Config()
    cfg.run.world_size = world
    cfg.run.steps = 10**6
    m = cfg.model
    m.vocab_size, m.seq_len, m.n_layer = 320, opts["seq_len"], opts["n_layer"]
    m.n_head, m.n_embd, m.bigram_rows = opts["n_head"], opts["n_embd"], opts["bigram_rows"]
    cfg.data.batch_size = opts["batch_size"]
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.grad_clip = 3e-3, 0, 1.0
    cfg.strategy.name = opts["strategy"]
    cfg.strategy.grad_wire_dtype = opts["grad_wire_dtype"]
    cfg.sparse.tables = ["bigram"]
    return cfg


def _batches(cfg: Config, env: DistEnv, source: str):
    if source == "random":
        def get(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            b, t, n = cfg.data.batch_size, cfg.model.seq_len, env.world_size
            g = torch.Generator().manual_seed(10_000 + step)
            tok = torch.randint(0, 256, (b * n, t + 1), generator=g)[env.rank * b:(env.rank + 1) * b]
            return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        return get
    from lowband.data import DistributedLoader
    from lowband.train.trainer import load_token_arrays

    train, _ = load_token_arrays(cfg, env)
    loader = DistributedLoader(train, cfg.data.batch_size, cfg.model.seq_len, env.rank, env.world_size,
                               seed=cfg.run.seed)
    return loader.batch


def run(env: DistEnv, opts: dict[str, Any]) -> dict[str, Any]:
    from lowband.train.strategies import get_strategy_class

    names = [c for c in str(opts["contenders"]).split(",") if c]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"sparse suite: unknown contenders {unknown}; allowed: {', '.join(CONTENDERS)}")
    if opts["bigram_rows"] < 2:
        raise ValueError(f"sparse suite: --bigram-rows must be >= 2, got {opts['bigram_rows']}")
    cfg = bench_config(opts, env.world_size)
    get = _batches(cfg, env, opts["data"])
    ledger = env.ledger
    strategies, counters = {}, {n: 0 for n in names}
    table_bytes: dict[str, list[int]] = {n: [] for n in names}
    wire: dict[str, list[int]] = {n: [] for n in names}
    density: dict[str, list[float]] = {n: [] for n in names}
    modes: dict[str, list[str]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    for n in names:
        c = dataclasses.replace(cfg, sparse=dataclasses.replace(cfg.sparse, mode=n))
        s = get_strategy_class(c.strategy.name)(c, env)
        s.setup(build_model(c, env.device))
        strategies[n] = s

    def make(n: str):
        s = strategies[n]

        def fn() -> None:
            ledger.mark_step()
            x, y = get(counters[n])
            s.observe_batch(x)
            x, y = x.to(env.device), y.to(env.device)
            with s.microbatch(last=True):
                loss = s.model(x, y)
                loss.backward()
            s.clip_grad_norm(cfg.optim.grad_clip)
            s.optimizer_step()
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            losses[n] = float(loss.detach())
            counters[n] += 1
            recs = ledger.step_records()
            table_bytes[n].append(sum(r.wire_bytes for r in ledger.select(tag="sparse:bigram", records=recs)))
            wire[n].append(ledger.mark_step().wire_bytes)
            st = s.optimizer.sparse_stats()["bigram"]
            density[n].append(st.density)
            modes[n].append(st.mode)
        return fn

    times = timed_alternating({n: make(n) for n in names}, opts["repeats"], opts["warmup"], env.metrics_comm)
    xtimes = _exchange_times(names, strategies, get, counters, env, opts)
    results = []
    su = next(iter(strategies.values())).optimizer.sparse_units["bigram"].exchange
    wire_dtype = torch.bfloat16 if opts["grad_wire_dtype"] == "bfloat16" else torch.float32
    row_b, idx_b = su.row_bytes(wire_dtype), su.index_bytes()
    dense_b = su.dense_bytes(wire_dtype)
    for n in names:
        s = strategies[n]
        w = opts["warmup"]
        tb = int(statistics.median(table_bytes[n][w:] or table_bytes[n]))
        frac = float(statistics.median(density[n][w:] or density[n]))
        loss_t = torch.tensor(losses.get(n, float("nan")), dtype=torch.float64)
        env.metrics_comm.all_reduce(loss_t, "avg")
        bound = frac * 1.1 + idx_b / row_b
        results.append(result_row(
            n, times[n], wire_bytes=int(statistics.median(wire[n][w:] or wire[n])),
            optimizer_state_bytes=s.optimizer_state_bytes(), peak_memory_bytes=0, final_loss=float(loss_t),
            steps=counters[n], table_wire_bytes=tb, table_dense_bytes=dense_b, touched_fraction=frac,
            index_overhead=idx_b / row_b, table_bytes_ratio=tb / dense_b if dense_b else 0.0,
            table_bytes_bound=bound, modes=sorted(set(modes[n])),
            table_exchange_s_median=statistics.median(xtimes[n]), table_exchange_s=xtimes[n]))
    bases = [b for b in str(opts["baseline"]).split(",") if b]
    add_ratios(results, {n: [b for b in bases if b != n] for n in names})
    return {"config": {"model": dataclasses.asdict(cfg.model), "strategy": cfg.strategy.name,
                       "batch_size_per_rank": cfg.data.batch_size, "data": opts["data"],
                       "grad_wire_dtype": opts["grad_wire_dtype"], "repeats": opts["repeats"],
                       "warmup": opts["warmup"], "threads_per_rank": opts.get("threads"),
                       "peak_memory": "not measured (0)"},
            "results": results}


def _exchange_times(names: list[str], strategies: dict, get, counters: dict[str, int], env: DistEnv,
                    opts: dict[str, Any]) -> dict[str, list[float]]:
    """The table's gradient exchange alone (count all-gather + sparse or dense reduce-scatter + merge),
    timed alternating like the steps: the part the contenders differ in, without the compute noise.
    The gradient has the next batch's touched rows (random values), the rest zero."""
    from lowband.model.bigram import bigram_hash_np

    ex0 = strategies[names[0]].optimizer.sparse_units["bigram"].exchange
    x, _ = get(max(counters.values()))
    rows = np.unique(bigram_hash_np(x.numpy(), ex0.rows))
    g = torch.Generator().manual_seed(env.rank)
    grad = torch.zeros(ex0.rows, ex0.dim)
    grad[torch.from_numpy(rows)] = torch.randn(len(rows), ex0.dim, generator=g)
    grad = grad.to(env.device)
    out = torch.empty(ex0.rows_per_rank * ex0.dim, device=env.device)

    def make(n: str):
        ex = strategies[n].optimizer.sparse_units["bigram"].exchange

        def fn() -> None:
            ex.reduce_scatter(out, grad, ex.plan(rows), op="avg")
        return fn

    sync = (lambda: torch.cuda.synchronize(env.device)) if env.device.type == "cuda" else None
    return timed_alternating({n: make(n) for n in names}, opts["repeats"] * 3, opts["warmup"], env.metrics_comm, sync)
