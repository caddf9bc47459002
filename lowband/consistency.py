"""Ranks that drift apart never go unnoticed: an exact, cheap check that replicas still hold the same bits.

Data parallelism keeps one copy of the replicated state per rank and trusts every rank to apply the
same update; a habit that breaks that (a clip or a scaler that sees only local gradients, a
rank-dependent ``p.data = ...``, a missed gradient reduction) leaves the ranks training *different*
models with nothing to betray it. :func:`check_replicas` turns such a split into an error naming the
first tensor that differs.

What is compared, over the ranks of ``comm`` that share a ``replica`` id (ranks with different ids,
e.g. DiLoCo replicas between syncs, are never compared with each other):

* a replicated tensor (a plain parameter or buffer): its bits, on every rank;
* a shard (a parameter with a :class:`~lowband.sharding.Placement`: a GTP row shard, a TP slice, both; a
  sharded ``DTensor``): its layout (shard group size, full / padded shape, partition dim, placements)
  on every rank, its bits only among the ranks that hold the same shard (the same shard index: the
  data-parallel replicas of that shard). ``comm`` may thus be the whole world of a ``dp x gtp x tp``
  mesh, or any one of its axes;
* for every tensor its name, shape and dtype (a model built differently on one rank is named too).

Checksums are exact and deterministic: each tensor's bytes are read as unsigned words of at most 32 bits
(an 8-byte element as two 32-bit words, a 4-byte one as one, a 2-byte one as 16 bits, ...) and summed in
int64 twice, plainly and weighted by the word's position (``sum w_i`` and ``sum (i + 1) * w_i``, the weighted
one mod 2**64). The plain sum cannot wrap below 2**31 words per tensor, so any change that moves the sum of
the words changes it: one changed word, a sign flip of any set of elements, a scaling by a power of two (an
earlier form summed 64-bit words mod 2**64, and two sign flips, or a whole float64 tensor doubled, wrapped
back to the same sum); the weighted sum catches permutations. Integer addition is associative, so the result
does not depend on the reduction order, the device or the number of threads. A float sum would not see a
1e-12 drift; this does.

Communication pattern: one ``all_gather`` of one int64 vector per rank, on ``comm.private("replica_check")``
(a process group of its own with ``comm``'s members, created at the first call, so the check can never
pair with a collective the user issues on ``comm``), ledger tag ``"replica_check"``, recorded in
``comm``'s ledger under ``comm``'s name. The vector holds ``2 + 4 * T`` words for ``T`` checked tensors
(tied tensors once): ``[replica id, T]`` then per tensor ``[layout hash, shard key, sum, weighted sum]``.
Cost per check: :func:`replica_check_bytes` = ``(N - 1) * 8 * (2 + 4 T)`` bytes on the wire per rank
(ring model, ``N = comm.size``; e.g. 64 tensors on 8 ranks: 14.4 kB), plus reading every checked
tensor once on its own device (chunked: at most ``3 * 8 * 2**22`` bytes of temporaries). A
1-rank ``comm`` returns at once without a collective.

Precondition: every rank of ``comm`` calls it, with a model holding the same number of tensors (any
SPMD program; a differing count would make the all-gather's sizes differ). Names, shapes, dtypes and
layouts are compared, not assumed.

No state is kept besides the memoized private ``Comm``; nothing is modified.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

from lowband.comm import Comm
from lowband.sharding import placement_of

TAG = "replica_check"
_HEADER = 2
_PER_TENSOR = 4
_CHUNK = 1 << 22
_REPLICATED = -1


class ReplicaDivergenceError(RuntimeError):
    """Ranks that should hold the same state hold different bits (raised alike on every rank)."""


def replica_check_bytes(num_tensors: int, group_size: int) -> int:
    """Wire bytes per rank of one :func:`check_replicas` over ``group_size`` ranks checking
    ``num_tensors`` tensors (ring-model all-gather of ``2 + 4 * num_tensors`` int64 words per rank)."""
    return (group_size - 1) * 8 * (_HEADER + _PER_TENSOR * num_tensors) if group_size > 1 else 0


def _words(t: torch.Tensor) -> torch.Tensor:
    """The flat bytes of ``t`` (its local shard for a ``DTensor``) as integer words of its element size, at
    most 32 bits (an element of 8 or more bytes as 32-bit words)."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    word = {2: torch.int16, 1: torch.uint8}.get(size, torch.int32)
    return flat if flat.dtype == word else flat.view(word)


