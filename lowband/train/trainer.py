"""The training loop shared by every strategy.

``train(cfg, env)`` builds the model (lowband's GPT, or the user's own from ``model_factory`` /
``model.factory``: :mod:`lowband.train.models`) and its plan, the data loaders
(each rank a disjoint slice of every global batch), the strategy (which distributes the model and
owns the optimizer), and runs ``run.steps`` optimizer steps with gradient accumulation, LR schedule,
clipping, validation and logging. It can be called in-process (tests) or from the CLI
(``python -m lowband.train``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lowband.plan import ModelPlan, plan_for
from lowband.train.checkpoint import TrainCheckpointer
from lowband.train.config import Config, ConfigError, to_toml
from lowband.train.env import DistEnv, init_distributed
from lowband.train.forward import lm_loss, resolve_convention
from lowband.train.guards import NonFiniteGuard, peer_failure_guard
from lowband.train.metrics import RunWriter, format_log_line, peak_memory_bytes
from lowband.train.models import DTYPES, ModelFactory, call_factory, check_plan, gpt_factory, load_factory
from lowband.train.strategies import get_strategy_class
from lowband.train.strategies.base import Strategy

__all__ = ["DTYPES", "TrainResult", "build_model", "build_model_and_plan", "evaluate", "train"]


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    final_val_loss: float | None
    run_dir: Path | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    strategy: Strategy | None = None
    start_step: int = 0
    """The step the run resumed from (0 = fresh start)."""
    skipped_steps: list[int] = field(default_factory=list)
    """1-based steps whose update the non-finite guard skipped (this run and the checkpointed part)."""
    stopped_by: int = 0
    """The signal that stopped the run early (after step ``steps``, every rank alike; 0 = not stopped)."""


def build_model(cfg: Config, device: torch.device) -> nn.Module:
    """The model ``cfg.model`` describes (the reference GPT unless ``model.factory`` names another),
    seeded by ``run.seed``, on ``device`` in ``run.dtype``."""
    return build_model_and_plan(cfg, device)[0]


def build_model_and_plan(cfg: Config, device: torch.device,
                         model_factory: ModelFactory | None = None) -> tuple[nn.Module, ModelPlan]:
    """(model, plan) from ``model_factory``, else ``model.factory``, else lowband's GPT
    (:func:`lowband.train.models.call_factory`)."""
    factory = model_factory or (load_factory(cfg.model.factory) if cfg.model.factory else gpt_factory)
    return call_factory(factory, cfg, device)


def load_token_arrays(cfg: Config, env: DistEnv) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation tokens: the built-in corpus (rank 0 builds the cache first) or .bin shards."""
    from lowband.data import builtin_corpus, load_tokens

    if cfg.data.source == "bin":
        train = load_tokens(cfg.data.train_bin)
        val = load_tokens(cfg.data.val_bin) if cfg.data.val_bin else train[-max(len(train) // 20, 1):]
        return train, val
    if env.world_size > 1 and env.rank != 0:
        env.metrics_comm.barrier(tag="corpus")
        return builtin_corpus()
    tokens = builtin_corpus()
    if env.world_size > 1:
        env.metrics_comm.barrier(tag="corpus")
    return tokens


def lr_factor(cfg: Config) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step ``s`` (0-based): linear warmup then the schedule."""
    o, total = cfg.optim, cfg.run.steps

    def f(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        span = max(total - o.warmup_steps, 1)
        t = min(max(step - o.warmup_steps, 0) / span, 1.0)
        if o.schedule == "linear":
            return 1.0 - (1.0 - o.min_lr_ratio) * t
        return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, batches: int, env: DistEnv, forward: str = "auto") -> float:
    """Mean validation loss over ``batches`` fixed batches per rank, averaged over ranks (``forward``: the
    model's loss convention, :mod:`lowband.train.forward`)."""
    was_training = model.training
    convention = resolve_convention(model, forward)
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(batches):
        x, y = loader.batch(i)
        total += lm_loss(model, x.to(env.device), y.to(env.device), convention).double().cpu()
    model.train(was_training)
    mean = total / batches
    env.metrics_comm.all_reduce(mean, "avg", tag="val")
    return float(mean)


def _set_threads(cfg: Config) -> None:
    threads = cfg.run.threads
    if threads == 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // max(local, 1))
    torch.set_num_threads(threads)


def _rows_before(path: Path, step: int) -> list[dict[str, Any]]:
    """The rows of an earlier ``metrics.jsonl`` up to ``step`` (empty if missing or unreadable)."""
    import json

    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("step", step + 1) <= step]


def train(cfg: Config, env: DistEnv | None = None, *, model_factory: ModelFactory | None = None,
          write_run_dir: bool = True, log: bool = True, stop_after: int | None = None) -> TrainResult:
    """Train per ``cfg``; returns the logged rows and final losses (rank 0 writes the run dir).

    ``model_factory(cfg)`` (or ``model.factory = "module:function"`` in the config) builds the model
    instead of lowband's GPT and may return ``(model, plan)``; see :mod:`lowband.train.models` and
    docs/adopt.md. Its forward convention is ``model.forward`` (:mod:`lowband.train.forward`).

    With ``[checkpoint] every > 0`` it resumes from the latest checkpoint and saves every ``every`` steps
    and at the end. ``stop_after`` ends the run after that many total steps (as a preemption would; a
    checkpoint is saved there when checkpointing is on); the LR schedule still spans ``run.steps``.
    A backend error from a dead or unresponsive peer is re-raised as ``PeerFailureError``.
    """
    env = env or init_distributed(cfg.run.device, cfg.run.timeout_s)
    with peer_failure_guard(env.rank, env.world_size, cfg.run.timeout_s):
        return _train(cfg, env, model_factory=model_factory, write_run_dir=write_run_dir, log=log,
                      stop_after=stop_after)


def _model_and_plan(cfg: Config, env: DistEnv, strategy_cls: type[Strategy],
                    model_factory: ModelFactory | None) -> tuple[nn.Module, ModelPlan]:
    """Build the model and check its plan for the strategy (every rank alike, before any collective)."""
    if model_factory is None and not cfg.model.factory:
        model = build_model(cfg, env.device)  # module-level lookup: tests may wrap build_model
        plan = plan_for(model)
    else:
        model, plan = build_model_and_plan(cfg, env.device, model_factory)
    try:
        check_plan(model, plan, need_parallel_linears=strategy_cls.name if strategy_cls.needs_parallel_linears
                   else None)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if plan.vocab_size is not None and cfg.data.source == "builtin" and plan.vocab_size < 258:
        raise ConfigError(f"the model's vocabulary ({plan.vocab_size}, from its plan) is smaller than the byte "
                          "tokenizer's 258 ids (data.source = builtin)")
    return model, plan


def _train(cfg: Config, env: DistEnv, *, model_factory: ModelFactory | None, write_run_dir: bool, log: bool,
           stop_after: int | None) -> TrainResult:
    from lowband.data import DistributedLoader

    _set_threads(cfg)
    strategy_cls = get_strategy_class(cfg.strategy.name)
    strategy_cls.validate_config(cfg, env.world_size)
    train_tokens, val_tokens = load_token_arrays(cfg, env)
    micro = cfg.data.batch_size // cfg.data.grad_accum
    loader = DistributedLoader(train_tokens, cfg.data.batch_size, cfg.model.seq_len, env.rank, env.world_size,
                               seed=cfg.run.seed)
    val_loader = DistributedLoader(val_tokens, micro, cfg.model.seq_len, env.rank, env.world_size,
                                   seed=cfg.run.seed + 1)
    model, plan = _model_and_plan(cfg, env, strategy_cls, model_factory)
    strategy = strategy_cls(cfg, env)
    strategy.plan = plan
    strategy.forward = resolve_convention(model, cfg.model.forward)
    strategy.setup(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(strategy.optimizer, lr_factor(cfg))
    guard = NonFiniteGuard(env.metrics_comm, cfg.guard.skip_nonfinite, cfg.guard.max_consecutive)
    checkpointer = TrainCheckpointer(cfg, env, strategy, schedule, loader, guard)
    start_step = checkpointer.resume()
    end_step = cfg.run.steps if stop_after is None else max(min(stop_after, cfg.run.steps), start_step)

    writer: RunWriter | None = None
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    if env.is_main and log and checkpointer.resumed_from is not None:
        print(f"lowband.train: resumed from {checkpointer.resumed_from.path} (step {start_step})", flush=True)
    if env.is_main and write_run_dir:
        earlier = _rows_before(run_dir / "metrics.jsonl", start_step) if start_step else []
        writer = RunWriter(run_dir)
        for row in earlier:  # a resumed run keeps the history up to its checkpoint
            writer.write(row)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    if env.is_main and log:
        nparams = sum(p.numel() for p in strategy.unwrapped().parameters())
        print(f"lowband.train: strategy {cfg.strategy.name} | world {env.world_size} | device "
              f"{env.device} | params {nparams:,} | tokens/step "
              f"{cfg.data.batch_size * cfg.model.seq_len * env.world_size:,}", flush=True)

    stopped_by = 0
    ledger = env.ledger
    ledger.mark_step()
    rows: list[dict[str, Any]] = []
    last_loss: float | None = None
    last_val: float | None = None
    global_tokens = cfg.data.batch_size * cfg.model.seq_len * env.world_size
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        x, y = loader.batch(step)
        strategy.observe_batch(x)
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for m in range(cfg.data.grad_accum):
            xs, ys = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
            with strategy.microbatch(last=m == cfg.data.grad_accum - 1):
                loss = lm_loss(strategy.model, xs, ys, strategy.forward)
                (loss / cfg.data.grad_accum).backward()
            loss_sum += loss.detach().double()
        grad_norm = strategy.clip_grad_norm(cfg.optim.grad_clip)
        lr = strategy.optimizer.param_groups[0]["lr"]
        verdict = guard.check(step + 1, loss_sum, grad_norm)  # same verdict on every rank
        if verdict.skip:
            strategy.skip_step()
            if env.is_main and log:
                print(f"lowband.train: {verdict.message}", flush=True)
        else:
            strategy.optimizer_step()
        schedule.step()
        loader.step = step + 1
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        step_time = time.perf_counter() - t0
        totals = ledger.mark_step()
        is_last = step == cfg.run.steps - 1
        if (step + 1) % cfg.run.log_every == 0 or step == 0 or is_last:
            mean_loss = (loss_sum / cfg.data.grad_accum).cpu()
            env.metrics_comm.all_reduce(mean_loss, "avg", tag="loss")
            last_loss = float(mean_loss)
            row = {"step": step + 1, "loss": last_loss, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": global_tokens / step_time, "step_time_s": step_time,
                   "wire_bytes": totals.wire_bytes, "wire_mb": totals.wire_bytes / 1e6,
                   "collectives": totals.count, "peak_mem_bytes": peak_memory_bytes(env.device),
                   "skipped": verdict.skip, "skipped_total": guard.total, "extras": strategy.log_extras()}
            rows.append(row)
            if writer:
                writer.write(row)
            if env.is_main and log:
                print(format_log_line(row, cfg.run.steps), flush=True)
        if (cfg.run.val_every and (step + 1) % cfg.run.val_every == 0) or is_last:
            last_val = evaluate(strategy.unwrapped(), val_loader, cfg.run.val_batches, env, strategy.forward)
            vrow = {"step": step + 1, "val_loss": last_val}
            rows.append(vrow)
            if writer:
                writer.write(vrow)
            if env.is_main and log:
                print(f"step {step + 1:>5}/{cfg.run.steps} | val_loss {last_val:.4f}", flush=True)
        stop_now = bool(verdict.stop) and step + 1 < end_step  # a signal: every rank stops after this step
        if checkpointer.due(step + 1, final=step + 1 == end_step or stop_now) and checkpointer.save(step + 1):
            if env.is_main and log:
                print(f"lowband.train: checkpoint step-{step + 1} ({checkpointer.manager.last_save_s:.2f} s"
                      f"{', async' if cfg.checkpoint.async_save else ''})", flush=True)
        if stop_now:
            stopped_by, end_step = verdict.stop, step + 1
            break
    checkpointer.close()
    if writer:
        writer.close()
        if log:
            print(f"lowband.train: run directory {run_dir}", flush=True)
    return TrainResult(steps=end_step, final_loss=last_loss, final_val_loss=last_val,
                       run_dir=run_dir if writer else None, rows=rows, strategy=strategy, start_step=start_step,
                       skipped_steps=list(guard.skipped_steps), stopped_by=stopped_by)
