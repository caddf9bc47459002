"""Per-rank program of the ``link`` suite: ``python -m lowband.bench.link_rank SPEC.json OUT.json``.

The launcher (:mod:`lowband.bench.link`) starts one of these per rank inside the rank's network
namespace (torch's ``env://`` rendezvous, gloo on ``lb0``). On every rank alike it:

1. measures the compute-only step time (the same model, batch and AdamW, no communication);
2. trains each contender in turn on the built-in corpus, same model, same global batch, each from the
   same seed: ``ddp`` first for ``steps`` steps (its final validation loss is the default target), or,
   with ``horizon = "flat"``, until its validation loss has flattened (:func:`flattened`, at most ``steps``),
   every other one until it reaches the target, or its training clock passes ``time_cap x`` ddp's
   time, or ``max_steps_factor x`` ddp's steps;
3. per contender: the training clock (the sum of step times, evaluations excluded; every rank's
   clock averaged), validation loss every ``eval_every`` steps, the ledger's wire bytes, and this
   rank's ``lb0`` rx/tx byte counters over the same window.

Communication of the program itself (outside the contenders): one scalar all-reduce per evaluation
(``[val loss, clock]``, on ``env.metrics_comm``, not in the training ledger), barriers between
contenders, and one ``all_gather_object`` of the per-rank counters at the end. Rank 0 writes OUT.json.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from lowband.bench.link_contenders import LinkTopo, Trainee, resolve
from lowband.bench.netns import IFNAME, read_counters, read_proc_counters
from lowband.train.config import Config
from lowband.train.env import DistEnv, init_distributed
from lowband.train.trainer import build_model


def link_config(spec: dict[str, Any], world: int) -> Config:
    """The shared run config of every contender (model, global batch, optimizer, DiLoCo settings)."""
    cfg = Config()
    cfg.run.world_size = world
    cfg.run.steps = spec["steps"]
    m = cfg.model
    m.n_layer, m.n_embd, m.n_head = spec["n_layer"], spec["n_embd"], spec["n_head"]
    m.seq_len, m.vocab_size, m.bigram_rows = spec["seq_len"], spec["vocab_size"], spec["bigram_rows"]
    cfg.data.batch_size = spec["global_batch"] // world
    cfg.optim.lr = spec["lr"]
    cfg.optim.warmup_steps = spec["warmup"]
    cfg.optim.schedule = "constant"  # extra steps past `steps` are not handicapped by a decayed lr
    cfg.optim.grad_clip = 1.0
    d = cfg.diloco
    d.sync_every, d.fragments, d.delay = spec["diloco_sync_every"], spec["diloco_fragments"], 0
    d.outer_lr, d.outer_momentum, d.alpha = 1.0, 0.0, 0.0
    return cfg


def crossing_time(curve: list[list[float]], target: float) -> float | None:
    """Training clock at which the validation loss first reaches ``target``: linear interpolation in
    loss between the last evaluation above it and the first at or below it (``None`` if never)."""
    for i, (c, _, v) in enumerate(curve):
        if v <= target:
            if i == 0:
                return c
            c0, _, v0 = curve[i - 1]
            return c0 + (c - c0) * (v0 - target) / (v0 - v) if v0 > v else c
    return None


@torch.no_grad()
def local_val_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    total = sum(float(model(x, y)) for x, y in batches)
    model.train(was)
    return total / len(batches)


def compute_only_step_s(cfg: Config, batches: Any, steps: int) -> float:
    """Median step time of the model with torch AdamW and no communication (this rank's batch)."""
    from lowband.train.optimizers import torch_adamw

    model = build_model(cfg, torch.device("cpu"))
    opt = torch_adamw(model, cfg.optim)
    times = []
    for i in range(steps):
        x, y = batches.batch(i)
        t0 = time.perf_counter()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] if len(times) > 1 else times)


def flattened(curve: list[list[float]], window: int, tol: float) -> bool:
    """Whether a validation curve (``[clock, step, val]`` rows, the first at step 0) has flattened: the mean of
    its last ``window`` evaluations is lower than the mean of the ``window`` before them by less than ``tol``
    of the latter (relative). Needs ``2 * window`` evaluations after step 0."""
    vals = [v for _c, _s, v in curve[1:]]
    if len(vals) < 2 * window:
        return False
    last = sum(vals[-window:]) / window
    before = sum(vals[-2 * window:-window]) / window
    return before - last < tol * abs(before)