_UNSIGNED = {torch.int32: 1 << 32, torch.int16: 1 << 16}


@torch.no_grad()
def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """``[sum w_i, sum (i + 1) w_i]`` over the unsigned words ``w`` (at most 32 bits) of ``t``'s bytes (the
    plain sum exact below 2**31 words, the weighted one wrapping), as a 2-element int64 tensor on ``t``'s
    device. Exact and independent of the reduction order."""
    w = _words(t)
    wrap = _UNSIGNED.get(w.dtype)
    out = torch.zeros(2, dtype=torch.int64, device=w.device)
    for lo in range(0, w.numel(), _CHUNK):
        chunk = w[lo:lo + _CHUNK].to(torch.int64)
        if wrap is not None:  # unsigned: a word's top bit is worth 2**31, not -2**31
            chunk = torch.where(chunk < 0, chunk + wrap, chunk)
        pos = torch.arange(lo + 1, lo + 1 + chunk.numel(), dtype=torch.int64, device=w.device)
        out[0] += chunk.sum()
        out[1] += (chunk * pos).sum()
    return out


def _layout(t: torch.Tensor) -> tuple[tuple, int]:
    """``(layout, shard key)``: what must agree on every rank, and which shard this rank holds
    (``size << 32 | index``; ``-1`` for a replicated tensor)."""
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is not None and mesh is not None:  # a DTensor: shards on its non-Replicate mesh dims
        coord = mesh.get_coordinate() or []
        dims = [d for d, p in enumerate(placements) if not p.is_replicate()]
        index, size = 0, 1
        for d in dims:
            index, size = index * mesh.size(d) + coord[d], size * mesh.size(d)
        layout = ("dtensor", tuple(t.shape), tuple(str(p) for p in placements), tuple(mesh.shape))
        return layout, (size << 32 | index) if dims else _REPLICATED
    parts: list[tuple] = []
    index, size = 0, 1
    pl = placement_of(t)
    for cut in pl.splits if pl is not None else ():
        parts.append((cut.axis, cut.size, cut.dim, cut.sections, cut.pad, pl.shape))
        index, size = index * cut.size + cut.rank, size * cut.size
    return tuple(parts), (size << 32 | index) if parts else _REPLICATED


