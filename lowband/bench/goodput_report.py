"""The ``goodput`` suite's own outputs: ``<stem>-goodput.md`` (table and the issue's target checks) and one plot per
bandwidth (training loss against wall time, per contender, every group's launches, kills and restarts marked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GOODPUT_TARGET = 0.90
STATIC_FACTOR = 2.0
VAL_LOSS_FACTOR = 1.03


def _f(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _loads(load: dict[str, Any] | None) -> str:
    """``a-b; c-d``: the 1-minute load average before and after the fault-free run, then the run with faults."""
    if not load or not load.get("fault_free") or not load.get("faults"):
        return ""
    return "; ".join(f"{run[0][0]:.1f}-{run[1][0]:.1f}" for run in (load["fault_free"], load["faults"]))


def target_checks(doc: dict[str, Any], rate: str) -> list[str]:
    """The issue-22 targets at one bandwidth as lines (met / MISSED with the numbers), for the best compressed
    ft contender (highest goodput among ``ft-<codec>``, fp32 excluded)."""
    cfg = doc["config"]
    rows = {r["contender"]: r for r in doc["results"] if r["bandwidth"] == rate and "error" not in r}
    compressed = [r for n, r in rows.items() if n.startswith("ft-") and n != "ft-fp32"]
    if not compressed:
        return [f"{rate}: no compressed ft contender ran; targets not checked"]
    best = max(compressed, key=lambda r: r["goodput"])
    name, lines = best["contender"], []
    lines.append(f"{rate}: {name} goodput {best['goodput']:.3f} (>= {GOODPUT_TARGET}): "
                 f"{'met' if best['goodput'] >= GOODPUT_TARGET else 'MISSED'}")
    static = rows.get("static")
    if static is None:
        lines.append(f"{rate}: static did not run; the {STATIC_FACTOR:g}x target is not checked")
    else:
        ratio = best["goodput"] / static["goodput"] if static["goodput"] > 0 else float("inf")
        lines.append(f"{rate}: {name} goodput / static's {static['goodput']:.3f} = {ratio:.2f} (>= {STATIC_FACTOR:g}): "
                     f"{'met' if ratio >= STATIC_FACTOR else 'MISSED'}")
    vr = best["val_loss_ratio"]
    lines.append(f"{rate}: {name} final val loss {_f(best['final_val_loss'], '.4f')} = {_f(vr, '.4f')} x its "
                 f"fault-free {_f(best['fault_free_final_val_loss'], '.4f')} (<= {VAL_LOSS_FACTOR}): "
                 f"{'met' if vr is not None and vr <= VAL_LOSS_FACTOR else 'MISSED'}")
    lines.append(f"{rate}: {name} replicas bitwise equal at the end: "
                 f"{'met' if best['replicas_bitwise_equal'] else 'MISSED'}")
    bound = cfg["quorum_timeout_s"] + best["fault_free_max_stall_s"]
    lines.append(f"{rate}: {name} max stall {best['max_stall_s']:.2f} s (<= quorum timeout "
                 f"{cfg['quorum_timeout_s']:g} s "
                 f"+ one sync, the fault-free run's longest step {best['fault_free_max_stall_s']:.2f} s): "
                 f"{'met' if best['max_stall_s'] <= bound else 'MISSED'}")
    want = len(cfg["faults"])
    lines.append(f"{rate}: {name} kills {best['kills']}, rejoins {best['rejoins']} (the schedule has {want}): "
                 f"{'met' if best['kills'] == want and best['rejoins'] == want else 'MISSED'}")
    return lines


def _cpus(cpus: float | None) -> str:
    if cpus is None:
        return "CPU per group not recorded"
    return f"each group capped at {cpus:g} CPU (a cgroup per machine)" if cpus > 0 else "no CPU cap per group"


def goodput_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    faults = ", ".join(f"kill group {f['group']} at {f['at']:.0%}, back {f['down']:.0%} later" for f in cfg["faults"])
    lines = [f"### `goodput` — {cfg['groups']} replica groups, one CPU rank each, torch {doc['torch']}", "",
             f"Config {cfg['config']}, {cfg['steps']} inner steps, sync every {cfg['sync_every']}, "
             f"{cfg['fragments']} fragment(s); faults: {faults or 'none'}; static: wire {cfg['static_wire']}, "
             f"checkpoint every {cfg['static_checkpoint_every']} steps; quorum timeout {cfg['quorum_timeout_s']:g} s, "
             f"heartbeat timeout {cfg['heartbeat_timeout_ms']} ms; "
             f"{_cpus(cfg.get('cpus_per_group'))}.", ""]
    if cfg.get("interrupted"):
        lines += [f"**Incomplete**: {cfg['interrupted']}; only the contenders that finished are below.", ""]
    for rate in cfg["bandwidths"]:
        rows = [r for r in doc["results"] if r["bandwidth"] == rate]
        if not rows:
            continue
        lines += [f"#### {rate}", "",
                  "| contender | goodput | run s | fault-free s | final val | fault-free val | ratio | kills | "
                  "rejoins | max stall s | heal s | wire MB | iface tx MB | bitwise equal | load 1 min (ff; faults) |",
                  "| --- " + "| ---: " * 12 + "| --- | --- |"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['contender']} | error: {r['error']} |")
                continue
            lines.append(
                f"| {r['contender']} | {r['goodput']:.3f} | {r['run_s']:.1f} | {r['fault_free_s']:.1f} | "
                f"{_f(r['final_val_loss'], '.4f')} | {_f(r['fault_free_final_val_loss'], '.4f')} | "
                f"{_f(r['val_loss_ratio'], '.4f')} | {r['kills']} | {r['rejoins']} | {r['max_stall_s']:.2f} | "
                f"{_f(r['heal_s'], '.1f')} | {r['wire_bytes_total'] / 1e6:.3f} | "
                f"{r['iface_tx_bytes_total'] / 1e6:.3f} | "
                f"{'yes' if r['replicas_bitwise_equal'] else 'NO'} | {_loads(r.get('load_avg'))} |")
        lines.append("")
        lines += [f"- {t}" for t in target_checks(doc, rate)]
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], stem: Path) -> list[Path]:
    """One PNG per bandwidth: a panel per contender, training loss (per step row) against wall time of every launch
    of every group, the fault-free run's group 0 dashed; kills (red) and restarts (green) as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for rate in doc["config"]["bandwidths"]:
        rows = [r for r in doc["results"] if r["bandwidth"] == rate and "error" not in r]
        if not rows:
            continue
        cols = min(2, len(rows))
        nrows = (len(rows) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 3.6 * nrows), squeeze=False, sharey=True)
        colors = plt.get_cmap("tab10").colors
        for ax, r in zip(axes.flat, rows, strict=False):
            for name, curve in r["curves"].items():
                g = int(name.split("-")[0][1:])
                ax.plot([p[0] for p in curve], [p[2] for p in curve], color=colors[g % len(colors)], linewidth=0.9,
                        label=name)
            ff = r["fault_free_curves"].get("g0-i0", [])
            ax.plot([p[0] for p in ff], [p[2] for p in ff], color="k", linestyle="--", linewidth=0.8,
                    label="fault-free g0")
            for t, what, _g in r["events"]:
                if what not in ("kill", "start"):
                    continue
                ax.axvline(t, color="tab:red" if what == "kill" else "tab:green", linewidth=0.8, alpha=0.7)
            ax.set_title(f"{r['contender']}: goodput {r['goodput']:.3f}", fontsize=9)
            ax.set_xlabel("wall time since launch (s)")
            ax.set_ylabel("training loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
        for ax in list(axes.flat)[len(rows):]:
            ax.set_visible(False)
        fig.suptitle(f"goodput {rate}, {doc['config']['groups']} groups: kills red, restarts green")
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{rate}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def finish_outputs(doc: dict[str, Any], stem: Path) -> list[Path]:
    """Write ``<stem>-goodput.md`` and one plot per bandwidth."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    md = stem.with_name(f"{stem.name}-goodput.md")
    md.write_text(goodput_markdown(doc))
    return [md, *plot(doc, stem)]
