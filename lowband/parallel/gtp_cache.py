"""Reusable unsharded buffers for GTP: gathered weights, wgrad scratch, reduce-scatter outputs.

State layout: one free list per *key* ``(shape, dtype, direction, parity, device)``. A caller asks
for a buffer with a *ticket* (a stable, hashable name such as ``(weight_uid, "fwd", "main")``);
``get`` hands out the buffer the ticket held last time if it is free (affinity), else any free
buffer of the key, else a new one; ``release`` puts it back. Because the schedule is the same every
step, every ticket gets the same buffer, hence the same ``data_ptr``, from the second step on (a
CUDA-graph requirement): by induction, at each ``get`` the set of held buffers equals the previous
step's, so the buffer the ticket got last step is free now.

Chain neighbours carry different parity bits (``index % 2``), so they never share a key, hence never
a buffer. The number of buffers per key is the number of that key's buffers live at once (one per
key for weights gathered one ahead; ``depth + 1`` for wgrad scratch under a finalize depth).

Counters: live bytes per category (``gather``, ``wgrad``, ``rs_out``) and the high-water of the
*unsharded* live bytes (``gather + wgrad``) per phase (``fwd`` / ``bwd``), and the ``data_ptr``
history of every ticket. No collective here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

import torch

UNSHARDED = ("gather", "wgrad")
CATEGORIES = ("gather", "wgrad", "rs_out")


class GTPBufferCache:
    """Keyed pool of reusable buffers with per-ticket affinity and live-byte counters."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._key_of: dict[int, tuple] = {}
        self._cat_of: dict[int, str] = {}
        self._held: dict[int, torch.Tensor] = {}
        self._last: dict[Hashable, torch.Tensor] = {}
        self.ptr_history: dict[Hashable, list[int]] = defaultdict(list)
        self.buffers: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self.live_bytes: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.high_water: dict[str, int] = {}
        self.phase = "fwd"

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def live_unsharded_bytes(self) -> int:
        return sum(self.live_bytes[c] for c in UNSHARDED)

    def get(self, ticket: Hashable, shape: tuple[int, ...], dtype: torch.dtype, direction: str,
            parity: int, device: torch.device, category: str = "gather") -> torch.Tensor:
        """A buffer of ``shape``/``dtype`` for ``ticket`` (contents undefined)."""
        if category not in CATEGORIES:
            raise ValueError(f"GTPBufferCache.get: category {category!r} not in {CATEGORIES}")
        key = (tuple(shape), dtype, direction, parity, str(device))
        free = self._free[key]
        prev = self._last.get(ticket)
        buf = None
        if prev is not None:
            for i, b in enumerate(free):
                if b is prev:
                    buf = free.pop(i)
                    break
        if buf is None:
            if free:
                buf = free.pop()
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
                self.buffers[key].append(buf)
                self._key_of[id(buf)] = key
        self._last[ticket] = buf
        self._held[id(buf)] = buf
        self._cat_of[id(buf)] = category
        self.ptr_history[ticket].append(buf.data_ptr())
        self.live_bytes[category] += self._nbytes(buf)
        live = self.live_unsharded_bytes()
        if live > self.high_water.get(self.phase, 0):
            self.high_water[self.phase] = live
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return ``buf`` to its key's free list (the ticket keeps its affinity)."""
        if self._held.pop(id(buf), None) is None:
            raise ValueError("GTPBufferCache.release: buffer is not held (double release?)")
        self.live_bytes[self._cat_of.pop(id(buf))] -= self._nbytes(buf)
        self._free[self._key_of[id(buf)]].append(buf)

    def held(self) -> int:
        """Number of buffers currently handed out."""
        return len(self._held)

    def reset_stats(self) -> None:
        """Forget the high-water marks (buffers, affinities and pointer histories are kept)."""
        self.high_water = {}

    def num_buffers(self, direction: str | None = None) -> int:
        """Buffers ever allocated (optionally only those of one direction)."""
        return sum(len(v) for k, v in self.buffers.items() if direction is None or k[2] == direction)

    def clear(self) -> None:
        """Drop every free buffer (held ones stay valid); tickets re-allocate lazily."""
        if self._held:
            raise ValueError(f"GTPBufferCache.clear: {len(self._held)} buffers are still held")
        self._free.clear()
        self._key_of.clear()
        self._last.clear()
        self.buffers.clear()
