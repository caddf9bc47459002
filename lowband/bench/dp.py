"""``dp`` suite: data-parallel training step, contender against contender, on the reference GPT.

Every contender trains its own copy of the same model (same seed) on the same synthetic token
batches (each rank its slice of the global batch); steps alternate between contenders. Reported per
contender: median step time (slowest rank), wire bytes per step per rank (from the lowband ledger,
or the contender's own count for torch-internal collectives), optimizer-state bytes per rank, peak
memory (CUDA: max allocated during its steps; CPU: resident tensor bytes = params + grads + optimizer
state + persistent comm buffers, since the process RSS cannot be split between contenders), and the
final loss.

Contenders register in ``CONTENDERS`` (name -> factory); any trainer strategy is a contender through
:class:`StrategyContender`. With no ``--contenders`` every registered contender runs
(:data:`DEFAULT_CONTENDERS`, the full comparison of docs/PERFORMANCE.md).

Muon (issue 15): lowband's ``sharded-muon`` against torch's Muon baselines ``ddp-muon`` and
``fsdp2-muon`` (:mod:`lowband.bench.dp_torch`, :mod:`lowband.bench.torch_muon`): the same optimizer,
hyper-parameters and Newton-Schulz dtype (``--muon-ns-dtype``). Every run reports, where both rows are
present, lowband's Muon against torch's and each Muon row against its AdamW counterpart
(:data:`PAIRED_BASELINES`, in ``ratio_vs``), and ``optimizer_state_ratio_vs`` for the same pairs;
``optimizer_state_bytes_max_rank`` is the largest over the ranks (Muon ownership is by whole matrices).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from lowband.bench.harness import add_ratios, add_state_ratios, max_over_ranks, result_row, timed_alternating
from lowband.train.config import Config
from lowband.train.env import DistEnv
from lowband.train.strategies.base import Strategy
from lowband.train.trainer import build_model

QUICK = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "batch_size": 2}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The dp suite's own options (``python -m lowband.bench dp --help``)."""
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--bigram-rows", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--muon-lr", type=float, default=0.02, help="optim.muon_lr of every Muon contender")
    p.add_argument("--muon-ns-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="Newton-Schulz dtype of every Muon contender (auto: float32 on CPU, bfloat16 on GPU; "
                   "torch.optim.Muon is made to follow it, see lowband.bench.torch_muon)")
    p.add_argument("--baseline", default="ddp", help="contender(s) the ratios are computed against")
    p.add_argument("--compile", action="store_true",
                   help="also run the run.compile twin (inductor, per block) of ddp and sharded-adamw where named, "
                   "paired with the eager row in ratio_vs (compile time excluded: warm-up steps)")


def bench_config(opts: dict[str, Any], world: int) -> Config:
    cfg = Config()
    cfg.run.world_size = world
    cfg.run.steps = 10**6
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = opts["n_layer"], opts["n_embd"], opts["n_head"]
    cfg.model.seq_len, cfg.model.vocab_size = opts["seq_len"], opts["vocab_size"]
    cfg.model.bigram_rows = opts["bigram_rows"]
    cfg.data.batch_size = opts["batch_size"]
    cfg.strategy.bucket_mb = opts["bucket_mb"]
    cfg.optim.lr = opts["lr"]
    cfg.optim.muon_lr = opts.get("muon_lr", cfg.optim.muon_lr)
    cfg.optim.muon_ns_dtype = opts.get("muon_ns_dtype", cfg.optim.muon_ns_dtype)
    cfg.optim.warmup_steps = 0
    cfg.optim.grad_clip = 1.0
    return cfg


class Batches:
    """Deterministic synthetic token batches; rank r gets rows [r*B, (r+1)*B) of global batch ``step``."""

    def __init__(self, cfg: Config, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, n = self.cfg.data.batch_size, self.cfg.model.seq_len, self.env.world_size
        g = torch.Generator().manual_seed(10_000 + step)
        tokens = torch.randint(0, 256, (b * n, t + 1), generator=g)
        mine = tokens[self.env.rank * b:(self.env.rank + 1) * b]
        return mine[:, :-1].to(self.env.device), mine[:, 1:].to(self.env.device)


@dataclasses.dataclass
class Contender:
    """One competitor: ``step(i)`` runs training step i and returns the local loss."""

    name: str
    step: Callable[[int], float]
    optimizer_state_bytes: Callable[[], int]
    resident_bytes: Callable[[], int]
    wire_bytes_per_step: Callable[[], int] | None = None
    """For contenders whose collectives bypass lowband.comm: bytes per step per rank (ring model)."""
    extra: Callable[[], dict[str, Any]] | None = None
    """Suite-specific fields added to the contender's result row."""


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def strategy_step(strategy: Strategy, cfg: Config) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """``step(x, y) -> local loss``: the trainer's own step on one microbatch (observe the batch for
    sparse tables, forward/backward under ``microbatch(last=True)``, clip, optimizer step); every suite's
    strategy contenders use it."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        strategy.observe_batch(x)
        with strategy.microbatch(last=True):
            loss = strategy.model(x, y)
            loss.backward()
        strategy.clip_grad_norm(cfg.optim.grad_clip)
        strategy.optimizer_step()
        return float(loss.detach())

    return step


def strategy_resident_bytes(strategy: Strategy) -> int:
    """Parameters + gradients + optimizer state + persistent comm buffers of a strategy on this rank."""
    params = list(strategy.unwrapped().parameters())
    extra = getattr(strategy, "persistent_buffer_bytes", lambda: 0)()
    return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + strategy.optimizer_state_bytes() + extra


class StrategyContender:
    """Wrap a trainer strategy (``lowband.train.strategies``) as a contender."""

    def __init__(self, strategy_name: str, label: str | None = None,
                 overrides: dict[str, dict[str, Any]] | None = None) -> None:
        self.strategy_name = strategy_name
        self.label = label or strategy_name
        self.overrides = overrides or {}

    def __call__(self, cfg: Config, env: DistEnv, batches: Batches) -> Contender:
        from lowband.train.strategies import get_strategy_class

        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run), model=dataclasses.replace(cfg.model),
                                  data=dataclasses.replace(cfg.data), optim=dataclasses.replace(cfg.optim),
                                  strategy=dataclasses.replace(cfg.strategy, name=self.strategy_name),
                                  sharded=dataclasses.replace(cfg.sharded))
        for section, values in self.overrides.items():
            for k, v in values.items():
                setattr(getattr(cfg, section), k, v)
        strategy = get_strategy_class(self.strategy_name)(cfg, env)
        strategy.setup(build_model(cfg, env.device))
        if cfg.run.compile:  # the trainer's run.compile: per block, after the strategy
            from lowband.train.compiling import compile_model

            compile_model(strategy.model)
        train = strategy_step(strategy, cfg)
        wire = getattr(strategy, "wire_bytes_per_step", None)
        return Contender(self.label, lambda i: train(*batches.get(i)), strategy.optimizer_state_bytes,
                         lambda: strategy_resident_bytes(strategy), wire)


def _lazy(module: str, factory: str) -> Callable[[Config, DistEnv, Batches], Contender]:
    def make(cfg: Config, env: DistEnv, batches: Batches) -> Contender:
        import importlib

        return getattr(importlib.import_module(module), factory)(cfg, env, batches)
    return make


CONTENDERS: dict[str, Callable[[Config, DistEnv, Batches], Contender]] = {
    "ddp": StrategyContender("ddp"),
    "ddp-bf16": StrategyContender("ddp", "ddp-bf16", {"strategy": {"grad_wire_dtype": "bfloat16"}}),
    "sharded-adamw": StrategyContender("sharded-adamw"),
    "sharded-adamw-bf16": StrategyContender("sharded-adamw", "sharded-adamw-bf16",
                                            {"strategy": {"grad_wire_dtype": "bfloat16"}}),
    "sharded-adamw-bf16all": StrategyContender("sharded-adamw", "sharded-adamw-bf16all",
                                               {"strategy": {"grad_wire_dtype": "bfloat16"},
                                                "sharded": {"param_wire_dtype": "bfloat16"}}),
    "sharded-adamw-fp8": StrategyContender("sharded-adamw", "sharded-adamw-fp8",
                                           {"strategy": {"grad_wire_dtype": "fp8"},
                                            "sharded": {"param_wire_dtype": "bfloat16"}}),
    "sharded-adamw-fp8-ef": StrategyContender("sharded-adamw", "sharded-adamw-fp8-ef",
                                              {"strategy": {"grad_wire_dtype": "fp8"},
                                               "sharded": {"param_wire_dtype": "bfloat16",
                                                           "grad_error_feedback": True}}),
    "sharded-adamw-p2p": StrategyContender("sharded-adamw", "sharded-adamw-p2p", {"sharded": {"exchange": "p2p"}}),
    "sharded-muon": StrategyContender("sharded-muon"),
    "zero": _lazy("lowband.bench.dp_torch", "zero_contender"),
    "fsdp2": _lazy("lowband.bench.dp_torch", "fsdp2_contender"),
    "ddp-muon": _lazy("lowband.bench.dp_torch", "ddp_muon_contender"),
    "fsdp2-muon": _lazy("lowband.bench.dp_torch", "fsdp2_muon_contender"),
}

NAMED_ONLY: tuple[str, ...] = ("sharded-adamw-fp8", "sharded-adamw-fp8-ef", "sharded-adamw-p2p")
"""Contenders run only when named (issue 24's fp8 gradients: ``--contenders ddp,sharded-adamw,sharded-adamw-fp8``)."""

DEFAULT_CONTENDERS: tuple[str, ...] = tuple(n for n in CONTENDERS if n not in NAMED_ONLY)
"""The full comparison of docs/PERFORMANCE.md's dp section: every registered contender but :data:`NAMED_ONLY`."""

COMPILED: dict[str, Callable[[Config, DistEnv, Batches], Contender]] = {
    "ddp-compiled": StrategyContender("ddp", "ddp-compiled", {"run": {"compile": True}}),
    "sharded-adamw-compiled": StrategyContender("sharded-adamw", "sharded-adamw-compiled", {"run": {"compile": True}}),
}
"""``--compile``: the ``run.compile = true`` twin of each named contender that has one (inductor, per block;
compile time falls in the untimed warm-up steps), paired with its eager row in ``ratio_vs``."""

PAIRED_BASELINES: dict[str, list[str]] = {
    "sharded-muon": ["ddp-muon", "fsdp2-muon", "sharded-adamw"],
    "fsdp2-muon": ["ddp-muon", "fsdp2"],
    "ddp-muon": ["ddp"],
    "ddp-compiled": ["ddp"],
    "sharded-adamw-compiled": ["sharded-adamw"],
}
"""Ratios every run reports when both rows are present (besides ``--baseline``): lowband's Muon against
torch's Muon baselines (the same optimizer), and each Muon row against its AdamW counterpart (Muon's
Newton-Schulz costs real compute, so that ratio measures the optimizer, not the distribution)."""


def run(env: DistEnv, opts: dict[str, Any]) -> dict[str, Any]:
    from lowband.bench.dp_torch import fsdp2_reduce_op
    from lowband.train.strategies.sharded import muon_ns_dtype

    names = [c for c in str(opts["contenders"]).split(",") if c]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"dp suite: unknown contenders {unknown}; allowed: {', '.join(CONTENDERS)}")
    if opts.get("compile"):
        names += [f"{n}-compiled" for n in names if f"{n}-compiled" in COMPILED]
    cfg = bench_config(opts, env.world_size)
    batches = Batches(cfg, env)
    contenders = {n: {**CONTENDERS, **COMPILED}[n](cfg, env, batches) for n in names}
    ledger = env.ledger
    counters = {n: 0 for n in names}
    wire: dict[str, list[int]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    peak: dict[str, int] = {n: 0 for n in names}

    def make(n: str) -> Callable[[], None]:
        c = contenders[n]

        def fn() -> None:
            ledger.mark_step()
            if env.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(env.device)
            losses[n] = c.step(counters[n])
            counters[n] += 1
            wire[n].append(ledger.mark_step().wire_bytes)
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
                peak[n] = max(peak[n], int(torch.cuda.max_memory_allocated(env.device)))
        return fn

    sync = (lambda: torch.cuda.synchronize(env.device)) if env.device.type == "cuda" else None
    times = timed_alternating({n: make(n) for n in names}, opts["repeats"], opts["warmup"], env.metrics_comm,
                              sync)
    results = []
    for n in names:
        c = contenders[n]
        wb = c.wire_bytes_per_step() if c.wire_bytes_per_step is not None else max(wire[n][-3:], default=0)
        loss_t = torch.tensor(losses.get(n, float("nan")), dtype=torch.float64)
        env.metrics_comm.all_reduce(loss_t, "avg")
        extra = c.extra() if c.extra is not None else {}
        state = c.optimizer_state_bytes()
        extra["optimizer_state_bytes_max_rank"] = max_over_ranks(state, env.metrics_comm)
        results.append(result_row(n, times[n], wire_bytes=wb, optimizer_state_bytes=state,
                                  peak_memory_bytes=peak[n] if env.device.type == "cuda" else c.resident_bytes(),
                                  final_loss=float(loss_t), steps=counters[n], **extra))
    bases = [b for b in str(opts["baseline"]).split(",") if b]
    add_ratios(results, {n: [b for b in bases if b != n] + [b for b in PAIRED_BASELINES.get(n, [])
                                                            if b not in bases] for n in names})
    add_state_ratios(results, {n: [b for b in bases if b != n] + PAIRED_BASELINES.get(n, []) for n in names})
    nparams = sum(p.numel() for p in build_model(cfg, torch.device("cpu")).parameters())
    return {"config": {"model": dataclasses.asdict(cfg.model), "batch_size_per_rank": cfg.data.batch_size,
                       "params": nparams, "contenders": names, "repeats": opts["repeats"],
                       "warmup": opts["warmup"], "threads_per_rank": opts.get("threads"),
                       "optim": dataclasses.asdict(cfg.optim),
                       "muon_ns_dtype_resolved": str(muon_ns_dtype(cfg.optim.muon_ns_dtype, env.device)),
                       "fsdp2_reduce_scatter_counted_as": fsdp2_reduce_op(),
                       "memory_method": "cuda max_memory_allocated" if env.device.type == "cuda"
                       else "resident tensor bytes: params + grads + optimizer state + persistent comm buffers"},
            "results": results}
