"""Run directory outputs: the rank-0 log line, ``metrics.jsonl`` and the loss / wire-bytes plot."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def format_log_line(row: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {row['step']:>5}/{total_steps}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}",
             f"tok/s {row['tokens_per_s']:,.0f}", f"wire {row['wire_mb']:.2f} MB",
             f"mem {row['peak_mem_bytes'] / 2**20:,.0f} MB", f"{row['step_time_s'] * 1000:.0f} ms"]
    if row.get("grad_norm") is not None:
        parts.insert(3, f"gnorm {row['grad_norm']:.3f}")
    for k, v in row.get("extras", {}).items():
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)


class RunWriter:
    """Writes ``metrics.jsonl`` (one JSON object per line) and ``loss.png`` into the run directory.

    Only rank 0 creates one; other ranks pass ``None`` around.
    """

    def __init__(self, run_dir: Path, stream: TextIO | None = None) -> None:
        self.run_dir = run_dir
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
        self.plot()

    def plot(self) -> Path | None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [r for r in self.rows if "loss" in r]
        val = [r for r in self.rows if "val_loss" in r]
        if not train and not val:
            return None
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        if train:
            ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
            ax2.plot([r["step"] for r in train], [r["wire_bytes"] for r in train], color="tab:red")
        if val:
            ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
        ax1.set_ylabel("loss")
        ax1.legend()
        ax1.grid(alpha=0.3)
        ax2.set_ylabel("wire bytes / step / rank")
        ax2.set_xlabel("step")
        ax2.grid(alpha=0.3)
        fig.tight_layout()
        path = self.run_dir / "loss.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
