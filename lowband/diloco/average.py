"""The average of the DiLoCo replicas' models: what a plain averaging outer step would make of the local work.

:func:`replica_average` (also :meth:`lowband.diloco.StreamingDiLoCo.averaged_model`) is the model to keep at the
end of a run: ``global + mean_r(local_r - global)`` per fragment, i.e. the mean of the replicas' live models,
symmetric in the replicas, and bitwise what every replica holds alike, segment by segment (below). It is what
``python -m lowband.train`` exports (:mod:`lowband.train.export`), and what a script of one's own writes instead
of one replica's model.

Communication, over the replica group (every rank of every replica alike, in the same order):

* each floating-point parameter and buffer (tied ones once) is cut into segments of whole rows (a 1-d tensor's
  rows are its elements), at least :data:`SEGMENT_MIN_ELEMS` elements (a row longer than
  :data:`SEGMENT_MAX_ELEMS` is cut into pieces of that many); one all-reduce (max, tag
  ``<tag>:digests``) of every segment's two digests (:func:`lowband.diloco.row_digest.row_digest_pairs`) and their
  negation, 32 bytes per segment (1/8 of the bytes of 64 fp32 elements; a tensor of fewer elements is one
  segment), finds the segments equal on every replica;
* those are copied locally and never travel (a frozen base under adapters, a buffer nobody changes, a fragment
  synced at the last step): bitwise, where an fp32 sum of 3 equal values would round in about 15 % of the
  elements. An element every replica holds alike inside a segment that differs elsewhere is averaged like the
  rest of its segment;
* the segments that differ are all-reduced (avg, ``<tag>``) in fp32 (fp64 for fp64 models) in buckets of at
  most :data:`AVERAGE_BUCKET_BYTES` (the device holds one bucket beside the live model): at most the bytes of one
  fp32 all-reduce of the model, ``2 (N-1)/N`` of them per rank. Each of their elements is the mean within the
  rounding of an fp32 (fp64) sum of the replicas' values, exact on 2 replicas.

With GTP or tensor-parallel layers inside the replicas every gathered layer
(:func:`lowband.parallel.unsharded_copy`, collective over the GTP / TP group) is averaged on the device as soon
as it is gathered (its own digest all-reduce, then its own buckets), then moves to host memory or is dropped;
the replicated rest is averaged straight from the live model (one more digest all-reduce). The result is a plain
model in host memory on the ranks that keep it (``keep``), ``None`` elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lowband.diloco.streaming import StreamingDiLoCo

__all__ = ["AVERAGE_BUCKET_BYTES", "SEGMENT_MAX_ELEMS", "SEGMENT_MIN_ELEMS", "average_modules", "average_tensors",
           "replica_average", "segment_length"]


AVERAGE_BUCKET_BYTES = 16 << 20
"""Bytes (in the accumulation dtype) of one all-reduce of the average: the device holds one such bucket at a time
beside the live model, never a second copy of the model."""


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """``model``'s floating-point parameters and buffers in registration order, tied ones once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _buckets(ranges: list[tuple[int, int, int]], cap: int) -> list[list[tuple[int, int, int]]]:
    """The ``(tensor index, start, end)`` element ranges laid end to end, cut into buckets of at most ``cap``
    elements (a range larger than a bucket spans several)."""
    out: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    for i, start, end in ranges:
        pos = start
        while pos < end:
            if filled == cap:
                out.append([])
                filled = 0
            take = min(end - pos, cap - filled)
            out[-1].append((i, pos, pos + take))
            pos, filled = pos + take, filled + take
    return [b for b in out if b]


def _acc_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The average's accumulation dtype: fp64 if any tensor is fp64, else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


SEGMENT_MIN_ELEMS = 64
"""The fewest elements of one compared segment (below a tensor's whole rows): a row of fewer elements is
compared together with the rows after it, so the digests cost at most 32 bytes per 64 elements."""

SEGMENT_MAX_ELEMS = 1 << 16
"""The most elements of one compared segment: a row longer than this is cut into flat pieces of this many
elements, so hashing a segment never widens more than this many words at once (one very wide row, a ``[1, N]``
weight, would otherwise need several int64 copies of the whole tensor on its device)."""


