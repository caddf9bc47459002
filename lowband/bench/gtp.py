"""``gtp`` suite: the ``gtp`` strategy (fp32 / bf16 / fp8 gathers; AdamW or Muon) vs FSDP2 and a naive GTP + Muon.

FSDP2 contender: ``fully_shard`` on every transformer block, then on the root, all with
``reshard_after_forward=True`` (ZeRO-3: gather in forward, re-gather in backward, reduce-scatter),
torch AdamW (foreach) on the DTensor shards, ``clip_grad_norm_``. GTP contenders: the ``gtp``
trainer strategy with ``gtp.size = world`` (every ``nn.Linear`` weight sharded, embeddings and norms
replicated), gather format native (fp32), bf16 or fp8 (e4m3, 32x32 blocks by default).

Muon contenders (issue 15): ``gtp-muon`` is the ``gtp`` strategy with ``gtp.optimizer = "muon"``
(:class:`lowband.optim.gtp_muon.GTPMuon`: whole matrices routed to owner ranks by two all-to-alls);
``gtp-muon-naive`` is the same GTP model whose Muon step all-gathers every matrix's full gradient on
every rank, keeps full momentum everywhere and orthogonalizes every matrix on every rank
(:mod:`lowband.bench.gtp_muon_naive`; tested equal to ``gtp-muon`` in float64). Both use
``sharded-muon``'s hyper-parameters (``--muon-lr``, Newton-Schulz in ``--muon-ns-dtype``).
``optimizer_step_bytes_per_step_per_rank`` = the ledger bytes of the optimizer step alone;
``optimizer_state_bytes_max_rank`` / ``peak_memory_bytes_max_rank`` = the largest over the ranks (Muon
ownership is balanced by Newton-Schulz cost, not bytes); ``optimizer_state_ratio_vs_ddp_muon`` = that
max over ``ddp_muon_state_bytes_per_rank``, the state of the dp suite's ``ddp-muon`` on the same model
(a momentum per Muon matrix + two AdamW moments per other parameter, whole on every rank).

Every contender trains its own copy of the same model on the same synthetic batches; steps alternate
(``timed_alternating``); the step time is the slowest rank's, median over repeats.

Reported per contender:

* ``wire_bytes_per_step_per_rank``: ring-model bytes. GTP: from the lowband ledger. FSDP2's
  collectives bypass lowband.comm, so they are counted from its parameter groups: per group one
  all-gather in forward, one in backward and one reduce-scatter, each ``(N-1)/N`` of the group's
  padded bytes (dim 0 padded to a multiple of N, as FSDP2 does), plus the grad-norm scalar.
* ``gather_bytes_per_step_per_rank`` / ``reduce_bytes_per_step_per_rank`` and the same restricted to
  the linear weights (``linear_*``), which both schemes shard identically, so with fp32 gathers
  ``linear_wire`` must be equal;
* ``peak_memory_bytes``: CUDA max allocated, or on CPU the peak of live tensor bytes during one
  extra step measured with ``torch.distributed._tools.mem_tracker.MemTracker`` (params, grads,
  optimizer state, gathered weights, activations, comm buffers allocated in Python; the GTP buffer
  pool is emptied first so its buffers are allocated, hence counted, inside the measured step).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lowband.bench.dp import Batches, bench_config
from lowband.bench.gtp_muon_naive import muon_names, naive_gtp_muon
from lowband.bench.harness import add_ratios, max_over_ranks, result_row, timed_alternating
from lowband.comm import ring_wire_bytes
from lowband.parallel.gtp import GTPEmbedding, gather_buffer_bytes
from lowband.train.config import Config
from lowband.train.env import DistEnv
from lowband.train.trainer import build_model

CONTENDER_NAMES = ("fsdp2", "gtp", "gtp-bf16", "gtp-fp8", "gtp-muon", "gtp-muon-naive")


PAIRED_BASELINES: dict[str, list[str]] = {"gtp-muon": ["gtp-muon-naive", "gtp"], "gtp-muon-naive": ["gtp"],
                                          "gtp-compiled": ["gtp"]}
"""Ratios every run reports when both rows are present: gtp-muon against the naive GTP + Muon (the same
optimizer, issue 15's target) and each Muon row against AdamW GTP (Muon's own compute cost)."""


def default_contenders() -> tuple[str, ...]:
    """The full comparison of docs/PERFORMANCE.md's gtp section (``gtp-muon`` where the build has it)."""
    return tuple(c for c in CONTENDER_NAMES if c != "gtp-muon" or gtp_has_muon())


def gtp_has_muon() -> bool:
    """Whether strategy ``gtp`` takes ``gtp.optimizer = "muon"`` in this build."""
    from lowband.train.strategies.gtp import GTPConfig

    return "optimizer" in {f.name for f in dataclasses.fields(GTPConfig)}


