"""Optional TensorBoard scalars (``run.tensorboard = true``), written by rank 0 into ``<run_dir>/tensorboard/``.

Needs the ``tensorboard`` package (``pip install 'lowband[tb]'``); :func:`check_tensorboard` raises a
:class:`~lowband.train.config.ConfigError` on every rank alike, before any collective, when it is missing.
Communication: none (rank 0 writes local files).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

TB_DIR = "tensorboard"
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "wire_mb": "wire/mb_per_step",
           "wire_bytes_cumulative": "wire/bytes_cumulative",
           "allreduce_ref_bytes_cumulative": "wire/allreduce_ref_bytes_cumulative", "val_loss": "val/loss"}
"""Row field -> TensorBoard tag."""


def check_tensorboard(enabled: bool) -> None:
    """Raise ``ConfigError`` if ``run.tensorboard`` is on and the ``tensorboard`` package is not installed."""
    if enabled and importlib.util.find_spec("tensorboard") is None:
        from lowband.train.config import ConfigError

        raise ConfigError("run.tensorboard = true needs the tensorboard package: pip install 'lowband[tb]' "
                          "(or set run.tensorboard = false)")


class TensorBoardWriter:
    """Writes the scalars of each metrics row (:data:`SCALARS`) at its ``step`` with torch's ``SummaryWriter``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / TB_DIR
        self._w = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, row: dict[str, Any]) -> None:
        for key, tag in SCALARS.items():
            v = row.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                self._w.add_scalar(tag, float(v), global_step=int(row["step"]))

    def close(self) -> None:
        self._w.flush()
        self._w.close()
