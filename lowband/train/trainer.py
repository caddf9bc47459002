"""The training loop shared by every strategy.

``train(cfg, env)`` builds the model (lowband's GPT, or the user's own from ``model_factory`` /
``model.factory``: :mod:`lowband.train.models`) and its plan, the data loaders
(each rank a disjoint slice of every global batch), the strategy (which distributes the model and
owns the optimizer), and runs ``run.steps`` optimizer steps with gradient accumulation, LR schedule,
clipping, validation and logging. It can be called in-process (tests) or from the CLI
(``python -m lowband.train``).

Every ``run.check_replicas_every`` steps (default 100) the ranks check that they still hold the same model
(:func:`lowband.consistency.check_replicas` on the world ``Comm``: parameters, not buffers, since DDP here does
not sync buffers such as BatchNorm statistics; GTP/TP shards among the ranks that hold the same shard; DiLoCo
replicas, :meth:`Strategy.replica_id`, not with each other). It costs one all-gather of
``2 + 4 x parameters`` int64 words per rank (``(world - 1) x 8 x (2 + 4 x parameters)`` bytes on the wire,
ledger tag ``replica_check``, counted in that step's wire bytes but not in its step time) and ends a drifting
run with :class:`~lowband.consistency.ReplicaDivergenceError` on every rank (exit 1).
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

from lowband.consistency import check_replicas
from lowband.plan import ModelPlan, plan_for
from lowband.train.checkpoint import MARKER, STEP_PREFIX, TrainCheckpointer
from lowband.train.compiling import compile_model
from lowband.train.config import Config, ConfigError, to_toml
from lowband.train.env import DistEnv, init_distributed
from lowband.train.errors import warn
from lowband.train.forward import lm_loss, resolve_convention
from lowband.train.guards import NonFiniteGuard, peer_failure_guard
from lowband.train.metrics import (
    IntervalMeter,
    RunWriter,
    allreduce_reference_bytes,
    format_log_line,
    peak_memory_bytes,
)
from lowband.train.models import DTYPES, ModelFactory, call_factory, check_plan, gpt_factory, load_factory
from lowband.train.strategies import get_strategy_class
from lowband.train.strategies.base import Strategy
from lowband.train.summary import format_summary, run_summary, write_summary
from lowband.train.tensorboard import TensorBoardWriter, check_tensorboard

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
    model_path: Path | None = None
    """``<run dir>/model.safetensors`` on rank 0 when the run exported its final model (``run.export``); else None."""
    summary: dict[str, Any] | None = None
    """The end-of-run summary (:func:`lowband.train.summary.run_summary`; this rank's counts)."""


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
    """Train and validation tokens: the built-in corpus (rank 0 builds the cache first), your text files
    (``data.source = text``: rank 0 builds or finds the cache, then one ``all_gather_object`` on the metrics
    ``Comm`` (tag ``corpus``) gives every rank its folder, or the same error), or .bin shards."""
    from lowband.data import builtin_corpus, load_tokens
    from lowband.data.shards import val_tail_len

    if cfg.data.source == "text":
        from lowband.data.text import read_cache
        from lowband.train.preflight import text_source

        verdict: tuple[str, str] | None = None
        failure: BaseException | None = None
        if env.rank == 0:
            try:
                train, val, folder = text_source(cfg)
                verdict = ("ok", str(folder))
            except Exception as e:  # every rank must learn of it before the first training collective
                failure, verdict = e, ("config" if isinstance(e, ConfigError) else "failed", str(e))
        if env.world_size > 1:
            verdict = env.metrics_comm.all_gather_object(verdict, tag="corpus")[0]
        assert verdict is not None
        if failure is not None:
            raise failure
        if verdict[0] == "config":
            raise ConfigError(verdict[1])
        if verdict[0] == "failed":
            raise RuntimeError(f"rank 0 could not build the text cache of data.path: {verdict[1]}")
        if env.rank == 0:
            return train, val
        cached = read_cache(verdict[1])  # None on another machine: build the same cache there
        return cached if cached is not None else text_source(cfg)[:2]
    if cfg.data.source == "bin":
        train = load_tokens(cfg.data.train_bin)
        if cfg.data.val_bin:
            return train, load_tokens(cfg.data.val_bin)
        held = val_tail_len(len(train))  # the validation tail, held out of training
        return train[:len(train) - held], train[len(train) - held:]
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
    """The rows of an earlier ``metrics.jsonl`` up to ``step`` (empty if missing). A line that does not parse
    (a row torn by a crash or a full disk while it was written) is left out with a warning; the rows around it
    are kept."""
    import json

    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    rows, torn = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        at = row.get("step") if isinstance(row, dict) else None
        if isinstance(at, int) and at <= step:
            rows.append(row)
    if torn:
        warn(f"{str(path)!r}: {torn} line(s) that are not JSON rows (cut short by a crash?) left out; the other "
             f"rows up to step {step} are kept")
    return rows


def _gather_counters(meter: IntervalMeter, env: DistEnv) -> dict[str, Any]:
    """Collective (one ``all_gather_object`` on the metrics ``Comm``, tag ``ckpt``): every rank's cumulative
    byte counters, in rank order, for the checkpoint (the same list on every rank)."""
    return {"counters": env.metrics_comm.all_gather_object(meter.state_dict(), tag="ckpt")}


def _restore_counters(meter: IntervalMeter, extra: Any, env: DistEnv, start_step: int, log: bool) -> None:
    """Continue the cumulative byte counts from the resumed checkpoint (rank ``r`` takes the count saved by
    rank ``r`` modulo the saved world size, as its RNG state)."""
    if not start_step:
        return
    counters = extra.get("counters") if isinstance(extra, dict) else None
    if not counters:
        if env.is_main and log:
            print(f"lowband.train: the checkpoint holds no cumulative byte counts (saved by an older lowband): "
                  f"wire_bytes_cumulative counts from step {start_step}", flush=True)
        return
    meter.load_state_dict(counters[env.rank % len(counters)])


def train(cfg: Config, env: DistEnv | None = None, *, model_factory: ModelFactory | None = None,
          write_run_dir: bool = True, log: bool = True, stop_after: int | None = None,
          check_outputs: bool = True) -> TrainResult:
    """Train per ``cfg``; returns the logged rows and final losses (rank 0 writes the run dir).

    ``model_factory(cfg)`` (or ``model.factory = "module:function"`` in the config) builds the model
    instead of lowband's GPT and may return ``(model, plan)``; see :mod:`lowband.train.models` and
    docs/adopt.md. Its forward convention is ``model.forward`` (:mod:`lowband.train.forward`).

    With ``[checkpoint] every > 0`` it resumes from the latest checkpoint and saves every ``every`` steps
    and at the end. ``stop_after`` ends the run after that many total steps (as a preemption would; a
    checkpoint is saved there when checkpointing is on); the LR schedule still spans ``run.steps``.
    A backend error from a dead or unresponsive peer is re-raised as ``PeerFailureError``.

    With ``write_run_dir``, a run directory holding another run's outputs is refused (``ConfigError`` on every
    rank: :func:`lowband.train.preflight.check_run_outputs`, rank 0's verdict shared by one
    ``all_gather_object``, tag ``preflight``, at 2+ ranks); ``check_outputs=False`` skips it (the CLI checks
    before it starts the ranks, with the run directory locked).
    """
    env = env or init_distributed(cfg.run.device, cfg.run.timeout_s)
    if write_run_dir and check_outputs:
        _check_outputs(cfg, env)
    strategies: list[Strategy] = []  # closed on every exit path (a fault-tolerant group leaves its run)
    try:
        with peer_failure_guard(env.rank, env.world_size, cfg.run.timeout_s):
            return _train(cfg, env, model_factory=model_factory, write_run_dir=write_run_dir, log=log,
                          stop_after=stop_after, strategies=strategies)
    finally:
        for strategy in strategies:
            strategy.close()


def _check_outputs(cfg: Config, env: DistEnv) -> None:
    """Collective at 2+ ranks: rank 0 runs :func:`~lowband.train.preflight.check_run_outputs`; every rank raises
    the same ``ConfigError`` or none does."""
    from lowband.train.preflight import check_run_outputs, run_dir

    verdict: str | None = None
    if env.rank == 0:
        try:
            check_run_outputs(cfg)
        except ConfigError as e:
            verdict = str(e)
        except OSError as e:  # every rank must learn of it (no rank may wait alone in the gather)
            verdict = f"run directory {str(run_dir(cfg))!r} cannot be read ({e.strerror or e})"
    if env.world_size > 1:
        verdict = env.metrics_comm.all_gather_object(verdict, tag="preflight")[0]
    if verdict is not None:
        raise ConfigError(verdict)


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
    if plan.vocab_size is not None and cfg.data.source in ("builtin", "text") and plan.vocab_size < 258:
        raise ConfigError(f"the model's vocabulary ({plan.vocab_size}, from its plan) is smaller than the byte "
                          f"tokenizer's 258 ids (data.source = {cfg.data.source})")
    return model, plan


def _train(cfg: Config, env: DistEnv, *, model_factory: ModelFactory | None, write_run_dir: bool, log: bool,
           stop_after: int | None, strategies: list[Strategy]) -> TrainResult:
    from lowband.data import DistributedLoader

    wall_start = time.perf_counter()
    _set_threads(cfg)
    strategy_cls = get_strategy_class(cfg.strategy.name)
    strategy_cls.validate_config(cfg, env.world_size)
    check_tensorboard(cfg.run.tensorboard)
    train_tokens, val_tokens = load_token_arrays(cfg, env)
    micro = cfg.data.batch_size // cfg.data.grad_accum
    part, parts = strategy_cls.data_partition(cfg, env.rank, env.world_size)
    loader = DistributedLoader(train_tokens, cfg.data.batch_size, cfg.model.seq_len, part, parts, seed=cfg.run.seed)
    val_loader = DistributedLoader(val_tokens, micro, cfg.model.seq_len, part, parts, seed=cfg.run.seed + 1)
    model, plan = _model_and_plan(cfg, env, strategy_cls, model_factory)
    strategy = strategy_cls(cfg, env)
    strategy.plan = plan
    strategy.forward = resolve_convention(model, cfg.model.forward)
    strategies.append(strategy)
    strategy.setup(model)
    if cfg.run.compile:  # after the strategy distributed it (docs/cli.md)
        compile_model(strategy.model)
    schedule = torch.optim.lr_scheduler.LambdaLR(strategy.optimizer, lr_factor(cfg))
    guard = NonFiniteGuard(env.metrics_comm, cfg.guard.skip_nonfinite, cfg.guard.max_consecutive)
    global_tokens = cfg.data.batch_size * cfg.model.seq_len * env.world_size
    meter = IntervalMeter(global_tokens, allreduce_reference_bytes(strategy.param_shapes(), env.world_size))
    checkpointer = TrainCheckpointer(cfg, env, strategy, schedule, loader, guard,
                                     extra_state=lambda: _gather_counters(meter, env))
    start_step = checkpointer.resume()
    _restore_counters(meter, checkpointer.extra, env, start_step, log)
    end_step = cfg.run.steps if stop_after is None else max(min(stop_after, cfg.run.steps), start_step)
    position = {"step": start_step}  # the step in progress: what a healing peer continues from
    healed: list[int] = []
    if strategy.fault_tolerant:  # a group healed from a peer continues at the peer's step and LR position
        strategy.register_heal_state(
            "lowband_trainer", lambda: {"step": position["step"], "schedule": schedule.state_dict()},
            lambda sd: (schedule.load_state_dict(sd["schedule"]), healed.append(int(sd["step"]))))

    writer: RunWriter | None = None
    tb: TensorBoardWriter | None = None
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    if start_step >= end_step:  # resumed where the run ends: its run directory already holds its outputs
        write_run_dir = False
    if env.is_main and log and checkpointer.resumed_from is not None:
        print(f"lowband.train: resumed from {checkpointer.resumed_from.path} (step {start_step})", flush=True)
    if env.is_main and write_run_dir:
        earlier = _rows_before(run_dir / "metrics.jsonl", start_step) if start_step else []
        writer = RunWriter(run_dir, plot=cfg.run.plot)
        for row in earlier:  # a resumed run keeps the history up to its checkpoint
            writer.write(row)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        tb = TensorBoardWriter(run_dir) if cfg.run.tensorboard else None
    if env.is_main and log:
        nparams = sum(p.numel() for p in strategy.unwrapped().parameters())
        print(f"lowband.train: strategy {cfg.strategy.name} | world {env.world_size} | device "
              f"{env.device} | params {nparams:,} | tokens/step {global_tokens:,}", flush=True)

    stopped_by = 0
    ledger = env.ledger
    ledger.mark_step()
    rows: list[dict[str, Any]] = []
    last_loss: float | None = None
    last_val: float | None = None
    last_checkpoint: str | None = None
    step = start_step - 1
    trained = 0  # steps this process ran (fewer than end_step - start_step after a heal jumped ahead)
    while step + 1 < end_step:
        step += 1
        trained += 1
        position["step"] = step
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
        verdict = guard.check(step + 1, loss_sum, grad_norm,  # same verdict on every rank
                              busy=checkpointer.save_in_flight())
        if verdict.skip:
            strategy.skip_step()
            if env.is_main and log:
                print(f"lowband.train: {verdict.message}", flush=True)
        else:
            strategy.optimizer_step()
        if healed:  # this group was behind: the step's quorum copied a peer's state, which was at step healed[-1]
            if env.is_main and log:
                print(f"lowband.train: healed from a live peer at step {step + 1}: continuing at its step "
                      f"{healed[-1] + 1}", flush=True)
            step = healed[-1]
            healed.clear()
        schedule.step()
        loader.step = step + 1
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        step_time = time.perf_counter() - t0
        if cfg.run.check_replicas_every and (step + 1) % cfg.run.check_replicas_every == 0:
            # one all-gather of checksums (tag replica_check): in this step's wire bytes, not in its step time
            check_replicas(strategy.unwrapped(), env.comm, buffers=False, replica=strategy.replica_id(),
                           context=f"after step {step + 1}")
        totals = ledger.mark_step()
        meter.add(loss_sum / cfg.data.grad_accum, grad_norm, step_time, totals.wire_bytes, totals.count,
                  verdict.skip)
        is_last = step == cfg.run.steps - 1
        stop_now = bool(verdict.stop) and step + 1 < end_step  # a signal: every rank stops after this step
        if (step + 1) % cfg.run.log_every == 0 or step == 0 or is_last or step + 1 == end_step or stop_now:
            mean_loss = meter.local_loss_mean()  # the interval's mean; one all-reduce per logged row
            env.metrics_comm.all_reduce(mean_loss, "avg", tag="loss")
            last_loss = float(mean_loss)
            interval = meter.row(last_loss, end_step - step - 1)
            row = {"step": step + 1, "loss": interval.pop("loss"), "lr": lr, **interval,
                   "peak_mem_bytes": peak_memory_bytes(env.device), "skipped_total": guard.total,
                   "extras": strategy.log_extras()}
            rows.append(row)
            if writer:
                writer.write(row)
            if tb:
                tb.write(row)
            if env.is_main and log:
                print(format_log_line(row, cfg.run.steps), flush=True)
        if (cfg.run.val_every and (step + 1) % cfg.run.val_every == 0) or is_last:
            # val_batches batches of data.batch_size sequences, read as microbatches (the val loader's size), so
            # the validation set does not shrink with data.grad_accum (nor change with the world size)
            last_val = evaluate(strategy.unwrapped(), val_loader, cfg.run.val_batches * cfg.data.grad_accum, env,
                                strategy.forward)
            vrow = {"step": step + 1, "val_loss": last_val}
            rows.append(vrow)
            if writer:
                writer.write(vrow)
            if tb:
                tb.write(vrow)
            if env.is_main and log:
                print(f"step {step + 1:>5}/{cfg.run.steps} | val_loss {last_val:.4f}", flush=True)
        checkpointer.commit_finished(verdict.busy)  # an async save every rank has finished is committed now
        if checkpointer.due(step + 1, final=step + 1 == end_step or stop_now) and checkpointer.save(step + 1):
            last_checkpoint = str(checkpointer.directory / f"{STEP_PREFIX}{step + 1}")
            if env.is_main and log:
                print(f"lowband.train: checkpoint step-{step + 1} ({checkpointer.manager.last_save_s:.2f} s"
                      f"{', async' if cfg.checkpoint.async_save else ''})", flush=True)
        if stop_now:
            stopped_by, end_step = verdict.stop, step + 1
            break
    checkpointer.close()
    model_path: Path | None = None
    if write_run_dir and cfg.run.export:  # collective on every rank alike; rank 0 writes (lowband.train.export)
        from lowband.train.export import export_model

        model_path = export_model(strategy, cfg, env, run_dir, step=end_step, model_factory=model_factory)
        if model_path is not None and log:
            print(f"lowband.train: model written to {model_path}", flush=True)
    if last_checkpoint is not None and env.is_main and not (Path(last_checkpoint) / MARKER).is_file():
        last_checkpoint = None  # an async save that failed to commit (checkpoint.on_save_error = continue)
    summary = run_summary(
        env.metrics_comm, strategy=cfg.strategy.name, world_size=env.world_size, start_step=start_step,
        end_step=end_step, tokens_per_step=global_tokens, wall_time_s=time.perf_counter() - wall_start,
        train_time_s=meter.run_time_s, final_loss=last_loss, final_val_loss=last_val,
        wire_bytes_total=meter.run_wire_bytes, wire_bytes_cumulative=meter.cumulative,
        allreduce_ref_bytes_total=meter.run_ref_bytes, peak_mem_bytes=peak_memory_bytes(env.device),
        skipped_steps=list(guard.skipped_steps), checkpoint=last_checkpoint,
        model_path=None if model_path is None else str(model_path), stopped_by=stopped_by, steps_trained=trained,
        extras=strategy.summary_extras())
    if tb:
        tb.close()
    if env.is_main and log:
        print(format_summary(summary), flush=True)
    if writer:
        writer.close()
        write_summary(run_dir, summary)
        if log:
            print(f"lowband.train: run directory {run_dir}", flush=True)
    return TrainResult(steps=end_step, final_loss=last_loss, final_val_loss=last_val,
                       run_dir=run_dir if writer else None, rows=rows, strategy=strategy, start_step=start_step,
                       skipped_steps=list(guard.skipped_steps), stopped_by=stopped_by,
                       model_path=model_path, summary=summary)
