"""Flat bucket layout of a sharded optimizer: which parameters travel together and who owns what.

A *unit* is one reduce-scatter + one all-gather per step. Two kinds:

* ``adamw`` flat bucket: parameters of one param group (one dtype, one device) concatenated in
  backward order (last registered first) up to a byte cap; the total is zero-padded to a multiple of
  the world size N. Rank ``r`` owns the contiguous elements ``[r*S, (r+1)*S)`` with ``S = numel / N``
  (a shard can cut through a parameter). A parameter larger than the cap gets a bucket of its own.
* ``muon`` stacked group: ``K`` same-shape matrices of one param group stacked as ``[Kp, rows, cols]``
  with ``Kp = ceil(K / N) * N`` (``Kp - K < N`` zero pad matrices). Rank ``r`` owns the ``c = Kp / N``
  whole matrices in slots ``[r*c, (r+1)*c)``: first its real matrices, then at most one pad. A shape
  group larger than the cap is split into several units of a multiple of N matrices each. Pads go to
  the ranks with the most Newton-Schulz work so far (cost ``rows * cols * min(rows, cols)`` per
  matrix, ties to the higher rank), so work is balanced over all shape groups.

Units are ordered by the largest parameter index they hold, descending: the order in which backward
makes their gradients ready. All ranks compute the same layout from the same shapes, with no
communication.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    index: int  # position in the flattened param_groups order
    group: int  # param-group index
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(slots=True)
class Member:
    """One parameter inside a unit: its flat element offset in the unit buffer."""

    index: int
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(slots=True)
class UnitLayout:
    """Layout of one communication unit (see module docstring)."""

    kind: str  # "adamw" or "muon"
    group: int
    dtype: torch.dtype
    device: torch.device
    world_size: int
    numel: int  # padded total, a multiple of world_size
    members: list[Member] = field(default_factory=list)
    matrix_shape: tuple[int, int] | None = None  # muon only
    real_per_rank: list[int] | None = None  # muon only: real matrices in each rank's chunk

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def slots_per_rank(self) -> int:
        """Matrices per rank (muon only)."""
        assert self.matrix_shape is not None
        return self.shard_numel // (self.matrix_shape[0] * self.matrix_shape[1])

    def owner_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def describe(self) -> tuple:
        return (self.kind, self.group, str(self.dtype), str(self.device), self.world_size, self.numel,
                tuple((m.index, m.shape, m.offset) for m in self.members), self.matrix_shape,
                tuple(self.real_per_rank or ()))


def _pad_to(n: int, k: int) -> int:
    return -(-n // k) * k


def plan_adamw_buckets(specs: list[ParamSpec], world_size: int, cap_bytes: int) -> list[UnitLayout]:
    """Flat buckets for AdamW parameters (one param group, dtype and device per bucket)."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive (got {cap_bytes} bytes)")
    units: list[UnitLayout] = []
    open_units: dict[tuple, tuple[UnitLayout, int]] = {}  # key -> (unit, used bytes)
    for spec in sorted(specs, key=lambda s: -s.index):
        key = (spec.group, spec.dtype, spec.device)
        esize = torch.empty((), dtype=spec.dtype).element_size()
        nbytes = spec.numel * esize
        cur = open_units.get(key)
        if cur is None or (cur[1] + nbytes > cap_bytes and cur[0].members):
            unit = UnitLayout("adamw", spec.group, spec.dtype, spec.device, world_size, 0)
            units.append(unit)
            cur = (unit, 0)
        unit, used = cur
        offset = sum(m.numel for m in unit.members)
        unit.members.append(Member(spec.index, spec.shape, offset, spec.numel))
        open_units[key] = (unit, used + nbytes)
    for unit in units:
        unit.numel = _pad_to(max(1, sum(m.numel for m in unit.members)), world_size)
    return units


def matrix_cost(rows: int, cols: int) -> int:
    """Relative cost of orthogonalizing one ``rows x cols`` matrix (flops up to a constant)."""
    return rows * cols * min(rows, cols)


def plan_muon_units(specs: list[ParamSpec], world_size: int, cap_bytes: int,
                    loads: list[int] | None = None) -> list[UnitLayout]:
    """Stacked same-shape units for Muon matrices, balanced by cost (see module docstring).

    Args:
        specs: 2-D parameters.
        world_size: N.
        cap_bytes: soft size cap per unit (a unit holds at least N matrices).
        loads: per-rank running cost, updated in place (pass one list across calls to balance
            across groups).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive (got {cap_bytes} bytes)")
    n = world_size
    loads = loads if loads is not None else [0] * n
    groups: dict[tuple, list[ParamSpec]] = {}
    for spec in sorted(specs, key=lambda s: -s.index):
        if len(spec.shape) != 2:
            raise ValueError(f"Muon handles 2-D matrices; parameter {spec.index} has shape {spec.shape}")
        groups.setdefault((spec.group, spec.shape, spec.dtype, spec.device), []).append(spec)
    units: list[UnitLayout] = []
    for (group, shape, dtype, device), members in groups.items():
        rows, cols = shape
        esize = torch.empty((), dtype=dtype).element_size()
        per_unit = max(1, cap_bytes // (rows * cols * esize))
        per_unit = _pad_to(per_unit, n)
        for start in range(0, len(members), per_unit):
            chunk = members[start:start + per_unit]
            k = len(chunk)
            kp = _pad_to(k, n)
            c = kp // n
            pads = kp - k
            pad_ranks = set(sorted(range(n), key=lambda r: (-loads[r], -r))[:pads])
            real = [c - (1 if r in pad_ranks else 0) for r in range(n)]
            unit = UnitLayout("muon", group, dtype, device, n, kp * rows * cols, matrix_shape=(rows, cols),
                              real_per_rank=real)
            it = iter(chunk)
            for r in range(n):
                for j in range(real[r]):
                    spec = next(it)
                    slot = r * c + j
                    unit.members.append(Member(spec.index, spec.shape, slot * rows * cols, rows * cols))
                loads[r] += real[r] * matrix_cost(rows, cols)
            units.append(unit)
    return units


def order_units(units: list[UnitLayout]) -> list[UnitLayout]:
    """Backward-readiness order: the unit holding the highest parameter index first."""
    return sorted(units, key=lambda u: -max(m.index for m in u.members))


def layout_id(units: list[UnitLayout]) -> str:
    """A short hash of the layout, stored in sharded state dicts to refuse a mismatched load."""
    return hashlib.sha1(repr([u.describe() for u in units]).encode()).hexdigest()[:16]
