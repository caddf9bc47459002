"""lowband.dcp_chunks: flat ranges as logical boxes, chunk caps, and a single-process DCP round trip."""

from __future__ import annotations

import math
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lowband.dcp_chunks import (
    LocalChunks,
    box_chunks,
    box_pieces,
    flat_range_boxes,
    flat_range_pieces,
    lift_chunks,
    local_chunks,
    lower_chunks,
    split_box,
    whole_or_chunks,
)


def _covered(shape: tuple[int, ...], boxes) -> list[int]:
    """Flat indices of the boxes' elements, in box order (row-major inside each box)."""
    idx = torch.arange(math.prod(shape)).view(shape)
    out = []
    for offsets, sizes, start in boxes:
        part = idx[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1).tolist()
        assert part == list(range(start, start + len(part)))  # a contiguous flat sub-range from flat_start
        out += part
    return out


@pytest.mark.parametrize("shape", [(7,), (300, 7), (4, 5, 6), (3, 1, 4), (2, 3, 4, 5)])
def test_boxes_cover_the_range_exactly_in_order(shape: tuple[int, ...]) -> None:
    rng = random.Random(0)
    n = math.prod(shape)
    cases = [(0, n), (0, 0), (n, n), (1, n - 1), (0, 1), (n - 1, n)]
    cases += [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(60)]
    for a, b in cases:
        boxes = flat_range_boxes(shape, a, b)
        assert _covered(shape, boxes) == list(range(a, b)), (shape, a, b)
        assert len(boxes) <= 2 * (len(shape) - 1) + 1
        assert all(all(s > 0 for s in sizes) for _o, sizes, _f in boxes)


def test_boxes_examples_and_edge_cases() -> None:
    assert flat_range_boxes((300, 7), 0, 1234) == [((0, 0), (176, 7), 0), ((176, 0), (1, 2), 1232)]
    assert flat_range_boxes((300, 7), 1234, 2100) == [((176, 2), (1, 5), 1234), ((177, 0), (123, 7), 1239)]
    assert len(flat_range_boxes((4, 5, 6), 7, 113)) == 5
    assert flat_range_boxes((), 0, 1) == [((), (), 0)]
    assert flat_range_boxes((), 0, 0) == []
    assert flat_range_boxes((5, 0), 0, 0) == []
    with pytest.raises(ValueError, match="not inside"):
        flat_range_boxes((3, 4), 5, 13)


def test_split_box_caps_chunks_on_a_fixed_grid() -> None:
    # rows of 7 float32 = 28 bytes; a 100-byte cap gives blocks of 3 rows at multiples of 3
    assert split_box((2, 0), (8, 7), 4, 100) == [((2, 0), (1, 7)), ((3, 0), (3, 7)), ((6, 0), (3, 7)),
                                                  ((9, 0), (1, 7))]
    assert split_box((0, 0), (2, 7), 4, 100) == [((0, 0), (2, 7))]  # fits
    # one row too large: each row cut along the next dimension
    pieces = split_box((0, 3), (2, 40), 4, 64)
    assert all(math.prod(s) * 4 <= 64 for _o, s in pieces)
    assert sum(math.prod(s) for _o, s in pieces) == 80
    # the same grid whatever the range: the cuts of [0, n) are cuts of any split of it (plus the split point)
    whole = {o for o, _v in flat_range_pieces((50, 7), 0, 350, torch.zeros(350), max_bytes=100)}
    left = {o for o, _v in flat_range_pieces((50, 7), 0, 137, torch.zeros(137), max_bytes=100)}
    right = {o for o, _v in flat_range_pieces((50, 7), 137, 350, torch.zeros(213), max_bytes=100)}
    assert whole <= left | right and (left | right) - whole == {(19, 0), (19, 4), (20, 0)}


def test_pieces_are_views_and_to_full() -> None:
    full = torch.arange(4 * 5 * 6, dtype=torch.float64).view(4, 5, 6)
    data = full.reshape(-1)[7:113].clone()
    t = local_chunks((4, 5, 6), 7, 113, data, max_bytes=64)
    assert isinstance(t, LocalChunks) and t.shape == (4, 5, 6) and t.dtype == torch.float64
    assert all(v.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() for _o, v in t.pieces)
    assert all(v.numel() * 8 <= 64 for _o, v in t.pieces)
    got = t.to_full(fill=-1)
    mask = torch.zeros(120, dtype=torch.bool)
    mask[7:113] = True
    assert torch.equal(got.reshape(-1)[mask], full.reshape(-1)[mask])
    assert bool((got.reshape(-1)[~mask] == -1).all())
    assert "LocalChunks(shape=(4, 5, 6)" in repr(t)
    assert t.detach() is t
    with pytest.raises(NotImplementedError, match="LocalChunks supports only"):
        t + 1
    with pytest.raises(ValueError, match="does not fit"):
        LocalChunks((3, 4), [((2, 0), torch.zeros(2, 4))], dtype=torch.float32, device="cpu")


