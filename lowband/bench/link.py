"""``link`` suite: time to loss when bytes cost time.

``python -m lowband.bench link --world N [--bandwidths 1gbit,100mbit,10mbit] [--nodes K]`` (or
``python -m lowband.bench.link`` with the same options) runs, for each bandwidth, N ranks each in
its own network namespace joined by rate-limited links (:mod:`lowband.bench.netns`: veth pairs, a
bridge, ``tbf`` per link; ``--nodes K`` gives the two-level topology where the ranks of one node share
an unshaped bridge and the K nodes are joined by the shaped links). Gloo runs over those interfaces
(``GLOO_SOCKET_IFNAME=lb0``, rendezvous at rank 0's address on the bridge). Every contender of
:mod:`lowband.bench.link_contenders` trains the same model on the built-in corpus with the same global
batch (:mod:`lowband.bench.link_rank`); ddp first, whose final validation loss is the target. A contender
may be named with config changes, ``NAME/section.key=value/...`` (e.g.
``diloco-topk-rice-int2-ef95/diloco.topk_k=16/diloco.fragments=1``), so a sweep needs no new registration.

Reported per contender and bandwidth: training wall-clock to the target validation loss and its ratio
to ddp's, validation loss at fixed wall-clock budgets (fractions of ddp's run), ledger wire bytes and
the interface byte counters of every rank (both, and their ratio: protocol overhead), and ddp's
communication share of its step time (``1 - compute-only step / ddp step``) at that bandwidth.
Outputs: the shared bench JSON (one row per contender and bandwidth, ``name = contender@bandwidth``),
``<out>.md`` (the generic table), ``<out stem>-link.md`` (this suite's tables and target checks) and
``<out stem>-<bandwidth>.png`` (validation loss against wall-clock, one line per contender).

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN): without it, one line and exit code 2. Every namespace,
link and qdisc is removed on every exit path; each bandwidth's run is bounded by ``--time-limit``.

``python -m lowband.bench link`` runs the launcher in its own process (``LAUNCHER``: no local gloo ranks are
spawned, and SIGINT / SIGTERM reach the clean-up); the ranks that train are the ones started inside the
namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lowband.bench.netns import (
    ShapedNetwork,
    bandwidth_list,
    format_rate,
    parse_rate,
    privilege_problem,
    reap_leftovers,
    signals_as_exceptions,
)

DEFAULT_BANDWIDTHS = "1gbit,100mbit,10mbit"
LAUNCHER = True
"""``python -m lowband.bench`` runs this suite in its own process (it starts its own ranks; see
``lowband.bench.__main__.launcher_main``)."""
BASELINE = "ddp"
HORIZON_DEFAULTS: dict[str, Any] = {"horizon": "steps", "flat_window": 10, "flat_tol": 0.005}
"""``--horizon`` and its window and tolerance when not given (also for option dicts built by callers)."""
NOT_LOWBAND = ("ddp", "zero", "fsdp2")
"""Contenders that are torch's own; "lowband's best" is the best of the rest."""


def _bandwidths(text: str) -> list[str]:
    """argparse type of ``--bandwidths``; also the privilege gate (:func:`lowband.bench.netns.bandwidth_list`)."""
    return bandwidth_list(text, "link")


def _fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--budgets: {e}") from e
    if not out or any(f <= 0 for f in out):
        raise argparse.ArgumentTypeError("--budgets must be positive fractions of ddp's time, e.g. 0.25,0.5,1")
    return out


