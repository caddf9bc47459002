"""Deterministic, resumable, rank-disjoint batches of next-token windows from one token array.

Windows: window ``w`` is ``tokens[w * seq_len : w * seq_len + seq_len + 1]`` for
``w in [0, W)``, ``W = (len(tokens) - 1) // seq_len`` (stride ``seq_len``, one token of overlap so
every target has its input).

Stream: epoch ``e`` visits the windows in the order ``perm_e = default_rng([seed, e]).permutation(W)``.
An epoch has ``S = W // G`` global steps, ``G = batch_size * world_size``; global step ``s`` is step
``s % S`` of epoch ``s // S`` and consumes positions ``[(s % S) * G, (s % S + 1) * G)`` of ``perm_e``;
rank ``r`` takes the contiguous ``batch_size`` of them starting at ``(s % S) * G + r * batch_size``.
The last ``W % G`` windows of each permutation are dropped (a different set each epoch), so a global
batch never straddles two epochs: letting it wrap into the next epoch's permutation could put the same
window twice into one global batch, on two ranks.

Consequences, all tested:

* ranks of one step get disjoint windows (``G <= W`` is required);
* a batch depends only on ``(tokens, seq_len, seed, G, step, rank)``: resuming at step ``k``
  (``start_step=k`` or :meth:`DistributedLoader.load_state_dict`) gives exactly the batches that
  iterating from 0 gives after ``k`` steps;
* the rank batches of step ``s`` concatenated over ``r = 0..N-1`` equal the single-process batch
  (``world_size=1``, ``batch_size * N``) of step ``s``, which is what makes DDP testable against
  single-process training.

No communication: each rank computes its own slice from the shared seed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"DistributedLoader {name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"DistributedLoader {name} must be >= {low}, got {value}")
    return int(value)


class DistributedLoader:
    """Iterator of ``(x, y)`` int64 tensors of shape ``(batch_size, seq_len)``, ``y`` = ``x`` shifted by one.

    Args:
        tokens: 1-D integer token array (numpy, memmap or CPU tensor); it is not copied.
        batch_size: sequences per rank per step.
        seq_len: tokens per sequence.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of data-parallel ranks.
        seed: non-negative int; the window order of epoch ``e`` is seeded by ``(seed, e)``.
        start_step: global step of the first batch ``next()`` returns.

    Raises:
        TypeError / ValueError: a bad argument (named), or ``tokens`` too short for one global batch.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, batch_size: int, seq_len: int, rank: int,
                 world_size: int, seed: int = 0, start_step: int = 0) -> None:
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"DistributedLoader rank must be in [0, world_size={self.world_size}), "
                             f"got {rank}")
        self.seed = _check_int("seed", seed, 0)
        self.step = _check_int("start_step", start_step, 0)
        if isinstance(tokens, torch.Tensor):
            if tokens.device.type != "cpu":
                raise ValueError(f"DistributedLoader tokens must be on the CPU, got device {tokens.device}")
            tokens = tokens.numpy()
        tokens = np.asarray(tokens)
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"DistributedLoader tokens must be integer ids, got dtype {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"DistributedLoader tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.global_batch = self.batch_size * self.world_size
        self.n_windows = max(0, (tokens.size - 1) // self.seq_len)
        if self.n_windows < self.global_batch:
            need = self.global_batch * self.seq_len + 1
            raise ValueError(
                f"DistributedLoader tokens too short: {tokens.size} tokens give {self.n_windows} windows of "
                f"seq_len+1={self.seq_len + 1} at stride seq_len={self.seq_len}, but one global batch needs "
                f"batch_size*world_size = {self.batch_size}*{self.world_size} = {self.global_batch} windows "
                f"({need} tokens)")
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def steps_per_epoch(self) -> int:
        """Global steps per epoch, ``n_windows // (batch_size * world_size)`` (>= 1)."""
        return self.n_windows // self.global_batch

    def epoch_of(self, step: int) -> int:
        """The epoch global ``step`` belongs to."""
        return _check_int("step", step, 0) // self.steps_per_epoch

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def windows(self, step: int) -> np.ndarray:
        """Window ids (int64, length ``batch_size``) this rank reads at global ``step``."""
        epoch, within = divmod(_check_int("step", step, 0), self.steps_per_epoch)
        start = within * self.global_batch + self.rank * self.batch_size
        return self._perm(epoch)[start:start + self.batch_size].astype(np.int64)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random access: this rank's ``(x, y)`` at global ``step``; does not move the iterator."""
        rows = self.tokens[self.windows(step)[:, None] * self.seq_len + self._offsets]
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __iter__(self) -> DistributedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"step": next global step, "seed", "seq_len", "global_batch", "n_tokens"}``."""
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_tokens": int(self.tokens.size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["step"]``. The other recorded fields, when present, must match this loader
        (the world size may change as long as ``batch_size * world_size`` stays the same)."""
        if "step" not in state:
            raise ValueError("DistributedLoader state_dict is missing 'step'")
        current = self.state_dict()
        for key in ("seed", "seq_len", "global_batch", "n_tokens"):
            if key in state and int(state[key]) != current[key]:
                raise ValueError(f"DistributedLoader state_dict {key}={state[key]} does not match this "
                                 f"loader's {key}={current[key]}")
        self.step = _check_int("step", state["step"], 0)
