"""Run directory outputs: per-interval figures, the rank-0 log line, ``metrics.jsonl`` and the plot.

:class:`IntervalMeter` accumulates every optimizer step's figures between two logged rows and turns
them into one row of interval means and totals (no collective of its own: the trainer averages the
interval's loss over ranks with one all-reduce at log time). :class:`RunWriter` writes the rows to
``metrics.jsonl`` and draws ``loss.png`` (loss; cumulative wire bytes against the fp32 all-reduce
reference).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections import deque
from pathlib import Path
from typing import Any, TextIO

import torch

from lowband.comm.ledger import ring_wire_bytes


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def allreduce_reference_bytes(param_shapes: dict[str, tuple[list[int], str]], world_size: int) -> int:
    """Per-rank wire bytes of one fp32 ring all-reduce of every gradient of the model, by the ledger's ring
    model: ``2 (N-1)/N * 4 P`` with ``P`` the logical (unsharded, tied counted once) parameter count of
    ``param_shapes`` (:meth:`Strategy.param_shapes`); 0 on one rank."""
    numel = sum(math.prod(shape) for shape, _dtype in param_shapes.values())
    return ring_wire_bytes("all_reduce", world_size, 4 * numel)


def format_bytes(n: float) -> str:
    """Bytes in decimal units with 3 significant digits: ``512 B``, ``26.7 kB``, ``13.4 MB``, ``2.05 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float) -> str:
    """``3m12s``-style duration: ``45s``, ``3m12s``, ``2h05m``."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class IntervalMeter:
    """Per-step figures accumulated over one logging interval (the steps since the previous logged row).

    Call :meth:`add` once per optimizer step with this rank's figures, then at a logged step reduce
    :meth:`local_loss_mean` over ranks (the trainer's one all-reduce) and pass it to :meth:`row`, which
    returns the interval's row and starts the next interval. Communication: none.

    State: the interval's sums (loss as a float64 tensor on the loss's device, so no per-step host sync;
    grad norm, step time, wire bytes, collectives, skipped steps as Python numbers), the cumulative wire
    bytes and fp32 all-reduce reference bytes since step 0 (``cumulative`` / ``ref_cumulative``, restored
    from a checkpoint on resume), and the last ``recent`` step times for the time-remaining estimate.

    Args:
        tokens_per_step: global tokens per optimizer step (all ranks).
        ref_bytes_per_step: :func:`allreduce_reference_bytes` of the model on this world.
        recent: how many recent step times the ETA averages.
    """

    def __init__(self, tokens_per_step: int, ref_bytes_per_step: int, recent: int = 20) -> None:
        self.tokens_per_step = tokens_per_step
        self.ref_bytes_per_step = ref_bytes_per_step
        self.cumulative = 0
        """This rank's wire bytes since step 0 (a resumed run starts from the checkpoint's count)."""
        self.ref_cumulative = 0
        """fp32 all-reduce reference bytes since step 0."""
        self.run_wire_bytes = 0
        """This rank's wire bytes in this run (since the start or resume step)."""
        self.run_ref_bytes = 0
        self.run_steps = 0
        self.run_time_s = 0.0
        """Sum of this run's step times (training only: no validation, checkpoints or setup)."""
        self._recent: deque[float] = deque(maxlen=recent)
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self._loss: torch.Tensor | None = None
        self._grad_norm = 0.0
        self._time = 0.0
        self._wire = 0
        self._collectives = 0
        self._skipped = 0

    def add(self, loss: torch.Tensor, grad_norm: float, step_time_s: float, wire_bytes: int, collectives: int,
            skipped: bool) -> None:
        """One optimizer step: this rank's mean microbatch loss (0-dim tensor), the global grad norm, the
        step's wall time, its ledger totals (``mark_step()``), and whether the guard skipped it."""
        loss = loss.detach().double()
        self._loss = loss.clone() if self._loss is None else self._loss + loss
        self._grad_norm += grad_norm
        self._time += step_time_s
        self._wire += wire_bytes
        self._collectives += collectives
        self._skipped += int(skipped)
        self.steps += 1
        self.cumulative += wire_bytes
        self.ref_cumulative += self.ref_bytes_per_step
        self.run_wire_bytes += wire_bytes
        self.run_ref_bytes += self.ref_bytes_per_step
        self.run_steps += 1
        self.run_time_s += step_time_s
        self._recent.append(step_time_s)

    def local_loss_mean(self) -> torch.Tensor:
        """This rank's mean loss over the interval's steps (float64, on CPU), to be averaged over ranks."""
        if self._loss is None:
            raise RuntimeError("IntervalMeter: no step since the last row")
        return (self._loss / self.steps).cpu()

    def eta_s(self, remaining_steps: int) -> float:
        """Time-remaining estimate: the mean of the recent step times times ``remaining_steps``."""
        if not self._recent:
            return 0.0
        return sum(self._recent) / len(self._recent) * max(remaining_steps, 0)

    def row(self, loss: float, remaining_steps: int) -> dict[str, Any]:
        """The interval's figures (``loss``: the rank-averaged :meth:`local_loss_mean`); starts a new interval.

        Fields: ``interval_steps``; means per step of ``loss``, ``grad_norm``, ``step_time_s``,
        ``wire_bytes`` (``wire_mb`` = /1e6) and ``collectives``; ``tokens_per_s`` (interval tokens / interval
        time); ``wire_bytes_total`` (interval total); ``wire_bytes_cumulative`` and
        ``allreduce_ref_bytes_cumulative`` (since step 0); ``skipped`` (some step in the interval was
        skipped), ``skipped_in_interval``; ``eta_s``.
        """
        n = self.steps
        if n == 0:
            raise RuntimeError("IntervalMeter: no step since the last row")
        out = {"interval_steps": n, "loss": loss, "grad_norm": self._grad_norm / n,
               "tokens_per_s": self.tokens_per_step * n / self._time if self._time > 0 else 0.0,
               "step_time_s": self._time / n, "wire_bytes": self._wire / n, "wire_mb": self._wire / n / 1e6,
               "wire_bytes_total": self._wire, "wire_bytes_cumulative": self.cumulative,
               "allreduce_ref_bytes_cumulative": self.ref_cumulative, "collectives": self._collectives / n,
               "skipped": self._skipped > 0, "skipped_in_interval": self._skipped,
               "eta_s": self.eta_s(remaining_steps)}
        self._reset()
        return out

    def state_dict(self) -> dict[str, int]:
        """The cumulative counters a checkpoint keeps (this rank's)."""
        return {"wire_bytes_cumulative": self.cumulative, "allreduce_ref_bytes_cumulative": self.ref_cumulative}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cumulative = int(state["wire_bytes_cumulative"])
        self.ref_cumulative = int(state["allreduce_ref_bytes_cumulative"])


