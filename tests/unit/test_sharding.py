"""lowband.sharding: the Placement record and its to_state / from_state, against hand-built local tensors."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from lowband.dcp_chunks import LocalChunks
from lowband.sharding import (
    Placement,
    Split,
    from_state,
    logical_boxes,
    padding_mask,
    place,
    placement_of,
    to_state,
)


def _logical(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(1, torch.Size(shape).numel() + 1, dtype=torch.float64).reshape(shape)


def _cut(x: torch.Tensor, s: Split) -> torch.Tensor:
    """The reference cut, written as the sharders do it: pad rows appended, then equal parts (of each section)."""
    if s.pad:
        pad_shape = list(x.shape)
        pad_shape[s.dim] = s.pad
        x = torch.cat([x, torch.zeros(pad_shape, dtype=x.dtype)], dim=s.dim)
    secs = x.chunk(s.sections, s.dim)
    return torch.cat([sec.chunk(s.size, s.dim)[s.rank] for sec in secs], dim=s.dim)


def _local(full: torch.Tensor, pl: Placement) -> torch.Tensor:
    x = full
    for s in pl.splits:
        x = _cut(x, s)
    return x.contiguous()


CASES = [
    ((10, 4), [("gtp", 0, 4, 1, 2)]),            # GTP rows padded 10 -> 12, 3 rows each
    ((10, 4), [("gtp", 0, 4, 2, 6)]),            # padding in part (16 rows, 4 each: rows 8-9 real)
    ((6, 4), [("gtp", 0, 4, 3, 2)]),             # a rank of padding only (8 rows, rows 6-7 pad)
    ((12, 6), [("tp", 0, 2, 1, 0, 3)]),          # fused [q; k; v], TP 2
    ((4, 12), [("tp", 1, 3, 2, 0)]),             # row-parallel columns
    ((12, 6), [("tp", 0, 2, 0, 0, 3), ("gtp", 0, 2, 1, 2)]),  # sectioned TP slice (6 rows), GTP rows of it (8: 4 each)
    ((8, 6), [("tp", 1, 2, 1, 0), ("gtp", 0, 3, 2, 1)]),      # TP columns, GTP rows (8 + 1 pad over 3)
]


def _placement(shape, cuts) -> Placement:
    return Placement(shape, tuple(Split(a, d, n, r, pad=p, sections=(c[0] if c else 1))
                                  for a, d, n, r, p, *c in cuts), name="w")


@pytest.mark.parametrize(("shape", "cuts"), CASES)
def test_to_state_and_from_state_follow_the_reference_cut(shape, cuts):
    pl = _placement(shape, cuts)
    full = _logical(shape)
    local = _local(full, pl)
    assert pl.local_shape() == tuple(local.shape)
    chunks = to_state(pl, local)
    assert isinstance(chunks, LocalChunks) and tuple(chunks.shape) == shape
    # every real (non-zero in the reference: the logical values are 1..N) local element, exactly once, at its place
    held = sum(t.numel() for _, t in chunks.pieces)
    assert held == int((local != 0).sum())
    for offsets, piece in chunks.pieces:
        box = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape, strict=True))
        assert torch.equal(piece, full[box])
        assert piece.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()  # views, no copy
    # back: from the chunks (a filled template) and from the whole logical tensor; padding zero
    assert torch.equal(from_state(pl, chunks), local)
    assert torch.equal(from_state(pl, full), local)


@pytest.mark.parametrize(("shape", "cuts"), CASES)
def test_padding_mask_marks_exactly_the_elements_that_are_no_state(shape, cuts):
    pl = _placement(shape, cuts)
    local = _local(_logical(shape), pl)  # logical values are 1..N: zero exactly at padding
    mask = padding_mask(pl)
    if bool((local != 0).all()):
        assert mask is None
    else:
        assert mask is not None and torch.equal(mask, local == 0)


def test_boxes_tile_every_rank_once():
    shape, _cuts = CASES[5]
    seen = torch.zeros(shape, dtype=torch.int64)
    for t in range(2):
        for g in range(2):
            pl = Placement(shape, (Split("tp", 0, 2, t, sections=3), Split("gtp", 0, 2, g, pad=2)))
            for log, _loc, sizes in logical_boxes(pl):
                seen[tuple(slice(o, o + n) for o, n in zip(log, sizes, strict=True))] += 1
    assert bool((seen == 1).all())


def test_from_state_refuses_another_ranks_chunks_and_a_wrong_shape():
    pl0 = Placement((10, 4), (Split("gtp", 0, 2, 0),))
    pl1 = Placement((10, 4), (Split("gtp", 0, 2, 1),))
    other = to_state(pl1, _local(_logical((10, 4)), pl1))
    with pytest.raises(ValueError, match="ckpt: w does not hold exactly this rank's elements"):
        from_state(pl0, other, what="ckpt: w")
    with pytest.raises(ValueError, match=r"ckpt has shape \(4, 10\), expected the logical \(10, 4\)"):
        from_state(pl0, torch.zeros(4, 10), what="ckpt")


def test_bad_cuts_are_refused():
    with pytest.raises(ValueError, match="not divisible"):
        Placement((10, 4), (Split("gtp", 0, 4, 0),))
    with pytest.raises(ValueError, match="rank 2 is not in"):
        Split("tp", 0, 2, 2)
    with pytest.raises(ValueError, match="cuts dim 2"):
        Placement((4, 4), (Split("tp", 2, 2, 0),))


def test_place_checks_the_shape_and_placement_of_reads_a_tp_declaration():
    p = nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="has shape"):
        place(p, Placement((6, 4), (Split("tp", 0, 3, 0),)))
    place(p, Placement((6, 4), (Split("tp", 0, 2, 1),)))
    assert placement_of(p).split("tp").rank == 1 and placement_of(p).sharded
    # a user's own TP layer: partition_dim / tp_comm (docs/rekls.md)
    q = nn.Parameter(torch.zeros(4, 3))
    comm = types.SimpleNamespace(size=2, rank=0)
    q.partition_dim, q.tp_comm = 1, comm
    pl = placement_of(q)
    assert pl.shape == (4, 6) and pl.split("tp").dim == 1 and pl.group("tp") is comm
    q.partition_dim = None
    assert placement_of(q) is None
    assert placement_of(nn.Parameter(torch.zeros(2))) is None


def test_group_is_none_for_a_one_rank_cut_and_equality_ignores_it():
    a = Placement((4, 4), (Split("tp", 0, 1, 0, group=object()),))
    b = Placement((4, 4), (Split("tp", 0, 1, 0, group=object()),))
    assert a == b and a.group("tp") is None and not a.sharded and a.split("gtp") is None