def test_box_chunks_cut_a_held_box_on_the_grid() -> None:
    """A box a layout holds (GTP's real rows ``shard[:3]`` at row offset 6 of a [9, 7] weight) becomes views of
    it cut by split_box; an empty box or list holds no piece."""
    shard = torch.arange(4 * 7, dtype=torch.float32).view(4, 7)
    t = box_chunks((9, 7), [((6, 0), shard[:3])], dtype=torch.float32, device="cpu", max_bytes=60)
    assert [(o, tuple(v.shape)) for o, v in t.pieces] == [((6, 0), (2, 7)), ((8, 0), (1, 7))]
    assert all(v.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr() for _o, v in t.pieces)
    assert torch.equal(t.to_full()[6:9], shard[:3]) and not t.to_full()[:6].any()
    assert box_pieces((6, 0), shard[:0]) == []
    assert box_chunks((9, 7), [], dtype=torch.float64, device="cpu").pieces == []
    with pytest.raises(ValueError, match="offsets"):
        box_pieces((6,), shard)


def test_single_process_save_and_load_round_trip(tmp_path: Path) -> None:
    """No process group: DCP saves one rank's pieces that cover the tensor, loads into other ranges in place,
    into a plain tensor, and from a file holding the tensor as one plain chunk."""
    torch.manual_seed(0)
    a, b = torch.randn(30, 7), torch.randn(4, 5, 6).to(torch.bfloat16)
    sd = {"a": LocalChunks((30, 7), flat_range_pieces((30, 7), 0, 123, a.reshape(-1)[:123], 100)
                           + flat_range_pieces((30, 7), 123, 210, a.reshape(-1)[123:], 100),
                           dtype=a.dtype, device="cpu"),
          "b": local_chunks(b.shape, 0, b.numel(), b.reshape(-1), max_bytes=64), "c": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        buf = torch.zeros(210 - 50)
        into = {"a": local_chunks((30, 7), 50, 210, buf, max_bytes=100)}
        dcp.load(into, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        assert torch.equal(buf, a.reshape(-1)[50:])  # in place into the views
        plain = {"a": torch.zeros(30, 7), "b": torch.zeros(4, 5, 6, dtype=torch.bfloat16), "c": 0}
        dcp.load(plain, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        assert torch.equal(plain["a"], a) and torch.equal(plain["b"], b) and plain["c"] == 3
        dcp.save({"a": a}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
        buf2 = torch.zeros(100)
        dcp.load({"a": local_chunks((30, 7), 10, 110, buf2)}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
        assert torch.equal(buf2, a.reshape(-1)[10:110])


def test_lift_and_lower_under_a_leading_dimension(tmp_path: Path) -> None:
    """lift_chunks puts a replica's pieces (a LocalChunks or a plain tensor, incl. 0-d) at leading offset
    ``index`` of an ``(R, *S)`` tensor as views; lower_chunks / whole_or_chunks give the same memory back; two
    "replicas" saved as one DCP file load into plain ``(R, *S)`` tensors and back into lifted views in place."""
    torch.manual_seed(1)
    w = [torch.randn(9, 7, dtype=torch.float64) for _ in range(2)]
    steps = [torch.tensor(3.0), torch.tensor(5.0)]
    halves = [[local_chunks((9, 7), 0, 30, w[r].reshape(-1)[:30], max_bytes=64),
               local_chunks((9, 7), 30, 63, w[r].reshape(-1)[30:], max_bytes=64)] for r in range(2)]
    lifted = lift_chunks(halves[1][0], 2, 1)
    assert lifted.shape == (2, 9, 7) and all(o[0] == 1 and v.shape[0] == 1 for o, v in lifted.pieces)
    assert [o[1:] for o, _v in lifted.pieces] == [o for o, _v in halves[1][0].pieces]
    low = lower_chunks(lifted, 1)
    assert all(a.data_ptr() == b.data_ptr() and a.shape == b.shape
               for (_o, a), (_p, b) in zip(low.pieces, halves[1][0].pieces, strict=True))
    assert lower_chunks(lifted, 0).pieces == [] and whole_or_chunks(low) is low  # a part: stays chunks
    whole = whole_or_chunks(lower_chunks(lift_chunks(w[0], 2, 0), 0))
    assert type(whole) is torch.Tensor and whole.data_ptr() == w[0].data_ptr() and torch.equal(whole, w[0])
    s0 = lift_chunks(steps[1], 2, 1)
    assert s0.shape == (2,) and s0.pieces[0][0] == (1,)
    assert whole_or_chunks(lower_chunks(s0, 1)).dim() == 0
    with pytest.raises(ValueError, match="index 2"):
        lift_chunks(w[0], 2, 2)
    # both replicas' pieces of both halves ("ranks") together cover (2, 9, 7): one file
    sd = {"w": LocalChunks((2, 9, 7), [p for r in range(2) for h in halves[r] for p in lift_chunks(h, 2, r).pieces],
                           dtype=torch.float64, device="cpu"),
          "step": LocalChunks((2,), [p for r in range(2) for p in lift_chunks(steps[r], 2, r).pieces],
                              dtype=torch.float32, device="cpu")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        plain = {"w": torch.zeros(2, 9, 7, dtype=torch.float64), "step": torch.zeros(2)}
        dcp.load(plain, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        assert torch.equal(plain["w"], torch.stack(w)) and plain["step"].tolist() == [3.0, 5.0]
        into, st = torch.zeros(9, 7, dtype=torch.float64), torch.tensor(0.0)
        dcp.load({"w": lift_chunks(into, 2, 1), "step": lift_chunks(st, 2, 1)}, checkpoint_id=str(tmp_path / "ck"),
                 no_dist=True)
        assert torch.equal(into, w[1]) and float(st) == 5.0  # in place