QUICK = {"steps": 4, "n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "bigram_rows": 64, "eval_every": 2,
         "compute_steps": 2, "val_batches": 1, "warmup": 1}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bandwidths", type=_bandwidths, default=DEFAULT_BANDWIDTHS,
                   help="comma-separated tc rates per link (bit, kbit, mbit, gbit)")
    p.add_argument("--nodes", type=int, default=0,
                   help="two-level topology: nodes joined by the shaped links, ranks of a node share an "
                        "unshaped bridge (must divide --world); 0 = one node per rank")
    p.add_argument("--contenders", default="all",
                   help="comma-separated (see lowband.bench.link_contenders.CONTENDERS, or strategy:NAME), each "
                        "optionally with config changes NAME/section.key=value/...; "
                        "all = every registered one; ddp is always run first (the target)")
    p.add_argument("--steps", type=int, default=40,
                   help="ddp's steps (its final val loss is the target); with --horizon flat, its most steps")
    p.add_argument("--horizon", choices=("steps", "flat"), default=HORIZON_DEFAULTS["horizon"],
                   help="steps: ddp trains --steps steps; flat: ddp trains until its validation loss has flattened "
                        "(the mean of its last --flat-window evaluations is within --flat-tol of the mean of the "
                        "window before), at most --steps steps")
    p.add_argument("--flat-window", type=int, default=HORIZON_DEFAULTS["flat_window"],
                   help="evaluations per window of --horizon flat")
    p.add_argument("--flat-tol", type=float, default=HORIZON_DEFAULTS["flat_tol"],
                   help="relative improvement between two windows below which ddp's loss counts as flat")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=48)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--bigram-rows", type=int, default=512, help="hashed bigram table (every contender has it)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--setup-steps", type=int, default=2,
                   help="first steps whose one-time set-up cost is not charged (each is charged at the time "
                        "of the step after them)")
    p.add_argument("--val-batches", type=int, default=2, help="validation batches per rank per evaluation")
    p.add_argument("--compute-steps", type=int, default=6, help="steps of the compute-only timing")
    p.add_argument("--target", type=float, default=None, help="target val loss (default: ddp's final)")
    p.add_argument("--time-cap", type=float, default=2.0, help="stop a contender at this multiple of ddp's time")
    p.add_argument("--max-steps-factor", type=int, default=3, help="stop a contender at this multiple of --steps")
    p.add_argument("--budgets", type=_fractions, default="0.25,0.5,1",
                   help="wall-clock budgets (fractions of ddp's time) at which val loss is reported")
    p.add_argument("--diloco-sync-every", type=int, default=4)
    p.add_argument("--diloco-fragments", type=int, default=2)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds per bandwidth run (then killed)")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout of the ranks")


def contender_list(text: str) -> list[str]:
    from lowband.bench.link_contenders import CONTENDERS, resolve

    names = ([n for n, spec in CONTENDERS.items() if spec.in_all] if text == "all"
             else [c.strip() for c in text.split(",") if c.strip()])
    for n in names:
        resolve(n)  # raises naming the allowed ones
    return [BASELINE] + [n for n in names if n != BASELINE]


def rank_spec(opts: dict[str, Any], nodes: int) -> dict[str, Any]:
    keys = ("steps", "global_batch", "n_layer", "n_embd", "n_head", "seq_len", "vocab_size", "bigram_rows",
            "lr", "warmup", "seed", "eval_every", "setup_steps", "val_batches", "compute_steps", "target", "time_cap",
            "max_steps_factor", "diloco_sync_every", "diloco_fragments", "horizon", "flat_window", "flat_tol")
    spec = {k: opts.get(k, HORIZON_DEFAULTS[k]) if k in HORIZON_DEFAULTS else opts[k] for k in keys}
    spec.update(contenders=contender_list(opts["contenders"]), nodes=nodes, threads=opts.get("threads") or 1,
                pg_timeout_s=opts["pg_timeout"])
    return spec