def train_contender(trainee: Trainee, env: DistEnv, loader: Any, val: list, *, fixed_steps: int | None,
                    target: float | None, time_cap_s: float, max_steps: int, eval_every: int,
                    uplink_pid: int | None = None, setup_steps: int = 2,
                    until_flat: tuple[int, float] | None = None) -> dict[str, Any]:
    """Train until ``fixed_steps`` (when given) or the target / time cap / step cap; see module doc.
    ``until_flat = (window, tol)``: train until :func:`flattened` (or ``max_steps``) instead, with no target and
    no time cap (the long-horizon ddp run). ``uplink_pid``: a process in this rank's node namespace; its ``up0``
    counters are read too."""

    def uplink() -> tuple[int, int]:
        return read_proc_counters(uplink_pid, "up0") if uplink_pid is not None else (0, 0)

    metrics, ledger, n = env.metrics_comm, env.ledger, env.world_size

    def agreed(val_local: float, clock: float) -> tuple[float, float]:
        t = torch.tensor([val_local, clock], dtype=torch.float64)
        metrics.all_reduce(t, "sum", tag="link:eval")
        return float(t[0]) / n, float(t[1]) / n

    metrics.barrier(tag="link")
    ledger.mark_step()
    rx0, tx0 = read_counters(IFNAME)
    utx0 = uplink()[1]
    v0, _ = agreed(local_val_loss(trainee.eval_model(), val), 0.0)
    curve = [[0.0, 0, v0]]
    clock, step_times, evals, step = 0.0, [], 1, 0
    reached, pending = False, 0
    while True:
        x, y = loader.batch(step)
        last = step + 1
        is_eval = last % eval_every == 0 or last == fixed_steps or last == max_steps
        t0 = time.perf_counter()
        trainee.step(x, y)
        if is_eval:
            model = trainee.eval_model()  # drains in-flight parameter traffic inside the clock
        dt = time.perf_counter() - t0
        step_times.append(dt)
        # The first `setup_steps` steps carry one-time set-up (lazy initialization, DDP's bucket rebuild,
        # FSDP2/DTensor caches, first gloo buffers); the clock charges each of them at the time of the step
        # after them instead (their own times are in step_times_s). An evaluation among them charges as is.
        if last <= setup_steps and not is_eval and pending == last - 1:
            pending = last
        elif pending:
            clock, pending = clock + (pending + 1) * dt, 0
        else:
            clock += dt
        step = last
        if not is_eval:
            continue
        v, c = agreed(local_val_loss(model, val), clock)
        evals += 1
        curve.append([c, step, v])
        reached = reached or (target is not None and v <= target)
        if until_flat is not None:
            if flattened(curve, *until_flat) or step >= max_steps:
                break
        elif fixed_steps is not None:
            if step >= fixed_steps:
                break
        elif reached or c >= time_cap_s or step >= max_steps:
            break
    rx1, tx1 = read_counters(IFNAME)
    utx1 = uplink()[1]
    ledger_bytes = ledger.mark_step().wire_bytes
    if trainee.wire_bytes_per_step is not None:
        ledger_bytes = trainee.wire_bytes_per_step * step + trainee.once_wire_bytes
    return {"steps": step, "clock_s": curve[-1][0], "curve": curve, "step_times_s": step_times,
            "setup_steps": setup_steps,
            "final_val_loss": curve[-1][2],
            "time_to_target_s": None if target is None else crossing_time(curve, target),
            "ledger_wire_bytes": int(ledger_bytes), "ledger_source": "ring model (torch collectives)"
            if trainee.wire_bytes_per_step is not None else "lowband ledger",
            "iface_rx_bytes": rx1 - rx0, "iface_tx_bytes": tx1 - tx0, "evals": evals,
            "uplink_tx_bytes": utx1 - utx0 if uplink_pid is not None else None,
            "optimizer_state_bytes": trainee.state_bytes(), "resident_bytes": trainee.resident_bytes()}