QUICK = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "batch_size": 2, "fp8_block": 16}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contenders", default=",".join(default_contenders()),
                   help=f"comma-separated subset of {', '.join(CONTENDER_NAMES)}")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--fp8-block", type=int, default=32)
    p.add_argument("--muon-bucket-mb", type=float, default=4.0,
                   help="gtp.muon_bucket_mb: gtp-muon's routing bucket (whole-matrix MB per all-to-all pair)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--muon-lr", type=float, default=0.02, help="optim.muon_lr of the Muon contenders")
    p.add_argument("--muon-ns-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="Newton-Schulz dtype of the Muon contenders (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--baseline", default="fsdp2")
    p.add_argument("--compile", action="store_true",
                   help="also run gtp-compiled (gtp with run.compile: inductor, per block) where gtp is named, "
                   "paired with gtp in ratio_vs (compile time excluded: warm-up steps)")


@dataclasses.dataclass
class _Runner:
    name: str
    step: Callable[[int], float]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    bytes_fn: Callable[[], dict[str, int]]
    before_mem: Callable[[], None] = lambda: None
    state_bytes: Callable[[], int] | None = None
    """Optimizer-state bytes on this rank (default: every state tensor of ``optimizer`` with a dimension)."""


def _linear_names(model: nn.Module) -> set[str]:
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _fsdp2(cfg: Config, env: DistEnv, batches: Batches) -> _Runner:
    from torch.distributed.fsdp import fully_shard

    model = build_model(cfg, env.device)
    linear = _linear_names(model)
    n = env.world_size
    groups: list[list[tuple[str, torch.Tensor]]] = []
    claimed: set[str] = set()
    for i, block in enumerate(model.blocks):
        groups.append([(f"blocks.{i}.{pn}", p) for pn, p in block.named_parameters()])
        claimed |= {name for name, _ in groups[-1]}
    groups.append([(pn, p) for pn, p in model.named_parameters() if pn not in claimed])
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)

    def padded_bytes(p: torch.Tensor) -> int:
        rows = p.shape[0]
        rest = p.numel() // rows
        return -(-rows // n) * n * rest * 4

    def count() -> dict[str, int]:
        ag = rs = lin_ag = lin_rs = 0
        for grp in groups:
            gb = sum(padded_bytes(p) for _, p in grp)
            lb = sum(padded_bytes(p) for name, p in grp if name in linear)
            ag += 2 * ring_wire_bytes("all_gather", n, gb)
            rs += ring_wire_bytes("reduce_scatter", n, gb)
            lin_ag += 2 * ring_wire_bytes("all_gather", n, lb)
            lin_rs += ring_wire_bytes("reduce_scatter", n, lb)
        norm = ring_wire_bytes("all_reduce", n, 4)  # grad-norm scalar
        return {"wire": ag + rs + norm, "gather": ag, "reduce": rs, "linear_gather": lin_ag,
                "linear_reduce": lin_rs}

    def step(i: int) -> float:
        x, y = batches.get(i)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return _Runner("fsdp2", step, model, opt, count)


def _gtp(gather: str, label: str, optimizer: str = "adamw",
         compiled: bool = False) -> Callable[[Config, DistEnv, Batches], _Runner]:
    """A ``gtp`` strategy contender: AdamW, ``gtp.optimizer = "muon"`` (``optimizer="muon"``), or the
    naive Muon baseline (``optimizer="muon-naive"``: :mod:`lowband.bench.gtp_muon_naive`); ``compiled``:
    the trainer's ``run.compile`` (each block compiled by inductor after sharding)."""

    def make(cfg: Config, env: DistEnv, batches: Batches) -> _Runner:
        from lowband.train.strategies import get_strategy_class
        from lowband.train.strategies.sharded import muon_ns_dtype

        gtp_cfg = dataclasses.replace(cfg.gtp, gather=gather)
        if optimizer == "muon":
            if not gtp_has_muon():
                raise ValueError(f"gtp suite: contender {label} needs strategy gtp with optimizer = 'muon' "
                                 "(GTPConfig.optimizer), which this build does not have")
            gtp_cfg = dataclasses.replace(gtp_cfg, optimizer="muon")
        cfg = dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, name="gtp"), gtp=gtp_cfg)
        strat = get_strategy_class("gtp")(cfg, env)
        model = build_model(cfg, env.device)
        names = muon_names(model)
        strat.setup(model)
        if compiled:
            from lowband.train.compiling import compile_model

            compile_model(strat.model)
        if optimizer == "muon-naive":
            strat.optimizer = naive_gtp_muon(strat.model, names, strat.runtime.comm, cfg.optim,
                                             muon_ns_dtype(cfg.optim.muon_ns_dtype, env.device))
        ledger = env.ledger
        last: dict[str, int] = {}

        def step(i: int) -> float:
            start = len(ledger.records)
            x, y = batches.get(i)
            with strat.microbatch(last=True):
                loss = strat.model(x, y)
                loss.backward()
            strat.clip_grad_norm(cfg.optim.grad_clip)
            opt_start = len(ledger.records)
            strat.optimizer_step()
            recs = ledger.records[start:]
            last.clear()
            last["wire"] = sum(r.wire_bytes for r in recs)
            last["optimizer"] = sum(r.wire_bytes for r in ledger.records[opt_start:])
            last["gather"] = sum(r.wire_bytes for r in recs if r.tag.startswith("gtp:ag"))
            last["reduce"] = sum(r.wire_bytes for r in recs if r.tag == "gtp:rs")
            # the token embedding is GTP-sharded too (forward gather + reduce-scatter, no backward
            # gather); take its exact share out to compare the nn.Linear weights with FSDP2's
            emb_ag = emb_rs = 0
            rt = strat.runtime
            for m in strat.model.modules():
                if isinstance(m, GTPEmbedding):
                    emb_ag += ring_wire_bytes("all_gather", rt.size, gather_buffer_bytes(rt, m.gtp))
                    emb_rs += ring_wire_bytes("reduce_scatter", rt.size,
                                              m.gtp.padded_out * m.gtp.in_features * m.weight.element_size())
            last["linear_gather"], last["linear_reduce"] = last["gather"] - emb_ag, last["reduce"] - emb_rs
            return float(loss.detach())

        def before_mem() -> None:
            strat.runtime.cache.clear()

        def state_bytes() -> int:
            opt = strat.optimizer
            if hasattr(opt, "state"):
                return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                           if isinstance(t, torch.Tensor) and t.dim() > 0)
            return strat.optimizer_state_bytes()

        return _Runner(label, step, strat.model, strat.optimizer, lambda: dict(last), before_mem, state_bytes)

    return make