def _hash63(obj: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little") >> 1


def _entries(model: nn.Module, buffers: bool) -> list[tuple[str, str, torch.Tensor]]:
    """``(kind, first name, tensor)`` for every parameter (and buffer), each tensor object once."""
    seen: set[int] = set()
    items: Iterable[tuple[str, str, torch.Tensor]] = [
        ("parameter", n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    if buffers:
        items = list(items) + [("buffer", n, b) for n, b in model.named_buffers(remove_duplicate=False)
                               if b is not None]
    out = []
    for kind, name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((kind, name, t))
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _hold(ranks: list[int], where: str) -> str:
    """``rank 1 of group 'world' holds`` / ``ranks 1, 3 of group 'world' hold``."""
    return f"{_ranks(ranks)} {where} {'holds' if len(ranks) == 1 else 'hold'}"


def _split(values: dict[int, tuple]) -> tuple[list[int], list[int]] | None:
    """``None`` if every rank's value is equal, else (ranks that differ, ranks of the reference value:
    the most common one, ties to the lowest rank)."""
    classes: dict[tuple, list[int]] = {}
    for r, v in values.items():
        classes.setdefault(v, []).append(r)
    if len(classes) == 1:
        return None
    ordered = sorted(classes.values(), key=lambda rs: (-len(rs), rs[0]))
    return sorted(r for rs in ordered[1:] for r in rs), ordered[0]


@torch.no_grad()
def check_replicas(model: nn.Module, comm: Comm, *, buffers: bool = True, replica: int = 0,
                   context: str = "") -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank of ``comm`` if ranks that should hold the same
    state differ (module docstring: what is compared, how, and the cost).

    Collective: one all-gather on ``comm.private("replica_check")``; every rank of ``comm`` must call it.

    Args:
        model: the model (parameters are read as they are: call it when no update is in flight).
        comm: the ranks that hold replicas of ``model``'s replicated state (shards are compared only
            among the ranks holding the same shard index).
        buffers: also check buffers (all of them, floating or not); ``False``: parameters only.
        replica: this rank's replica id; ranks with different ids are not compared (DiLoCo replicas).
        context: prefix of the error (e.g. ``"after step 200"``).

    Raises:
        ReplicaDivergenceError: one line naming the first tensor (in ``named_parameters`` then
            ``named_buffers`` order) whose bits, shape, dtype or shard layout differ, and the global
            ranks that differ from the others, identical on every rank.
    """
    if comm.size == 1:
        return
    entries = _entries(model, buffers)
    rows: list[torch.Tensor] = []
    heads: list[tuple[int, int]] = []
    for kind, name, t in entries:
        layout, key = _layout(t)
        heads.append((_hash63((kind, name, tuple(t.shape), str(t.dtype), layout)), key))
        rows.append(tensor_checksum(t).cpu())
    mine = torch.empty(_HEADER + _PER_TENSOR * len(entries), dtype=torch.int64)
    mine[0], mine[1] = replica, len(entries)
    if entries:
        body = mine[_HEADER:].view(len(entries), _PER_TENSOR)
        body[:, :2] = torch.tensor(heads, dtype=torch.int64)
        body[:, 2:] = torch.stack(rows)
    wire = comm.private(TAG)
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in wire.backends else torch.device("cpu")
    mine = mine.to(device)
    out = torch.empty(wire.size * mine.numel(), dtype=torch.int64, device=device)
    wire.all_gather(out, mine, tag=TAG)
    table = out.view(wire.size, -1).cpu().tolist()
    _compare(table, entries, [wire.global_rank(r) for r in range(wire.size)], comm.name, context)


def _compare(table: list[list[int]], entries: list[tuple[str, str, torch.Tensor]], granks: list[int],
             group: str, context: str) -> None:
    """Raise the first difference found in the gathered ``table`` (one row per group rank)."""
    head = f"replica check{' ' + context if context else ''}"
    where = f"of group {group!r}"
    counts = _split({granks[r]: (row[1],) for r, row in enumerate(table)})
    if counts is not None:
        raise ReplicaDivergenceError(f"{head}: {_hold(counts[0], where)} a model with another number of "
                                     f"parameters{'/buffers' if entries and entries[-1][0] == 'buffer' else ''} "
                                     f"than {_ranks(counts[1])}")
    cohorts: dict[int, list[int]] = {}
    for r, row in enumerate(table):
        cohorts.setdefault(row[0], []).append(r)
    for i, (kind, name, _t) in enumerate(entries):
        base = _HEADER + _PER_TENSOR * i
        for members in cohorts.values():
            rows = {granks[r]: table[r][base:base + _PER_TENSOR] for r in members}
            split = _split({g: (v[0], v[1] >> 32) for g, v in rows.items()})
            if split is not None:
                raise ReplicaDivergenceError(
                    f"{head}: {kind} {name!r}: {_hold(split[0], where)} it with another name, shape, "
                    f"dtype or shard layout than {_ranks(split[1])} (models built or sharded differently)")
            key = next(iter(rows.values()))[1]
            if key == _REPLICATED:
                split = _split({g: tuple(v[2:]) for g, v in rows.items()})
                if split is not None:
                    raise ReplicaDivergenceError(
                        f"{head}: replicated {kind} {name!r} differs: {_hold(split[0], where)} other "
                        f"values than {_ranks(split[1])} (the ranks train different models from here on)")
                continue
            size = key >> 32
            holders: dict[int, dict[int, tuple]] = {}
            for g, v in rows.items():
                holders.setdefault(v[1] & 0xFFFFFFFF, {})[g] = tuple(v[2:])
            for k, h in sorted(holders.items()):
                split = _split(h)
                if split is not None:
                    raise ReplicaDivergenceError(
                        f"{head}: shard {k} of {size} of {kind} {name!r} differs: {_hold(split[0], where)} "
                        f"other values than {_ranks(split[1])} of the same shard (its data-parallel replicas "
                        "train different models from here on)")


__all__ = ["TAG", "ReplicaDivergenceError", "check_replicas", "replica_check_bytes", "tensor_checksum"]