def run_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    from lowband.data import DistributedLoader, builtin_corpus

    torch.set_num_threads(spec["threads"])
    env = init_distributed("cpu", spec["pg_timeout_s"])
    topo = LinkTopo(env.world_size, spec["nodes"])
    cfg = link_config(spec, env.world_size)
    train_tokens, val_tokens = builtin_corpus()
    b, t = cfg.data.batch_size, cfg.model.seq_len
    loader = DistributedLoader(train_tokens, b, t, env.rank, env.world_size, seed=spec["seed"])
    val_loader = DistributedLoader(val_tokens, b, t, env.rank, env.world_size, seed=spec["seed"] + 1)
    val = [val_loader.batch(i) for i in range(spec["val_batches"])]
    env.metrics_comm.barrier(tag="link")
    compute_s = compute_only_step_s(cfg, loader, spec["compute_steps"])
    ct = torch.tensor([compute_s], dtype=torch.float64)
    env.metrics_comm.all_reduce(ct, "max", tag="link")
    rpn = env.world_size // spec["nodes"]
    anchors = spec.get("uplink_pids") or []
    uplink_pid = anchors[env.rank // rpn] if anchors and env.rank % rpn == 0 else None  # one reader per node
    target: float | None = spec.get("target")
    ddp_clock: float | None = None
    ddp_steps = spec["steps"]
    rows: list[dict[str, Any]] = []
    for name in spec["contenders"]:
        lspec = resolve(name)
        try:
            trainee = lspec.build(cfg, env, topo)
        except Exception as e:  # a contender that cannot be set up (config checks: on every rank alike,
            # before any collective) is reported as an error row, and the run goes on
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}", "note": lspec.note})
            if env.rank == 0:
                print(f"link_rank: {name}: set-up failed: {type(e).__name__}: {e}", flush=True)
            continue
        first = ddp_clock is None
        flat = spec.get("horizon", "steps") == "flat"
        if first and flat:  # the long horizon: ddp until its loss has flattened, at most `steps` steps
            res = train_contender(trainee, env, loader, val, fixed_steps=None, target=None, time_cap_s=0.0,
                                  max_steps=spec["steps"], eval_every=spec["eval_every"], uplink_pid=uplink_pid,
                                  setup_steps=spec["setup_steps"],
                                  until_flat=(spec["flat_window"], spec["flat_tol"]))
        else:
            res = train_contender(trainee, env, loader, val, fixed_steps=spec["steps"] if first else None,
                                  target=target, time_cap_s=spec["time_cap"] * (ddp_clock or 0.0),
                                  max_steps=ddp_steps * spec["max_steps_factor"],
                                  eval_every=spec["eval_every"], uplink_pid=uplink_pid,
                                  setup_steps=spec["setup_steps"])
        if first:
            ddp_clock, ddp_steps = res["clock_s"], res["steps"]
            if target is None:
                target = res["final_val_loss"]
                res["time_to_target_s"] = crossing_time(res["curve"], target)
        rows.append({"name": name, "note": lspec.note, **res})
        if env.rank == 0:
            ttt = res["time_to_target_s"]
            print(f"link_rank: {name}: {res['steps']} steps, clock {res['clock_s']:.2f} s, val "
                  f"{res['final_val_loss']:.4f}, to target {'-' if ttt is None else f'{ttt:.2f} s'}", flush=True)
        del trainee
        gc.collect()
    per_rank = env.metrics_comm.all_gather_object(
        [(r.get("iface_rx_bytes"), r.get("iface_tx_bytes"), r.get("ledger_wire_bytes"), r.get("uplink_tx_bytes"))
         for r in rows])
    for i, r in enumerate(rows):
        if "error" not in r:
            r["iface_rx_bytes_per_rank"] = [int(p[i][0]) for p in per_rank]
            r["iface_tx_bytes_per_rank"] = [int(p[i][1]) for p in per_rank]
            r["ledger_wire_bytes_per_rank"] = [int(p[i][2]) for p in per_rank]
            r["uplink_tx_bytes_per_node"] = [int(p[i][3]) for p in per_rank if p[i][3] is not None]
    if env.rank != 0:
        return None
    return {"compute_only_step_s": float(ct), "target_val_loss": target, "baseline_clock_s": ddp_clock,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m lowband.bench.link_rank SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    out = run_rank(spec)
    if out is not None:
        with open(argv[1], "w") as f:
            json.dump(out, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank is done (rank 0 has written OUT) before anyone tears down
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without C++ teardown: destroying gloo's process groups (one per contender's subgroups) at
    # exit can abort ("terminate called without an active exception") while a peer is still closing.
    os._exit(code)
