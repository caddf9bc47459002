"""Rice-coded top-k offsets (:mod:`lowband.comm.rice`) and the ``topk-rice*`` codecs built on them.

The coding is lossless, so the reference is the fixed-width codec itself: every ``topk-rice*`` message decodes
bitwise what the ``topk*`` message of the same input decodes, while its offsets take the fixed Rice slot of
``k (r + 1) + ((C - k) >> r)`` bits per chunk (worst-case supports included: all values at the start or the
end of a chunk, every value kept, one kept).
"""

from __future__ import annotations

import math

import pytest
import torch

from lowband.comm.compress import get_message_codec
from lowband.comm.rice import decode_offsets, encode_offsets, rice_parameter, slot_bits

SHAPES = [(4096, 32), (256, 8), (2, 1), (2, 2), (16, 16), (1024, 1), (65536, 3), (4096, 64), (64, 63), (8, 3)]


def _supports(chunk: int, k: int, n: int, seed: int) -> torch.Tensor:
    """``n`` sorted supports of ``k`` offsets in ``[0, chunk)``: random ones, then the first ``k``, the last
    ``k`` (the largest gap sum) and evenly spread ones (where rounding keeps them distinct)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(chunk, generator=g)[:k].sort().values for _ in range(n)]
    rows += [torch.arange(k), torch.arange(chunk - k, chunk), torch.linspace(0, chunk - 1, k).round().long()]
    return torch.stack([r for r in rows if bool((r[1:] > r[:-1]).all())])


@pytest.mark.parametrize(("chunk", "k"), SHAPES)
def test_offsets_roundtrip_in_the_fixed_slot(chunk: int, k: int) -> None:
    r = rice_parameter(chunk, k)
    assert 0 <= r <= int(math.log2(chunk))
    assert slot_bits(chunk, k, r) == min(slot_bits(chunk, k, s) for s in range(int(math.log2(chunk)) + 1))
    idx = _supports(chunk, k, 12, chunk + k)
    bits = encode_offsets(idx, chunk, r)
    assert bits.shape == (idx.shape[0], slot_bits(chunk, k, r)) and bits.dtype == torch.uint8
    assert bool(((bits == 0) | (bits == 1)).all())
    assert torch.equal(decode_offsets(bits, chunk, k, r), idx)


@pytest.mark.parametrize(("chunk", "k"), SHAPES)
def test_malformed_slots_decode_without_error(chunk: int, k: int) -> None:
    """Garbage bits (all ones, all zeros, random) decode to some ``(n, k)`` offsets, without an index error:
    a corrupt message must fail where its decoded values are checked, not crash the decoder."""
    r = rice_parameter(chunk, k)
    slot = slot_bits(chunk, k, r)
    g = torch.Generator().manual_seed(chunk * 7 + k)
    bits = torch.cat([torch.ones(1, slot, dtype=torch.uint8), torch.zeros(1, slot, dtype=torch.uint8),
                      torch.randint(0, 2, (6, slot), generator=g, dtype=torch.uint8)])
    out = decode_offsets(bits, chunk, k, r)
    assert out.shape == (8, k) and out.dtype == torch.int64
    assert torch.equal(out[1], torch.arange(k))  # all-zero slot: every gap 0


def test_known_slot_sizes() -> None:
    """C = 4096, k = 32: 287 bits (8.97 per value) against 384 fixed; C = 256, k = 8: 55 against 64; about
    the entropy of the support plus 8 % at 4096 / 32."""
    assert (rice_parameter(4096, 32), slot_bits(4096, 32, rice_parameter(4096, 32))) == (6, 287)
    assert slot_bits(256, 8, rice_parameter(256, 8)) == 55
    entropy = math.log2(math.comb(4096, 32))
    assert entropy < 287 < 1.08 * entropy


@pytest.mark.parametrize(("chunk", "k"), SHAPES)
@pytest.mark.parametrize("values", ["", "-int4", "-int2"])
def test_rice_codec_decodes_what_the_fixed_codec_decodes(chunk: int, k: int, values: str) -> None:
    fixed = get_message_codec("topk" + values, 64, chunk, k)
    rice = get_message_codec("topk-rice" + values, 64, chunk, k)
    nbits_fixed = k * int(math.log2(chunk))
    s = slot_bits(chunk, k, rice_parameter(chunk, k))
    assert rice.rice_coded == (s < nbits_fixed)
    assert rice.chunk_offset_bits == min(s, nbits_fixed)
    for m in (chunk, 3 * chunk + 1, 5 * chunk - 1):
        g = torch.Generator().manual_seed(m + k)
        x = torch.randn(m, generator=g) * torch.logspace(-3, 3, m)
        if m % 2:  # the kept values at the end of the first chunk: the largest gap sum
            x[max(chunk - k, 0):chunk] = 1e4
        nc = -(-m // chunk)
        msg = rice.encode(x)
        assert msg.numel() == rice.message_nbytes(m) == -(-nc * rice.chunk_offset_bits // 8) + (
            fixed.message_nbytes(m) - (-(-nc * nbits_fixed // 8)))
        assert torch.equal(rice.decode(msg, m), fixed.decode(fixed.encode(x), m))


def test_rice_saves_bytes_where_it_is_used() -> None:
    """The message of the bench's 69,760-element fragment at 4096 / 32 with int2 values: 850 bytes against 1,068."""
    m = 69_760
    assert get_message_codec("topk-rice-int2", 256, 4096, 32).message_nbytes(m) == 850
    assert get_message_codec("topk-int2", 256, 4096, 32).message_nbytes(m) == 1_068
