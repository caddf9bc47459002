"""lowband.diloco.average.segment_length: whole rows of at least 64 elements, a 1-d tensor's rows its elements,
rows longer than 2^16 elements cut into pieces of 2^16."""

from __future__ import annotations

import torch

from lowband.diloco.average import SEGMENT_MAX_ELEMS, SEGMENT_MIN_ELEMS, _segment_digests, segment_length


def test_segment_lengths_and_counts() -> None:
    cases = {(): 64, (10,): 64, (1000,): 64, (1000, 3): 66, (5, 100): 100, (4, 2, 50): 100, (0,): 1, (4, 0): 1,
             (1, 200_000): SEGMENT_MAX_ELEMS, (3, SEGMENT_MAX_ELEMS): SEGMENT_MAX_ELEMS}
    for shape, want in cases.items():
        t = torch.zeros(shape)
        assert segment_length(t) == want, shape
        assert SEGMENT_MIN_ELEMS <= want <= SEGMENT_MAX_ELEMS or t.numel() == 0
        assert _segment_digests(t).shape == (-(-t.numel() // want), 2), shape  # the last segment may be shorter


def test_a_change_moves_only_its_segments_digest() -> None:
    t = torch.randn(1, 200_000, generator=torch.Generator().manual_seed(0))
    u = t.clone()
    u[0, 70_000] += 1.0  # in the second piece of the wide row
    moved = (_segment_digests(t) != _segment_digests(u)).any(dim=1)
    assert moved.tolist() == [False, True, False, False]