def replicated_muon_state_bytes(cfg: Config) -> int:
    """Optimizer-state bytes per rank of ``ddp-muon`` (dp suite) on this model: a momentum buffer per
    Muon matrix and two AdamW moments per other parameter, all whole (every rank holds all of it)."""
    model = build_model(cfg, torch.device("cpu"))
    names = muon_names(model)
    return sum(p.numel() * p.element_size() * (1 if n in names else 2) for n, p in model.named_parameters()
               if p.requires_grad)


FACTORIES: dict[str, Callable[[Config, DistEnv, Batches], _Runner]] = {
    "fsdp2": _fsdp2, "gtp": _gtp("native", "gtp"), "gtp-bf16": _gtp("bf16", "gtp-bf16"),
    "gtp-fp8": _gtp("fp8", "gtp-fp8"), "gtp-muon": _gtp("native", "gtp-muon", "muon"),
    "gtp-muon-naive": _gtp("native", "gtp-muon-naive", "muon-naive"),
}

COMPILED: dict[str, Callable[[Config, DistEnv, Batches], _Runner]] = {
    "gtp-compiled": _gtp("native", "gtp-compiled", compiled=True),
}
"""``--compile``: ``gtp`` with ``run.compile = true`` too (inductor, per block, after sharding; compile time
falls in the untimed warm-up steps), paired with ``gtp`` in ``ratio_vs``."""


def _peak_memory(r: _Runner, env: DistEnv, step_index: int) -> int:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
        r.step(step_index)
        torch.cuda.synchronize(env.device)
        return int(torch.cuda.max_memory_allocated(env.device))
    from torch.distributed._tools.mem_tracker import MemTracker

    r.before_mem()
    mt = MemTracker()
    opts = getattr(r.optimizer, "optimizers", (r.optimizer,))  # OptimizerPair: track each
    mt.track_external(r.model, *[o for o in opts if isinstance(o, torch.optim.Optimizer)])
    with mt:
        r.step(step_index)
    snap = mt.get_tracker_snapshot("peak")
    return int(max(v.get("Total", 0) for v in snap.values()))


