"""Guard rails of the training loop: non-finite steps and dead peers.

:class:`NonFiniteGuard` decides, identically on every rank, whether this step's update is applied.
Communication: one all-reduce (``max``) of ``world_size + 3`` float64 flags per step on the metrics
``Comm`` (tag ``guard``, not counted as training traffic): flag ``r`` says rank ``r``'s loss was NaN/inf,
flag ``world_size`` that some rank saw a non-finite gradient norm, flag ``world_size + 1`` carries the
number of a signal some rank received (``lowband.train.stop``; 0 = none), so every rank stops after the
same step, and flag ``world_size + 2`` that some rank's background work is still running (``busy``: the
trainer's async checkpoint save), so every rank commits that work at the same step. Every rank therefore
sees the same verdict and either calls ``strategy.optimizer_step()`` or ``strategy.skip_step()``; no rank
updates its shard of a sharded state while another skips. After ``max_consecutive`` skips in a row (or at
the first one when skipping is off) every rank raises :class:`NonFiniteStepError` with the same message.

:func:`peer_failure_guard` turns the backend's error when a peer dies or stops answering (gloo: a
connection reset at once, or a timeout after the process-group timeout) into a
:class:`PeerFailureError` that names the rank and the timeout, so the surviving ranks exit non-zero
with a clear message instead of hanging.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.train import stop


class NonFiniteStepError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm (same message on every rank)."""


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died or stopped responding.

    ``str(e)`` starts with ``rank R of N:``; ``e.detail`` is the same message without it (the CLI
    launcher merges identical messages of several ranks).
    """

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = message if detail is None else detail


@dataclass
class GuardVerdict:
    """The outcome of :meth:`NonFiniteGuard.check` for one step (identical on every rank).

    Attributes:
        skip: the update must be skipped.
        bad_loss_ranks: ranks whose local loss was NaN/inf.
        bad_grad_norm: some rank saw a NaN/inf gradient norm.
        consecutive: skipped steps in a row, this one included (0 if not skipped).
        total: skipped steps so far in the run.
        message: one line for the log ("" when the step is fine).
        stop: the number of a signal some rank received (stop after this step), or 0.
        busy: some rank passed ``busy=True`` to :meth:`NonFiniteGuard.check`.
    """

    skip: bool
    bad_loss_ranks: list[int] = field(default_factory=list)
    bad_grad_norm: bool = False
    consecutive: int = 0
    total: int = 0
    message: str = ""
    stop: int = 0
    busy: bool = False


class NonFiniteGuard:
    """Skip steps with a non-finite loss or gradient norm on every rank alike; stop after too many.

    Args:
        comm: the ``Comm`` its one flag all-reduce per step goes through (the trainer passes the
            metrics comm so the ledger of training traffic is unchanged).
        skip_nonfinite: skip such steps (``True``) or raise at the first one (``False``).
        max_consecutive: raise :class:`NonFiniteStepError` when this many steps in a row were skipped.

    Raises:
        ValueError: ``max_consecutive`` < 1.
    """

    def __init__(self, comm: Comm, skip_nonfinite: bool = True, max_consecutive: int = 3) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"guard.max_consecutive must be an integer >= 1, got {max_consecutive!r}")
        self.comm = comm
        self.skip_nonfinite = bool(skip_nonfinite)
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0
        self.skipped_steps: list[int] = []

    def check(self, step: int, loss: torch.Tensor | float, grad_norm: float | torch.Tensor,
              busy: bool = False) -> GuardVerdict:
        """Collective: agree whether global step ``step`` (1-based) is skipped; raise if the run must stop.

        Args:
            step: the 1-based step number (for messages and ``skipped_steps``).
            loss: this rank's loss for the step (any float tensor or number).
            grad_norm: the gradient norm the strategy computed (global, or this rank's view of it).
            busy: this rank's background work is still running (the verdict's ``busy`` is the OR over ranks).
        """
        world, rank = self.comm.size, self.comm.rank
        flags = torch.zeros(world + 3, dtype=torch.float64)
        loss_value = float(loss.detach().double().cpu()) if isinstance(loss, torch.Tensor) else float(loss)
        norm_value = float(grad_norm.detach().double().cpu()) if isinstance(grad_norm, torch.Tensor) \
            else float(grad_norm)
        flags[rank] = 0.0 if math.isfinite(loss_value) else 1.0
        flags[world] = 0.0 if math.isfinite(norm_value) else 1.0
        flags[world + 1] = float(stop.requested())
        flags[world + 2] = float(bool(busy))
        self.comm.all_reduce(flags, "max", tag="guard")
        bad_ranks = [r for r in range(world) if flags[r] > 0]
        bad_norm = bool(flags[world] > 0)
        stop_signal = int(flags[world + 1])
        anyone_busy = bool(flags[world + 2] > 0)
        if not bad_ranks and not bad_norm:
            self.consecutive = 0
            return GuardVerdict(skip=False, stop=stop_signal, busy=anyone_busy)
        what = []
        if bad_ranks:
            what.append(f"non-finite loss on rank{'s' if len(bad_ranks) > 1 else ''} "
                        f"{', '.join(map(str, bad_ranks))}")
        if bad_norm:
            what.append("non-finite gradient norm")
        reason = " and ".join(what)
        self.consecutive += 1
        self.total += 1
        self.skipped_steps.append(step)
        if not self.skip_nonfinite:
            raise NonFiniteStepError(f"step {step}: {reason}; stopping because guard.skip_nonfinite = false "
                                     "(no update was applied for this step)")
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteStepError(
                f"step {step}: {reason}; {self.consecutive} steps in a row were non-finite "
                f"(guard.max_consecutive = {self.max_consecutive}), stopping. Parameters and optimizer state "
                f"are those after step {step - self.consecutive} (skipped steps applied no update); "
                "lower optim.lr or resume from an earlier checkpoint")
        msg = (f"step {step}: {reason}; update skipped on every rank ({self.consecutive} in a row, "
               f"{self.total} in this run)")
        return GuardVerdict(skip=True, bad_loss_ranks=bad_ranks, bad_grad_norm=bad_norm,
                            consecutive=self.consecutive, total=self.total, message=msg, stop=stop_signal,
                            busy=anyone_busy)

    def state_dict(self) -> dict[str, Any]:
        """Counters, for the checkpoint."""
        return {"consecutive": self.consecutive, "total": self.total, "skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state["consecutive"])
        self.total = int(state["total"])
        self.skipped_steps = [int(s) for s in state.get("skipped_steps", [])]


_PEER_FAILURE_MARKERS = (
    "connection reset", "connection closed", "connection refused", "broken pipe", "timed out",
    "timeout", "gloo", "nccl", "socket", "peer",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend's error for a dead or unresponsive peer (not a bug in this rank)."""
    if isinstance(exc, PeerFailureError):
        return False  # already converted
    dist_errors = tuple(getattr(dist, n) for n in ("DistBackendError", "DistNetworkError", "DistStoreError")
                        if hasattr(dist, n))
    if dist_errors and isinstance(exc, dist_errors):
        return True
    if type(exc) is RuntimeError:
        text = str(exc).lower()
        return any(m in text for m in _PEER_FAILURE_MARKERS)
    return False


@contextlib.contextmanager
def peer_failure_guard(rank: int, world_size: int, timeout_s: float) -> Iterator[None]:
    """Re-raise a dead/unresponsive-peer backend error as :class:`PeerFailureError` naming the timeout."""
    try:
        yield
    except Exception as e:
        if world_size > 1 and is_peer_failure(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            detail = (f"a collective failed because a peer process died or stopped responding (process-group "
                      f"timeout run.timeout_s = {timeout_s:g} s); this rank stops. Backend error: {first}")
            raise PeerFailureError(f"rank {rank} of {world_size}: {detail}", detail=detail) from e
        raise