def format_log_line(row: dict[str, Any], total_steps: int) -> str:
    """The rank-0 log line of one row: interval means, and the time-remaining estimate when known."""
    parts = [f"step {row['step']:>5}/{total_steps}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}",
             f"tok/s {row['tokens_per_s']:,.0f}", f"wire {format_bytes(row['wire_bytes'])}/step",
             f"mem {row['peak_mem_bytes'] / 2**20:,.0f} MB", f"{row['step_time_s'] * 1000:.0f} ms"]
    if row.get("grad_norm") is not None:
        parts.insert(3, f"gnorm {row['grad_norm']:.3f}")
    if row.get("wire_bytes_cumulative") is not None:
        parts.insert(6, f"sent {format_bytes(row['wire_bytes_cumulative'])}")
    if row.get("eta_s") is not None and row["step"] < total_steps:
        parts.append(f"eta {format_duration(row['eta_s'])}")
    for k, v in row.get("extras", {}).items():
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)


class RunWriter:
    """Writes ``metrics.jsonl`` (one JSON object per line) and ``loss.png`` (unless ``plot=False``) into the
    run directory.

    Only rank 0 creates one; other ranks pass ``None`` around.
    """

    def __init__(self, run_dir: Path, stream: TextIO | None = None, plot: bool = True) -> None:
        self.run_dir = run_dir
        self.draw_plot = plot  # loss.png at close (run.plot)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"
        self._fh = self.metrics_path.open("w")
        self.stream = stream or sys.stdout
        self.rows: list[dict[str, Any]] = []

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def echo(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        self._fh.close()
        if self.draw_plot:
            self.plot()

    def plot(self) -> Path | None:
        """``loss.png``: train (interval means) and validation loss; cumulative wire bytes per rank with the
        fp32 all-reduce reference as a dashed line (rows of older runs without the cumulative fields are
        left out of the bytes panel)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [r for r in self.rows if "loss" in r]
        val = [r for r in self.rows if "val_loss" in r]
        if not train and not val:
            return None
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        if train:
            ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (interval mean)")
        cum = [r for r in train if "wire_bytes_cumulative" in r]
        if cum:
            steps = [r["step"] for r in cum]
            ax2.plot(steps, [r["wire_bytes_cumulative"] / 1e6 for r in cum], color="tab:red", label="this run")
            ax2.plot(steps, [r["allreduce_ref_bytes_cumulative"] / 1e6 for r in cum], "--", color="tab:gray",
                     label="fp32 all-reduce of the gradients")
            ax2.legend()
        if val:
            ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
        ax1.set_ylabel("loss")
        ax1.legend()
        ax1.grid(alpha=0.3)
        ax2.set_ylabel("cumulative wire MB / rank")
        ax2.set_xlabel("step")
        ax2.grid(alpha=0.3)
        fig.tight_layout()
        path = self.run_dir / "loss.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