def check_options(opts: dict[str, Any]) -> tuple[int, int]:
    """``(world, nodes)``; raises ``ValueError`` naming the bad option before anything is created."""
    world = int(opts["world"])
    nodes = int(opts["nodes"]) or world
    if world < 2:
        raise ValueError(f"--world must be >= 2 for the link suite; got {world}")
    if nodes < 2 or world % nodes:
        raise ValueError(f"--nodes must be 0 or a divisor of --world ({world}) that is >= 2; got {opts['nodes']}")
    if opts["global_batch"] % world:
        raise ValueError(f"--global-batch ({opts['global_batch']}) must be divisible by --world ({world})")
    for k in ("steps", "eval_every", "val_batches", "compute_steps", "max_steps_factor"):
        if opts[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1; got {opts[k]}")
    if opts.get("setup_steps", 0) < 0:
        raise ValueError(f"--setup-steps must be >= 0; got {opts['setup_steps']}")
    if opts["time_cap"] < 1 or opts["time_limit"] <= 0:
        raise ValueError("--time-cap must be >= 1 and --time-limit > 0")
    h = horizon(opts)
    if h["horizon"] not in ("steps", "flat"):
        raise ValueError(f"--horizon must be steps or flat; got {h['horizon']!r}")
    if h["flat_window"] < 1 or not 0 < h["flat_tol"] < 1:
        raise ValueError(f"--flat-window must be >= 1 and 0 < --flat-tol < 1; got {h['flat_window']}, "
                         f"{h['flat_tol']}")
    if h["horizon"] == "flat" and opts.get("target") is not None:
        raise ValueError("--target and --horizon flat exclude each other: the flat ddp run sets the target")
    return world, nodes


def launch_bandwidth(opts: dict[str, Any], rate: str, world: int, nodes: int, logdir: Path) -> dict[str, Any]:
    """One shaped network at ``rate``: start the ranks in it, wait (bounded), return rank 0's output."""
    spec = rank_spec(opts, nodes)
    logdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lowband_link_") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        root = str(Path(__file__).resolve().parents[2])
        env = {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "OMP_NUM_THREADS": str(spec["threads"])}
        load_before = os.getloadavg()
        with ShapedNetwork(world, rate, nodes=nodes, mtu=opts["mtu"]) as net:
            spec_path.write_text(json.dumps({**spec, "uplink_pids": net.anchors}))
            logs = [open(logdir / f"{rate}-rank{r}.log", "w") for r in range(world)]
            try:
                procs = [net.popen(r, [sys.executable, "-m", "lowband.bench.link_rank", str(spec_path),
                                       str(out_path)], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
                         for r in range(world)]
                wait_ranks(procs, opts["time_limit"], logdir, rate)
            finally:
                for f in logs:
                    f.close()
        out = json.loads(out_path.read_text())
    out["load_avg_before"], out["load_avg_after"] = list(load_before), list(os.getloadavg())
    out["spec"] = spec
    return out


def wait_ranks(procs: list[subprocess.Popen], limit_s: float, logdir: Path, rate: str) -> None:
    """Wait for every rank; a rank that fails (or is killed) or the time limit ends the run with an error
    (the caller's ``ShapedNetwork`` then kills the others and removes the network)."""
    deadline = time.monotonic() + limit_s
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            r, c = bad[0]
            tail = (logdir / f"{rate}-rank{r}.log").read_text()[-2000:]
            raise RuntimeError(f"link suite: rank {r} exited with code {c} at {rate}; log tail:\n{tail}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"link suite: the {rate} run passed --time-limit {limit_s:.0f} s; ranks killed")
        time.sleep(0.2)


def _at_budget(curve: list[list[float]], budget: float) -> float | None:
    vals = [v for c, _, v in curve if c <= budget]
    return vals[-1] if vals else None


def bandwidth_rows(out: dict[str, Any], rate: str, budgets: list[float]) -> list[dict[str, Any]]:
    """Result rows (shared bench shape + link fields) of one bandwidth's run."""
    from lowband.bench.harness import result_row

    rows = [r for r in out["rows"] if "error" not in r]
    base = next((r for r in rows if r["name"] == BASELINE), None)
    base_time = base["time_to_target_s"] if base else None
    ddp_step = statistics.median(base["step_times_s"]) if base else None
    share = None if ddp_step is None else max(0.0, 1.0 - out["compute_only_step_s"] / ddp_step)
    budget_s = [f * (out["baseline_clock_s"] or 0.0) for f in budgets]
    results = []
    for r in out["rows"]:
        if "error" in r:
            results.append({"name": f"{r['name']}@{rate}", "contender": r["name"], "bandwidth": rate,
                            "error": r["error"]})
            continue
        n = len(r["ledger_wire_bytes_per_rank"])
        ledger_mean = sum(r["ledger_wire_bytes_per_rank"]) / n
        tx_mean = sum(r["iface_tx_bytes_per_rank"]) / n
        ttt = r["time_to_target_s"]
        row = result_row(f"{r['name']}@{rate}", r["step_times_s"], wire_bytes=round(ledger_mean / r["steps"]),
                         optimizer_state_bytes=r["optimizer_state_bytes"], peak_memory_bytes=r["resident_bytes"],
                         final_loss=r["final_val_loss"], contender=r["name"], bandwidth=rate,
                         bandwidth_bits=parse_rate(rate), note=r["note"], steps=r["steps"], clock_s=r["clock_s"],
                         time_to_target_s=ttt, reached_target=ttt is not None,
                         val_loss_at_budget={f"{b:.3f}": _at_budget(r["curve"], b) for b in budget_s},
                         ledger_wire_bytes_per_rank=r["ledger_wire_bytes_per_rank"], ledger_source=r["ledger_source"],
                         iface_tx_bytes_per_rank=r["iface_tx_bytes_per_rank"],
                         iface_rx_bytes_per_rank=r["iface_rx_bytes_per_rank"],
                         uplink_tx_bytes_per_node=r["uplink_tx_bytes_per_node"] or None,
                         iface_over_ledger=(tx_mean / ledger_mean) if ledger_mean else None,
                         ddp_comm_share=share, compute_only_step_s=out["compute_only_step_s"],
                         target_val_loss=out["target_val_loss"], curve=r["curve"],
                         load_avg_before=out["load_avg_before"], load_avg_after=out["load_avg_after"])
        if ttt is not None and base_time:
            row["ratio_vs"][f"{BASELINE}@{rate}"] = ttt / base_time
        results.append(row)
    return results


def target_checks(results: list[dict[str, Any]], rate: str) -> list[str]:
    """The issue's targets at one bandwidth, as lines of text (met / missed with the numbers)."""
    rows = {r["contender"]: r for r in results if r["bandwidth"] == rate and "error" not in r}
    base = rows.get(BASELINE)
    if base is None:
        return [f"{rate}: no ddp result; targets not checked"]
    share, bt = base["ddp_comm_share"], base["time_to_target_s"]
    lines = []
    lowband = [r for n, r in rows.items() if n not in NOT_LOWBAND and r["reached_target"]]
    best = min(lowband, key=lambda r: r["time_to_target_s"], default=None)
    best_txt = (f"lowband's best is {best['contender']} at {best['time_to_target_s']:.2f} s = "
                f"{best['time_to_target_s'] / bt:.3f} x ddp's {bt:.2f} s" if best else
                "no lowband contender reached the target")
    for need, ratio in ((0.95, 0.1), (0.75, 1 / 3)):
        if share >= need:
            ok = best is not None and best["time_to_target_s"] <= ratio * bt
            lines.append(f"{rate}: ddp communicates {share:.0%} of its step (>= {need:.0%}): target <= "
                         f"{ratio:.3g} x ddp's time; {best_txt}: {'met' if ok else 'MISSED'}")
            break
    else:
        lines.append(f"{rate}: ddp communicates {share:.0%} of its step (< 75%): no time-ratio target; {best_txt}")
    sa = rows.get("sharded-adamw")
    for other in ("zero", "fsdp2"):
        o = rows.get(other)
        if sa is None or o is None:
            continue
        st, ot = sa["time_to_target_s"], o["time_to_target_s"]
        if st is None:
            lines.append(f"{rate}: sharded-adamw did not reach the target ({other}: "
                         f"{'not reached' if ot is None else f'{ot:.2f} s'}): MISSED")
        elif ot is None:
            lines.append(f"{rate}: sharded-adamw {st:.2f} s; {other} did not reach the target: met")
        else:
            lines.append(f"{rate}: sharded-adamw {st:.2f} s vs {other} {ot:.2f} s (x{st / ot:.3f}): "
                         f"{'met' if st <= ot else 'MISSED'}")
    return lines


def horizon(opts: dict[str, Any]) -> dict[str, Any]:
    """``horizon``, ``flat_window`` and ``flat_tol`` of ``opts``, :data:`HORIZON_DEFAULTS` where absent."""
    return {k: opts.get(k, v) for k, v in HORIZON_DEFAULTS.items()}


def horizon_text(cfg: dict[str, Any], results: list[dict[str, Any]]) -> str:
    if horizon(cfg)["horizon"] != "flat":
        return f"ddp {cfg['steps']} steps"
    ran = sorted({r["steps"] for r in results if r.get("contender") == BASELINE and "steps" in r})
    return (f"ddp until flat (mean val loss of the last {cfg['flat_window']} evaluations within "
            f"{cfg['flat_tol']:.1%} of the {cfg['flat_window']} before, at most {cfg['steps']} steps; it ran "
            f"{', '.join(map(str, ran)) or '-'} steps)")


def link_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"### `link` — world {doc['world_size']}, {cfg['topology']}, torch {doc['torch']}", "",
             f"Model: {cfg['params']:,} parameters ({cfg['model']}), global batch {cfg['global_batch']} x "
             f"{cfg['model']['seq_len']} tokens, {horizon_text(cfg, doc['results'])}, eval every {cfg['eval_every']} "
             f"steps.", ""]
    for rate in cfg["bandwidths"]:
        rows = [r for r in doc["results"] if r["bandwidth"] == rate]
        ok = [r for r in rows if "error" not in r]
        if not ok:
            continue
        r0 = ok[0]
        la, lb = r0["load_avg_before"], r0["load_avg_after"]
        lines += [f"#### {rate}: ddp communicates {r0['ddp_comm_share']:.0%} of its step "
                  f"(compute-only step {r0['compute_only_step_s'] * 1e3:.1f} ms); target val loss "
                  f"{r0['target_val_loss']:.4f}; load avg {la[0]:.2f}/{la[1]:.2f} before, "
                  f"{lb[0]:.2f}/{lb[1]:.2f} after", ""]
        budgets = list(r0["val_loss_at_budget"])
        lines.append("| contender | steps | median step s | time to target s | vs ddp | "
                     + " | ".join(f"val @{float(b):.1f}s" for b in budgets)
                     + " | final val | ledger MB/rank | iface tx MB/rank | iface/ledger | uplink tx MB/node |")
        lines.append("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in budgets)
                     + " | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['contender']} | error: {r['error']} |")
                continue
            ttt = r["time_to_target_s"]
            ratio = r["ratio_vs"].get(f"{BASELINE}@{rate}")
            vals = " | ".join("" if v is None else f"{v:.4f}" for v in r["val_loss_at_budget"].values())
            n = len(r["ledger_wire_bytes_per_rank"])
            lmb = sum(r["ledger_wire_bytes_per_rank"]) / n / 1e6
            tmb = sum(r["iface_tx_bytes_per_rank"]) / n / 1e6
            iol = "" if r["iface_over_ledger"] is None else f"{r['iface_over_ledger']:.3f}"
            up = r.get("uplink_tx_bytes_per_node")
            upmb = f"{sum(up) / len(up) / 1e6:.3f}" if up else "(= iface)"
            lines.append(f"| {r['contender']} | {r['steps']} | {r['step_time_s_median']:.4f} | "
                         f"{'not reached' if ttt is None else f'{ttt:.2f}'} | "
                         f"{'' if ratio is None else f'{ratio:.3f}'} | {vals} | {r['final_loss']:.4f} | "
                         f"{lmb:.3f} | {tmb:.3f} | {iol} | {upmb} |")
        lines.append("")
        lines += [f"- {t}" for t in target_checks(doc["results"], rate)]
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], stem: Path) -> list[Path]:
    """One PNG per bandwidth: validation loss against training wall-clock, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for rate in doc["config"]["bandwidths"]:
        rows = [r for r in doc["results"] if r["bandwidth"] == rate and "error" not in r]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(9, 5.5))
        colors = plt.get_cmap("tab20").colors
        for i, r in enumerate(rows):
            c, name = r["curve"], r["contender"]
            style = "--" if name in NOT_LOWBAND[1:] else ":" if name.startswith("diloco") else "-"
            ax.plot([p[0] for p in c], [p[2] for p in c], marker=".", label=name, linestyle=style,
                    color="k" if name == BASELINE else colors[i % len(colors)],
                    linewidth=2.2 if name == BASELINE else 1.3)
        ax.axhline(rows[0]["target_val_loss"], color="k", linestyle="--", linewidth=0.8, label="target (ddp final)")
        ax.set_xlabel("training wall-clock (s)")
        ax.set_ylabel("validation loss")
        ax.set_title(f"link {rate}, world {doc['world_size']}, {doc['config']['topology']}: "
                     f"ddp comm share {rows[0]['ddp_comm_share']:.0%}")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        path = stem.with_name(f"{stem.name}-{rate}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def launch(opts: dict[str, Any], stem: Path) -> dict[str, Any]:
    """Run every bandwidth (the launcher side); returns ``{"config", "results"}``. Rank logs go to
    ``<stem>-logs/``."""
    problem = privilege_problem()
    if problem is not None:
        raise PermissionError(problem)
    world, nodes = check_options(opts)
    rates = opts["bandwidths"] if isinstance(opts["bandwidths"], list) else _bandwidths(opts["bandwidths"])
    rates = [format_rate(parse_rate(r)) for r in rates]
    from lowband.data import builtin_corpus

    builtin_corpus()  # build the corpus cache once, before the ranks start
    reap_leftovers()
    results: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    with signals_as_exceptions():
        for rate in rates:
            t0 = time.monotonic()
            try:
                res = launch_bandwidth(opts, rate, world, nodes, stem.with_name(f"{stem.name}-logs"))
            except (RuntimeError, TimeoutError) as e:  # this bandwidth failed (network already removed)
                runs[rate] = {"wall_s": time.monotonic() - t0, "error": str(e)}
                print(f"lowband.bench link: {rate} FAILED: {e}", file=sys.stderr, flush=True)
                continue
            runs[rate] = {"wall_s": time.monotonic() - t0, "compute_only_step_s": res["compute_only_step_s"],
                          "target_val_loss": res["target_val_loss"]}
            results += bandwidth_rows(res, rate, opts["budgets"])
            print(f"lowband.bench link: {rate} done in {runs[rate]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    import dataclasses

    import torch

    from lowband.bench.link_contenders import CONTENDERS, resolve
    from lowband.bench.link_rank import link_config
    from lowband.train.trainer import build_model

    spec = rank_spec(opts, nodes)
    cfg = link_config(spec, world)
    params = sum(p.numel() for p in build_model(cfg, torch.device("cpu")).parameters())
    config = {"bandwidths": rates, "nodes": nodes, "topology": "flat (one node per rank)" if nodes == world
              else f"{nodes} nodes x {world // nodes} ranks (unshaped inside a node)",
              "model": dataclasses.asdict(cfg.model), "params": params, "global_batch": opts["global_batch"],
              "steps": opts["steps"], **horizon(opts), "eval_every": opts["eval_every"],
              "val_batches": opts["val_batches"],
              "lr": opts["lr"], "warmup": opts["warmup"], "schedule": "constant after warmup",
              "time_cap": opts["time_cap"], "max_steps_factor": opts["max_steps_factor"],
              "budget_fractions": opts["budgets"], "diloco": dataclasses.asdict(cfg.diloco),
              "contenders": spec["contenders"],
              "notes": {**{n: s.note for n, s in CONTENDERS.items()},
                        **{n: resolve(n).note for n in spec["contenders"]}},
              "mtu": opts["mtu"], "runs": runs,
              "clock": "training clock = sum of step times (evaluations excluded), mean over ranks; the first "
                       f"{opts['setup_steps']} steps are charged at the time of the step after them",
              "memory_method": "resident tensor bytes: params + grads + optimizer state (+ comm buffers)"}
    return {"config": config, "results": results}


def default_out(opts: dict[str, Any]) -> Path:
    return Path(opts.get("out") or f"bench_out/link-w{opts['world']}.json")


def finish_outputs(doc: dict[str, Any], stem: Path) -> list[Path]:
    """Write ``<stem>-link.md`` and one plot per bandwidth."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    md = stem.with_name(f"{stem.name}-link.md")
    md.write_text(link_markdown(doc))
    return [md, *plot(doc, stem)]


def run(env: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """Suite entry of ``python -m lowband.bench link`` (called in that process, as rank 0: ``LAUNCHER``)."""
    from lowband.bench.harness import launcher_doc

    stem = default_out(opts).with_suffix("")
    body = launch(opts, stem)
    paths = finish_outputs(launcher_doc("link", int(opts["world"]), body), stem)
    print(f"lowband.bench link: wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return body


def main(argv: list[str] | None = None) -> int:
    """``python -m lowband.bench.link --world N [options]``: the same suite, launched from this process."""
    from lowband.bench.harness import launcher_doc, markdown_table, write_outputs

    p = argparse.ArgumentParser(prog="python -m lowband.bench.link")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--threads", type=int, default=1)
    add_arguments(p)
    opts = vars(p.parse_args(argv))
    out = default_out(opts)
    try:
        body = launch(opts, out.with_suffix(""))
    except (ValueError, PermissionError) as e:
        print(f"lowband.bench link: {e}", file=sys.stderr)
        return 2

    doc = launcher_doc("link", opts["world"], body)
    path, md = write_outputs(doc, out)
    paths = finish_outputs(doc, out.with_suffix(""))
    print(markdown_table(doc))
    print(f"lowband.bench link: wrote {path}, {md}, {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
