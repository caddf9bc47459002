"""lowband.diloco.row_digest: one exact digest per row, independent of how the rows are split."""

from __future__ import annotations

import pytest
import torch

from lowband.diloco import row_digest
from lowband.diloco.row_digest import row_digests


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.complex64])
def test_a_row_split_gives_the_slices_and_the_input_is_untouched(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(7, 3, 2, generator=g, dtype=torch.float64) * 5).to(dtype)
    before = t.clone()
    whole = row_digests(t)
    assert whole.dtype == torch.int64 and whole.shape == (7,)
    assert torch.equal(torch.cat([row_digests(t[:3]), row_digests(t[3:])]), whole)
    assert torch.equal(t, before)  # a view of the weights must never be hashed in place
    assert bool(((whole >= 0) & (whole < 2**31 - 1)).all())


def test_one_ulp_changes_its_row_only() -> None:
    t = torch.randn(5, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    u = t.clone()
    u[3, 4] = torch.nextafter(u[3, 4], torch.tensor(1e9))
    moved = row_digests(u) != row_digests(t)
    assert moved.tolist() == [False, False, False, True, False]
    v = t.clone()
    v[1, 0], v[1, 1] = t[1, 1], t[1, 0]  # the same values in another order
    assert (row_digests(v) != row_digests(t)).tolist() == [False, True, False, False, False]


def test_blocks_and_small_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(10, 4, generator=torch.Generator().manual_seed(2))
    want = row_digests(t)
    monkeypatch.setattr(row_digest, "_BLOCK_ELEMS", 8)  # 2 rows per block
    assert torch.equal(row_digests(t), want)
    assert row_digests(torch.tensor(1.5, dtype=torch.float64)).shape == (1,)
    assert row_digests(torch.ones(4)).shape == (1,)
    assert row_digests(torch.zeros(0, 3)).shape == (0,)


def test_digest_pairs_extend_the_digest_and_catch_every_two_word_step() -> None:
    """``row_digest_pairs``: column 0 is ``row_digests``; a step of +1 / -1 in any one or two words of a row
    (an ulp here and there) changes both digests, at every pair of positions of a 40-word row."""
    from lowband.diloco.row_digest import row_digest_pairs

    t = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    pairs = row_digest_pairs(t)
    assert pairs.shape == (6, 2) and pairs.dtype == torch.int64 and torch.equal(pairs[:, 0], row_digests(t))
    words = t[0].clone().view(torch.int32)
    base = row_digest_pairs(words.view(torch.float32))
    steps = []
    for j in range(40):
        for k in range(j, 40):
            for dj, dk in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
                w = words.clone()
                w[j] += dj
                if k != j:
                    w[k] += dk
                steps.append(w)
    moved = row_digest_pairs(torch.stack(steps).view(torch.float32))
    assert bool((moved != base).all())  # both digests moved, for every step
