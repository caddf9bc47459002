"""The sharded optimizer's state between its own layout and torch's ``Shard(0)`` layout, with no gather.

:class:`~lowband.optim.sharded.ShardedOptimizer` owns its state by *units*: rank ``s`` holds the flat range
``owner_range(s)`` of an AdamW bucket (pieces of several parameters), or whole matrices of a Muon unit.
Its torch-API :meth:`~lowband.optim.sharded.ShardedOptimizer.state_dict` describes every state tensor as a
``Shard(0)`` ``DTensor`` of the parameter's shape: rank ``r`` holds ``torch.chunk(full, N, 0)[r]``. The two
layouts cut the same elements differently, so each element moves from its owner to its ``Shard(0)`` holder
exactly once, in one ``all_to_all`` (variable splits) per unit over the optimizer's state group
(``tag="state"``); :func:`load_shard0` is the same exchange backwards. Memory beyond the result (this rank's
``Shard(0)`` chunks, about ``1/N`` of the state): one unit's send and receive buffers at a time (the gathered
form held the whole state on every rank). Wire bytes per rank: the elements it owns that another rank's
chunk holds (at most its owned state, plus ``N - 1`` copies of each 0-d parameter's state it owns).

What moves, per unit (in unit order, then member order, then key order, identically on every rank):
AdamW ``exp_avg``, ``exp_avg_sq``; Muon ``momentum_buffer``; and ``master`` where the unit keeps an fp32
master. A unit that has not stepped contributes what its first step creates (zero moments, the master
from the parameter). AdamW ``step`` counters are scalars every rank already holds: not exchanged. A 0-d
parameter's state has no rows to cut: it is a plain 0-d tensor in every rank's state dict (DCP writes it once),
sent by its owner to every rank in the same exchange; loading, the owner takes its own copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowband.optim.buckets import UnitLayout

if TYPE_CHECKING:
    from lowband.optim.sharded import ShardedOptimizer


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``torch.chunk(full, world, dim=0)[rank]`` (empty past the last chunk)."""
    c = -(-rows // world) if rows else 0
    lo = min(rows, rank * c)
    return lo, min(rows, lo + c)


def state_keys(opt: ShardedOptimizer, ui: int) -> list[str]:
    """The state tensors of unit ``ui`` that are laid out like its parameters (exchange order)."""
    unit = opt._units[ui]
    keys = ["exp_avg", "exp_avg_sq"] if unit.layout.kind == "adamw" else ["momentum_buffer"]
    if opt._needs_master(unit):
        keys.append("master")
    return keys


def _owned(lay: UnitLayout, rank: int) -> tuple[int, int]:
    """The flat range (unit coordinates) whose state ``rank`` holds; its local tensors start at the first."""
    lo, hi = lay.owner_range(rank)
    if lay.kind == "adamw":
        return lo, hi
    assert lay.matrix_shape is not None and lay.real_per_rank is not None
    return lo, lo + lay.real_per_rank[rank] * lay.matrix_shape[0] * lay.matrix_shape[1]


def _held(lay: UnitLayout, mi: int, rank: int, *, loading: bool = False) -> tuple[int, int]:
    """The flat range (unit coordinates) of member ``mi`` that ``rank``'s ``Shard(0)`` chunk holds.

    A 0-d member has no rows: its state is a plain tensor every rank holds (DCP writes it once), so when saving
    its owner sends it to every rank; when ``loading``, the owner takes its own copy (no rank sends it)."""
    m = lay.members[mi]
    if not len(m.shape):
        if not loading:
            return m.offset, m.offset + 1
        o_lo, o_hi = _owned(lay, rank)
        return (m.offset, m.offset + 1) if o_lo <= m.offset < o_hi else (m.offset, m.offset)
    rows = m.shape[0]
    row = m.numel // rows if rows else 0
    lo, hi = chunk_rows(rows, lay.world_size, rank)
    return m.offset + lo * row, m.offset + hi * row


def _segment(lay: UnitLayout, mi: int, owner: int, holder: int, *, loading: bool = False) -> tuple[int, int]:
    """Flat range of member ``mi`` that ``owner`` owns and ``holder``'s chunk holds (``a >= b``: none)."""
    o_lo, o_hi = _owned(lay, owner)
    h_lo, h_hi = _held(lay, mi, holder, loading=loading)
    return max(o_lo, h_lo), min(o_hi, h_hi)


def held_shape(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s ``Shard(0)`` chunk of a state tensor of ``shape`` (``()`` for a 0-d one, which
    every rank holds whole)."""
    if not shape:
        return ()
    lo, hi = chunk_rows(shape[0], world, rank)
    return (hi - lo, *shape[1:])


def owned_master(opt: ShardedOptimizer, ui: int) -> torch.Tensor:
    """This rank's fp32 master of unit ``ui`` as a 1-D tensor over its owned range: the kept one, or before the
    unit's first step the one that step would create (the owned parameters in the accumulation dtype)."""
    unit = opt._units[ui]
    st = opt.state.get(ui, {})
    if "master" in st:
        return st["master"].reshape(-1)
    lo, hi = _owned(unit.layout, opt.comm.rank)
    return unit.param_buf[lo:hi].to(unit.grad_shard.dtype)


def _owned_state(opt: ShardedOptimizer, ui: int) -> dict[str, torch.Tensor]:
    """This rank's state tensors of unit ``ui`` as 1-D views over its owned range (what a first step would
    create where the unit has not stepped)."""
    unit = opt._units[ui]
    lay, acc, dev = unit.layout, unit.grad_shard.dtype, unit.grad_shard.device
    st = opt.state.get(ui, {})
    lo, hi = _owned(lay, opt.comm.rank)
    out = {}
    for key in state_keys(opt, ui):
        if key == "master":
            out[key] = owned_master(opt, ui)
        elif key in st:
            out[key] = st[key].reshape(-1)
        else:
            out[key] = torch.zeros(hi - lo, dtype=acc, device=dev)
    return out


def _exchange(comm: Any, sends: list[list[torch.Tensor]], recv_sizes: list[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """One ``all_to_all`` (variable splits, ``tag="state"``): ``sends[r]`` concatenated to rank ``r``; returns
    what every rank sent here, in rank order."""
    send_sizes = [sum(t.numel() for t in parts) for parts in sends]
    send = (torch.cat([t.reshape(-1) for parts in sends for t in parts]) if sum(send_sizes)
            else torch.empty(0, dtype=dtype, device=device))
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    comm.all_to_all(recv, send, recv_sizes, send_sizes, tag="state")
    return recv


@torch.no_grad()
def to_shard0(opt: ShardedOptimizer) -> dict[int, dict[str, torch.Tensor]]:
    """``{param index: {key: this rank's Shard(0) chunk}}`` for every member of every unit (collective:
    one ``all_to_all`` per unit over the state group, ``tag="state"``, so the transient buffers are one
    unit's, never the whole state)."""
    comm, n, me = opt._state_comm, opt.comm.size, opt.comm.rank
    out: dict[int, dict[str, torch.Tensor]] = {}
    for ui, unit in enumerate(opt._units):
        lay, dtype, dev = unit.layout, unit.grad_shard.dtype, unit.grad_shard.device
        keys = state_keys(opt, ui)
        owned = _owned_state(opt, ui)
        base = lay.owner_range(me)[0]
        sends: list[list[torch.Tensor]] = [[] for _ in range(n)]
        recv_sizes = [0] * n
        for mi, m in enumerate(lay.members):
            out[m.index] = {key: torch.empty(held_shape(tuple(m.shape), n, me), dtype=dtype, device=dev)
                            for key in keys}
            for r in range(n):
                a, b = _segment(lay, mi, me, r)
                if a < b:
                    sends[r].extend(owned[key][a - base:b - base] for key in keys)
                a, b = _segment(lay, mi, r, me)
                if a < b:
                    recv_sizes[r] += (b - a) * len(keys)
        recv = _exchange(comm, sends, recv_sizes, dtype, dev)
        del sends, owned
        pos = 0
        for r in range(n):
            for mi, m in enumerate(lay.members):
                a, b = _segment(lay, mi, r, me)
                if a >= b:
                    continue
                h_lo = _held(lay, mi, me)[0]
                for key in keys:
                    out[m.index][key].view(-1)[a - h_lo:b - h_lo].copy_(recv[pos:pos + b - a])
                    pos += b - a
    return out


def shard0_ready(opt: ShardedOptimizer, state: dict[int, dict[str, Any]]) -> bool:
    """True if ``state`` (by param index) holds, for every member of every unit, each of its
    :func:`state_keys` as this rank's ``Shard(0)`` chunk (a ``DTensor`` over ``N`` ranks of the parameter's
    shape; for a 0-d parameter a plain 0-d tensor), so :func:`load_shard0` can take it. No communication."""
    from torch.distributed.tensor import DTensor, Shard

    n, me = opt.comm.size, opt.comm.rank
    for ui, unit in enumerate(opt._units):
        for m in unit.layout.members:
            st = state.get(m.index)
            if not isinstance(st, dict):
                return False
            for key in state_keys(opt, ui):
                v = st.get(key)
                if not len(m.shape):
                    if not isinstance(v, torch.Tensor) or isinstance(v, DTensor) or v.dim() != 0:
                        return False
                    continue
                if (not isinstance(v, DTensor) or v.device_mesh.size() != n or list(v.placements) != [Shard(0)]
                        or tuple(v.shape) != tuple(m.shape)):
                    return False
                if tuple(v.to_local().shape) != held_shape(tuple(m.shape), n, me):
                    return False
    return True


def _local(v: Any) -> torch.Tensor:
    """A ``Shard(0)`` DTensor's local chunk, or a plain tensor (a 0-d parameter's state) as it is."""
    from torch.distributed.tensor import DTensor

    return v.to_local() if isinstance(v, DTensor) else v


@torch.no_grad()
def load_shard0(opt: ShardedOptimizer, state: dict[int, dict[str, Any]]) -> dict[int, dict[str, torch.Tensor]]:
    """The inverse of :func:`to_shard0`: ``{unit index: {key: this rank's owned state, 1-D}}`` from ``Shard(0)``
    chunks (``state`` as :func:`shard0_ready` accepts it; collective, one ``all_to_all`` per unit)."""
    comm, n, me = opt._state_comm, opt.comm.size, opt.comm.rank
    out: dict[int, dict[str, torch.Tensor]] = {}
    for ui, unit in enumerate(opt._units):
        lay, dtype, dev = unit.layout, unit.grad_shard.dtype, unit.grad_shard.device
        keys = state_keys(opt, ui)
        lo, hi = _owned(lay, me)
        out[ui] = {key: torch.zeros(hi - lo, dtype=dtype, device=dev) for key in keys}
        sends: list[list[torch.Tensor]] = [[] for _ in range(n)]
        recv_sizes = [0] * n
        for mi, m in enumerate(lay.members):
            h_lo = _held(lay, mi, me, loading=True)[0]
            held = {key: _local(state[m.index][key]).reshape(-1) for key in keys}
            for r in range(n):
                a, b = _segment(lay, mi, r, me, loading=True)
                if a < b:
                    sends[r].extend(held[key][a - h_lo:b - h_lo].to(device=dev, dtype=dtype) for key in keys)
                a, b = _segment(lay, mi, me, r, loading=True)
                if a < b:
                    recv_sizes[r] += (b - a) * len(keys)
        recv = _exchange(comm, sends, recv_sizes, dtype, dev)
        del sends
        pos = 0
        for r in range(n):
            for mi in range(len(lay.members)):
                a, b = _segment(lay, mi, me, r, loading=True)
                if a >= b:
                    continue
                for key in keys:
                    out[ui][key][a - lo:b - lo].copy_(recv[pos:pos + b - a])
                    pos += b - a
    return out
