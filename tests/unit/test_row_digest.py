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


def test_digest_pairs_tell_the_words_that_share_a_residue_of_the_first_apart() -> None:
    """``row_digests`` reads signed words modulo 2^31 - 1, where 0x7FFFFFFF (a NaN) and 0 (+0.0) share a residue,
    as do 0x80000000 (-0.0) and 0xFFFFFFFF (a NaN): the second digest of a pair reads the words unsigned modulo a
    prime above 2^32, so a row holding one where another holds the other differs there."""
    from lowband.diloco.row_digest import row_digest_pairs

    base = torch.tensor([[0.0, 1.0, -2.0, 0.5]])
    for a, b in ((0, 0x7FFFFFFF), (-(2**31), -1)):
        for pos in range(4):
            x, y = base.clone(), base.clone()
            x.view(torch.int32)[0, pos], y.view(torch.int32)[0, pos] = a, b
            dx, dy = row_digest_pairs(x), row_digest_pairs(y)
            assert dx[0, 0] == dy[0, 0]  # the first digest cannot tell them apart (and must not change)
            assert dx[0, 1] != dy[0, 1], (a, b, pos)
    half = torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16)
    other = half.clone()
    other.view(torch.int16)[0, 0] = -1  # 0xFFFF: a bf16 NaN beside +0.0
    assert row_digest_pairs(half)[0, 1] != row_digest_pairs(other)[0, 1]