def run(env: DistEnv, opts: dict[str, Any]) -> dict[str, Any]:
    names = [c for c in str(opts["contenders"]).split(",") if c]
    unknown = [c for c in names if c not in FACTORIES]
    if unknown:
        raise ValueError(f"gtp suite: unknown contenders {unknown}; allowed: {', '.join(FACTORIES)}")
    if opts.get("compile"):
        names += [f"{n}-compiled" for n in names if f"{n}-compiled" in COMPILED]
    cfg = bench_config({**opts, "bigram_rows": 0, "bucket_mb": 25.0}, env.world_size)
    cfg.gtp.fp8_block = opts["fp8_block"]
    cfg.gtp.muon_bucket_mb = opts["muon_bucket_mb"]
    batches = Batches(cfg, env)
    runners = {n: {**FACTORIES, **COMPILED}[n](cfg, env, batches) for n in names}
    counters = {n: 0 for n in names}
    losses: dict[str, float] = {}

    def make(n: str) -> Callable[[], None]:
        def fn() -> None:
            losses[n] = runners[n].step(counters[n])
            counters[n] += 1
        return fn

    sync = (lambda: torch.cuda.synchronize(env.device)) if env.device.type == "cuda" else None
    times = timed_alternating({n: make(n) for n in names}, opts["repeats"], opts["warmup"], env.metrics_comm,
                              sync)
    results = []
    for n in names:
        r = runners[n]
        counts = r.bytes_fn()
        peak = _peak_memory(r, env, counters[n])
        counters[n] += 1
        state = r.state_bytes() if r.state_bytes is not None else sum(
            t.numel() * t.element_size() for st in r.optimizer.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0)
        if n == "fsdp2":  # DTensor states: local shard bytes
            state = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
                        for st in r.optimizer.state.values() for t in st.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)
        state_max = max_over_ranks(state, env.metrics_comm)
        peak_max = max_over_ranks(peak, env.metrics_comm)
        loss_t = torch.tensor(losses.get(n, float("nan")), dtype=torch.float64)
        env.metrics_comm.all_reduce(loss_t, "avg")
        results.append(result_row(n, times[n], wire_bytes=counts["wire"], optimizer_state_bytes=state,
                                  optimizer_state_bytes_max_rank=state_max, peak_memory_bytes_max_rank=peak_max,
                                  peak_memory_bytes=peak, final_loss=float(loss_t), steps=counters[n],
                                  gather_bytes_per_step_per_rank=counts["gather"],
                                  reduce_bytes_per_step_per_rank=counts["reduce"],
                                  linear_gather_bytes_per_step_per_rank=counts["linear_gather"],
                                  linear_reduce_bytes_per_step_per_rank=counts["linear_reduce"],
                                  optimizer_step_bytes_per_step_per_rank=counts.get("optimizer", 0)))
    bases = [b for b in str(opts["baseline"]).split(",") if b]
    add_ratios(results, {n: [b for b in bases if b != n] + [b for b in PAIRED_BASELINES.get(n, [])
                                                            if b not in bases] for n in names})
    by = {r["name"]: r for r in results}
    ddp_muon_state = replicated_muon_state_bytes(cfg)
    for r in results:
        if r["name"] in ("gtp-muon", "gtp-muon-naive"):
            # issue 15: gtp with Muon holds <= 1/N of ddp-muon's state (+ padding rows)
            r["ddp_muon_state_bytes_per_rank"] = ddp_muon_state
            r["optimizer_state_ratio_vs_ddp_muon"] = r["optimizer_state_bytes_max_rank"] / ddp_muon_state
    if "gtp-muon" in by and "gtp-muon-naive" in by:
        fast, naive = by["gtp-muon"], by["gtp-muon-naive"]
        fast["memory_ratio_vs_gtp_muon_naive"] = (fast["peak_memory_bytes_max_rank"]
                                                  / max(1, naive["peak_memory_bytes_max_rank"]))
        fast["optimizer_state_ratio_vs_gtp_muon_naive"] = (fast["optimizer_state_bytes_per_rank"]
                                                           / max(1, naive["optimizer_state_bytes_per_rank"]))
    if "fsdp2" in by:
        base = by["fsdp2"]
        for r in results:
            if r["name"] == "fsdp2":
                continue
            r["memory_ratio_vs_fsdp2"] = r["peak_memory_bytes"] / max(1, base["peak_memory_bytes"])
            r["wire_ratio_vs_fsdp2"] = (r["wire_bytes_per_step_per_rank"]
                                        / max(1, base["wire_bytes_per_step_per_rank"]))
            r["linear_gather_ratio_vs_fsdp2_fp32"] = (r["linear_gather_bytes_per_step_per_rank"]
                                                      / max(1, base["linear_gather_bytes_per_step_per_rank"]))
            lin = ("linear_gather_bytes_per_step_per_rank", "linear_reduce_bytes_per_step_per_rank")
            r["linear_wire_equal_fsdp2"] = sum(r[k] for k in lin) == sum(base[k] for k in lin)
    nparams = sum(p.numel() for p in build_model(cfg, torch.device("cpu")).parameters())
    return {"config": {"model": dataclasses.asdict(cfg.model), "batch_size_per_rank": cfg.data.batch_size,
                       "params": nparams, "contenders": names, "repeats": opts["repeats"],
                       "warmup": opts["warmup"], "threads_per_rank": opts.get("threads"),
                       "fp8_block": opts["fp8_block"], "optim": dataclasses.asdict(cfg.optim),
                       "memory_method": "cuda max_memory_allocated" if env.device.type == "cuda"
                       else "MemTracker peak of live tensor bytes over one extra step"},
            "results": results}