def segment_length(t: torch.Tensor) -> int:
    """Elements of one compared segment of ``t``: whole rows (along dimension 0; a 1-d tensor's rows are its
    elements, a 0-d tensor is one), as few as give at least :data:`SEGMENT_MIN_ELEMS` elements, or
    :data:`SEGMENT_MAX_ELEMS` for rows longer than that; ``t``'s flat elements are cut into segments of that
    length (the last one may be shorter)."""
    n = t.numel()
    if n == 0:
        return 1
    cols = n // t.shape[0] if t.dim() >= 1 else 1
    if cols > SEGMENT_MAX_ELEMS:
        return SEGMENT_MAX_ELEMS
    return cols * -(-SEGMENT_MIN_ELEMS // cols)


def _segment_digests(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[segments, 2]``: :func:`lowband.diloco.row_digest.row_digest_pairs` of each segment of ``t``."""
    from lowband.diloco.row_digest import row_digest_pairs

    flat, seg = t.detach().reshape(-1), segment_length(t)
    whole = flat.numel() // seg
    parts = [row_digest_pairs(flat[:whole * seg].view(whole, seg))] if whole else []
    if flat.numel() > whole * seg:
        parts.append(row_digest_pairs(flat[whole * seg:]))
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.int64, device=t.device)


def _differing_ranges(comm: Any, src: list[torch.Tensor], device: torch.device, tag: str
                      ) -> list[tuple[int, int, int]]:
    """The ``(tensor index, start, end)`` flat element ranges of ``src`` whose segments are not bit-identical
    on every rank of ``comm`` (the same list on every rank). Collective: one all-reduce (max, tag
    ``<tag>:digests``) of every segment's digest pair and its negation, ``2 (N-1)/N * 32`` bytes per segment:
    a segment is equal everywhere when the largest digest equals the smallest, in both digests (digests on
    ``device``, the one ``comm`` runs on)."""
    digests = [_segment_digests(t).to(device) for t in src]  # each on its tensor's device first
    counts = [d.shape[0] for d in digests]
    pairs = torch.cat(digests)
    both = torch.cat([pairs, -pairs])
    comm.all_reduce(both, "max", tag=f"{tag}:digests")
    differ = (both[:len(pairs)] != -both[len(pairs):]).any(dim=1).to("cpu", torch.int8)
    out: list[tuple[int, int, int]] = []
    offset = 0
    for i, (t, count) in enumerate(zip(src, counts, strict=True)):
        mine = differ[offset:offset + count]
        offset += count
        if not bool(mine.any()):
            continue
        seg, edges = segment_length(t), torch.diff(mine, prepend=mine.new_zeros(1), append=mine.new_zeros(1))
        starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        out.extend((i, a * seg, min(b * seg, t.numel())) for a, b in zip(starts, ends, strict=True))
    return out


@torch.no_grad()
def average_tensors(comm: Any, src: list[torch.Tensor], dst: list[torch.Tensor] | None, *, device: torch.device,
                    acc: torch.dtype, bucket_bytes: int = AVERAGE_BUCKET_BYTES, tag: str = "average") -> None:
    """Make ``dst`` the average over ``comm`` of ``src``, exactly ``src`` wherever every rank holds the same bits.
    ``dst`` holds ``src``'s values already: a copy of it on any device (what :func:`lowband.parallel.unsharded_copy`
    makes) or ``src`` itself; ``None`` on a rank that keeps nothing. Only the segments that differ are written.

    Collective, every rank alike: first the digests of every segment (:func:`_differing_ranges`, whole rows of at
    least :data:`SEGMENT_MIN_ELEMS` elements), then the segments that differ on some rank, laid end to end,
    all-reduced (avg, ``tag``) in ``acc`` in buckets of at most ``bucket_bytes`` on ``device`` (the one
    ``comm`` runs on). A segment equal everywhere is copied locally and never travels (a frozen base, a buffer
    nobody changes, a fragment synced at the last step): it comes back bitwise, where an fp32 sum of 3 equal
    values would round. In a segment that differs, each element is the mean rounded like an fp32 / fp64 sum of
    the ranks' values (on 2 ranks ``(a + b) / 2`` exactly, in either order)."""
    if dst is not None and [t.shape for t in dst] != [t.shape for t in src]:
        raise ValueError("average: the copy's tensors do not match the model's")  # a bug, never a user's input
    if not src or comm.size == 1:
        return
    ranges = _differing_ranges(comm, src, device, tag)
    cap = max(1, bucket_bytes // acc.itemsize)
    flat_src = [t.detach().reshape(-1) for t in src]  # views (a copy for a rare non-contiguous tensor)
    flat_dst = None if dst is None else [d.view(-1) if d.is_contiguous() else d.reshape(-1) for d in dst]
    for bucket in _buckets(ranges, cap):
        flat = torch.cat([flat_src[i][a:b].to(device=device, dtype=acc) for i, a, b in bucket])
        comm.all_reduce(flat, "avg", tag=tag)
        if flat_dst is None:
            continue
        offset = 0
        for i, a, b in bucket:
            flat_dst[i][a:b].copy_(flat[offset:offset + b - a])
            offset += b - a
    if dst is not None and flat_dst is not None:
        for d, f in zip(dst, flat_dst, strict=True):
            if not d.is_contiguous():  # written through a copy: put it in place
                d.copy_(f.view(d.shape))


def average_modules(comm: Any, source: nn.Module, dest: nn.Module | None, *, device: torch.device | None = None,
                    bucket_bytes: int = AVERAGE_BUCKET_BYTES, tag: str = "average") -> None:
    """:func:`average_tensors` of ``source``'s floating-point parameters and buffers (registration order, tied
    ones once) into ``dest``'s (a copy of ``source``, ``source`` itself, or ``None``), on ``device`` (default:
    ``source``'s)."""
    src = _tensors(source)
    if not src:
        return
    average_tensors(comm, src, _tensors(dest) if dest is not None else None,
                    device=src[0].device if device is None else device, acc=_acc_dtype(src),
                    bucket_bytes=bucket_bytes, tag=tag)


@torch.no_grad()
def _average_sharded(comm: Any, live: nn.Module, keep: bool, tag: str) -> nn.Module | None:
    """The average over ``comm`` (the DiLoCo replicas) of the replicas' gathered GTP / TP models, in host memory
    where ``keep``: every gathered layer is averaged on the device as soon as it is gathered (then moves to the
    host, or is dropped), the replicated rest straight from the live model (collective on every rank alike)."""
    from lowband.parallel import unsharded_copy
    from lowband.parallel.tensor import TPInputGather
    from lowband.parallel.unshard import replicated_tensors

    inner = live.module if isinstance(live, TPInputGather) else live
    device = next(iter(inner.parameters())).device
    acc = _acc_dtype(_tensors(inner))

    def average_layer(layer: nn.Module) -> None:
        ts = _tensors(layer)
        average_tensors(comm, ts, ts, device=device, acc=acc, tag=tag)

    copied = unsharded_copy(inner, device="cpu", keep=keep, each_layer=average_layer)
    rest = [(name, t) for name, t in replicated_tensors(inner) if t.is_floating_point()]
    dst = None
    if copied is not None:
        mine = dict([*copied.named_parameters(), *copied.named_buffers()])
        dst = [mine[name] for name, _ in rest]
    average_tensors(comm, [t for _, t in rest], dst, device=device, acc=acc, tag=tag)
    return copied


def _host_copy(model: nn.Module) -> nn.Module:
    """A deep copy of a plain ``model`` with every parameter and buffer copied straight to host memory."""
    from lowband.parallel.unshard import unsharded_copy

    copied = unsharded_copy(model, device="cpu")
    assert copied is not None
    return copied


def replica_average(dl: StreamingDiLoCo, *, keep: bool = True, tag: str = "average") -> nn.Module | None:
    """The average of the replicas' models (see the module docstring) as a plain model in host memory, or ``None``
    where not ``keep`` (that rank still takes part in every collective). Collective over ``dl.comm`` (and the
    GTP / TP groups inside a replica): call on every rank of every replica alike, at the same step.

    A fragment's pseudo-gradient still in flight is waited for first (so the average's collectives come in the
    same order on every rank) and is not applied; so are the inner optimizer's writes still in flight (the
    all-gathers of ``ShardedOptimizer(param_gather="forward")``, :meth:`StreamingDiLoCo.wait_for_inner_writes`).
    With one replica: a host copy of its model (gathered when sharded). The live model is not changed.

    Raises:
        ValueError: ``dl`` syncs through another membership than the static one (torchft's: replica groups
            are separate launches that meet only at quorums, so there is no group to average over outside one;
            raised on every rank alike, before any collective). Keep each group's own ``dl.model`` there.
    """
    from lowband.parallel.unshard import holds_shards, unsharded_copy

    kind = getattr(dl.membership, "name", type(dl.membership).__name__)
    if kind != "static":
        raise ValueError(
            f"averaged_model: this StreamingDiLoCo syncs through the {kind!r} membership, whose replica groups are "
            "separate launches that meet only at quorums; there is no replica group to average over outside one. "
            "Keep each group's own model (dl.model), as python -m lowband.train does with ft.enabled")
    dl.wait_inflight()
    dl.wait_for_inner_writes()  # ShardedOptimizer(param_gather="forward"): its updated slices still landing
    live = dl.model
    if dl.comm.size == 1:
        return unsharded_copy(live, device="cpu", keep=keep)
    if holds_shards(live):
        return _average_sharded(dl.comm, live, keep, tag)
    dest = _host_copy(live) if keep else None
    average_modules(dl.comm, live, dest, tag=tag)
    return dest
