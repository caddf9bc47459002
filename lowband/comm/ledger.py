"""Byte and time ledger for every collective lowband issues.

Each call through :class:`lowband.comm.Comm` appends one :class:`CommRecord`. Wire bytes are per rank
and follow the ring model (see :func:`ring_wire_bytes`), so they are deterministic and testable:

* ``reduce_scatter``, ``all_gather``, ``broadcast``: ``(N-1)/N`` of the full buffer;
* ``all_reduce``: ``2(N-1)/N`` of the buffer;
* ``all_to_all``: the bytes this rank actually sends to other ranks (``(N-1)/N`` of the buffer for
  even splits).

"Full buffer" is the reduce-scatter input, the all-gather output, the all-reduce / broadcast tensor.
Integer division floors the result. A group of size 1 moves zero bytes but is still recorded, so call
counts do not depend on the world size.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import torch

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "all_gather_object",
       "barrier")


def ring_wire_bytes(op: str, group_size: int, buffer_bytes: int) -> int:
    """Per-rank bytes on the wire for ``op`` over ``group_size`` ranks by the ring model.

    Args:
        op: one of ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
            ``all_gather_object`` (for ``all_to_all`` the caller counts the bytes it sends).
        group_size: N, the number of ranks in the group.
        buffer_bytes: bytes of the full logical buffer (see module docstring).
    """
    n = group_size
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * buffer_bytes // n
    if op in ("reduce_scatter", "all_gather", "broadcast", "all_gather_object"):
        return (n - 1) * buffer_bytes // n
    raise ValueError(f"ring_wire_bytes: op {op!r} has no ring formula; allowed: all_reduce, "
                     "reduce_scatter, all_gather, broadcast, all_gather_object")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class CommRecord:
    """One collective call.

    Attributes:
        op: collective name (see ``OPS``).
        group: name of the :class:`Comm` (process group) it ran on.
        group_size: ranks in that group.
        numel: elements of the full logical buffer (RS input, AG output, AR/broadcast tensor, A2A
            input on this rank).
        wire_dtype: dtype the elements travel in, e.g. ``"bfloat16"``.
        wire_bytes: bytes per rank by the ring model.
        algorithm: how it was carried out (``native``, ``alltoall+sum``, ``broadcast``, ``local`` ...).
        tag: free-form label set by the caller (e.g. ``"grad"``, ``"param"``, ``"sparse:bigram"``).
        async_op: whether the caller asked for an asynchronous handle.
        elapsed_s: seconds from issue until the caller's ``wait()`` returned (``None`` while pending).
    """

    op: str
    group: str
    group_size: int
    numel: int
    wire_dtype: str
    wire_bytes: int
    algorithm: str
    tag: str = ""
    async_op: bool = False
    elapsed_s: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class OpTotals:
    count: int = 0
    wire_bytes: int = 0
    numel: int = 0
    elapsed_s: float = 0.0


@dataclass
class LedgerTotals:
    """Totals over a set of records, overall and per op."""

    count: int = 0
    wire_bytes: int = 0
    elapsed_s: float = 0.0
    by_op: dict[str, OpTotals] = field(default_factory=dict)
    by_tag: dict[str, OpTotals] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "count": self.count,
            "wire_bytes": self.wire_bytes,
            "elapsed_s": self.elapsed_s,
            "by_op": {k: dataclasses.asdict(v) for k, v in self.by_op.items()},
            "by_tag": {k: dataclasses.asdict(v) for k, v in self.by_tag.items()},
        }


class CommLedger:
    """Append-only list of :class:`CommRecord` with per-step totals.

    ``mark_step()`` closes the current step and returns its totals; ``reset()`` forgets everything.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._step_start = 0

    def add(self, record: CommRecord) -> CommRecord:
        self.records.append(record)
        return record

    def reset(self) -> None:
        self.records.clear()
        self._step_start = 0

    def step_records(self) -> list[CommRecord]:
        """Records since the last :meth:`mark_step` (or reset)."""
        return self.records[self._step_start :]

    def mark_step(self) -> LedgerTotals:
        """Totals of the records since the last mark; starts a new step."""
        totals = self.totals(self.step_records())
        self._step_start = len(self.records)
        return totals

    def select(self, op: str | None = None, group: str | None = None, tag: str | None = None,
               records: list[CommRecord] | None = None) -> list[CommRecord]:
        """Records matching all given filters; ``tag`` matches exactly or as a ``prefix:``."""
        recs = self.records if records is None else records
        out = []
        for r in recs:
            if op is not None and r.op != op:
                continue
            if group is not None and r.group != group:
                continue
            if tag is not None and not (r.tag == tag or r.tag.startswith(tag + ":")):
                continue
            out.append(r)
        return out

    def count(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        return len(self.select(op, group, tag))

    def wire_bytes(self, op: str | None = None, group: str | None = None,
                   tag: str | None = None) -> int:
        return sum(r.wire_bytes for r in self.select(op, group, tag))

    @staticmethod
    def totals(records: list[CommRecord]) -> LedgerTotals:
        tot = LedgerTotals()
        by_op: dict[str, OpTotals] = defaultdict(OpTotals)
        by_tag: dict[str, OpTotals] = defaultdict(OpTotals)
        for r in records:
            el = r.elapsed_s or 0.0
            tot.count += 1
            tot.wire_bytes += r.wire_bytes
            tot.elapsed_s += el
            for t in (by_op[r.op], by_tag[r.tag or "-"]):
                t.count += 1
                t.wire_bytes += r.wire_bytes
                t.numel += r.numel
                t.elapsed_s += el
        tot.by_op = dict(by_op)
        tot.by_tag = dict(by_tag)
        return tot


_DEFAULT_LEDGER = CommLedger()


def default_ledger() -> CommLedger:
    """The process-wide ledger that :class:`Comm` objects use unless given another."""
    return _DEFAULT_LEDGER
