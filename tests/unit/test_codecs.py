"""Wire codecs: round-trip error within each codec's documented bound, layout, byte counts, errors."""

from __future__ import annotations

import pytest
import torch

from lowband.comm import Comm, CommLedger
from lowband.comm.codecs import (
    CODECS,
    codec_all_reduce,
    get_codec,
    get_wire,
    reference_all_reduce,
    reference_wire_all_reduce,
    sender_roundtrip,
    wire_all_reduce,
    wire_bytes_per_rank,
)
from lowband.comm.compress import MESSAGE_CODECS, pack_bits, unpack_bits


def _samples(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows with very different magnitudes, zeros, tiny values and one outlier per block."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(512, generator=g, dtype=torch.float64) * 10.0**e for e in (-30, -6, -2, 0, 3, 20)]
    special = torch.zeros(512, dtype=torch.float64)
    special[3] = 1e4
    special[300] = -2.5e-3
    special[301:320] = torch.linspace(-1e-8, 1e-8, 19, dtype=torch.float64)
    rows.append(special)
    rows.append(torch.zeros(512, dtype=torch.float64))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_within_documented_bound(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name, block_size=64)
    x = _samples(dtype)
    enc = codec.encode(x)
    assert enc.dtype == torch.uint8 and enc.shape == (x.shape[0], codec.encoded_nbytes(x.shape[1]))
    y = codec.decode(enc, x.shape[1], dtype)
    assert y.dtype == dtype and y.shape == x.shape
    err = (x.to(torch.float64) - y.to(torch.float64)).abs()
    bound = codec.error_bound(x)
    assert bool((err <= bound).all()), f"{name}: max excess {(err - bound).max().item()}"
    if name in ("fp64",) or (name == "fp32" and dtype == torch.float32):
        assert torch.equal(x, y)
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))  # all-zero block stays exactly zero


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_bounds_are_tight_enough_to_mean_something(name: str) -> None:
    codec = get_codec(name, block_size=32)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    y = codec.decode(codec.encode(x), 256)
    rel = ((x - y).norm() / x.norm()).item()
    assert 0 < rel < (0.04 if name == "fp8" else 0.01)
    assert (codec.error_bound(x) < 0.1 * x.abs().amax()).all()


def test_encoded_sizes() -> None:
    assert get_codec("fp32").encoded_nbytes(1024) == 4096
    assert get_codec("bf16").encoded_nbytes(1024) == 2048
    assert get_codec("fp8", 256).encoded_nbytes(1024) == 1024 + 16
    assert get_codec("int8", 128).encoded_nbytes(1024) == 1024 + 32


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"wire codec 'fp4' is not supported; allowed"):
        get_codec("fp4")
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4; got 6"):
        get_codec("int8", block_size=6)
    with pytest.raises(ValueError, match="not a multiple of block_size 64"):
        get_codec("fp8", 64).encode(torch.zeros(1, 100))
    with pytest.raises(ValueError, match="2-D float"):
        get_codec("bf16").encode(torch.zeros(4))
    with pytest.raises(ValueError, match="op 'max'"):
        codec_all_reduce(Comm(ledger=CommLedger()), torch.zeros(4), get_codec("fp32"), op="max")


@pytest.mark.parametrize("name", CODECS)
def test_single_rank_all_reduce_matches_reference(name: str) -> None:
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    codec = get_codec(name, block_size=16)
    dtype = torch.float64 if name == "fp64" else torch.float32
    x = torch.randn(101, dtype=dtype)
    ref = reference_all_reduce([x], codec, "avg")
    y = x.clone()
    codec_all_reduce(comm, y, codec, op="avg", tag="t")
    assert torch.equal(y, ref)
    assert ledger.count(tag="t") == 2 and ledger.wire_bytes() == 0


# ------------------------------------------------------------------ message codecs (below 8 bits, top-k)
def _flat_samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = 1000  # not a multiple of any block / chunk: padding is exercised
    return {"random": torch.randn(n, generator=g),
            "heavy_tailed": torch.randn(n, generator=g) ** 5 * 1e3,  # |x| spans ~12 decades, big outliers
            "tiny": torch.randn(n, generator=g) * 1e-30,
            "all_zero": torch.zeros(n),
            "constant": torch.full((n,), -2.5)}


@pytest.mark.parametrize("name", MESSAGE_CODECS)
@pytest.mark.parametrize("kind", ["random", "heavy_tailed", "tiny", "all_zero", "constant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_message_codec_round_trip_within_documented_bound(name: str, kind: str, dtype: torch.dtype) -> None:
    codec = get_wire(name, block_size=16, topk_chunk=64, topk_k=8)
    x = _flat_samples()[kind].to(dtype)
    msg = codec.encode(x)
    assert msg.dtype == torch.uint8 and msg.shape == (codec.message_nbytes(x.numel()),)
    y = codec.decode(msg, x.numel(), dtype)
    assert y.dtype == dtype and y.shape == x.shape
    err = (x.to(torch.float64) - y.to(torch.float64)).abs()
    bound = codec.error_bound(x)
    assert bool((err <= bound).all()), f"{name}/{kind}: max excess {(err - bound).max().item()}"
    if kind == "all_zero":
        assert torch.equal(y, torch.zeros_like(y))
    if kind == "constant" and not name.startswith("topk"):
        assert torch.equal(y, x)  # amax lands exactly on the top level of the grid
    if name.startswith("topk"):  # exactly k per chunk of 64 kept, the rest exactly 0
        kept = (y != 0).reshape(-1)
        assert int(kept.sum()) <= 8 * -(-x.numel() // 64)


@pytest.mark.parametrize("name", MESSAGE_CODECS)
@pytest.mark.parametrize("k", [1, 8, 64])
def test_encode_with_decoder_decodes_bitwise_what_decode_does(name: str, k: int) -> None:
    """The sender's own decode (offsets taken from its selection, not parsed back) is bitwise the receivers'
    decode of the same bytes, for every dtype the gather all-reduce decodes into; NaN and inf included."""
    codec = get_wire(name, block_size=16, topk_chunk=64, topk_k=k)
    for kind, x in _flat_samples().items():
        for src in (torch.float32, torch.float64):
            xs = x.to(src)
            if kind == "random":
                xs = xs.clone()
                xs[5], xs[77] = float("nan"), -float("inf")
            msg, dec = codec.encode_with_decoder(xs)
            assert torch.equal(msg, codec.encode(xs)), f"{name}/{kind}"
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                mine, theirs = dec(dtype), codec.decode(msg, xs.numel(), dtype)
                assert mine.dtype == theirs.dtype == dtype and mine.shape == theirs.shape
                same = (mine == theirs) | (torch.isnan(mine) & torch.isnan(theirs))
                assert bool(same.all()), f"{name}/{kind}/{src}->{dtype}"
                assert torch.equal(torch.signbit(mine), torch.signbit(theirs))


def test_message_codec_bounds_are_tight_enough_to_mean_something() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    rel = {}
    for name in ("int4", "int2"):
        c = get_wire(name, block_size=32)
        rel[name] = ((x - c.decode(c.encode(x), x.numel())).norm() / x.norm()).item()
    assert 0 < rel["int4"] < 0.1 and rel["int4"] < rel["int2"] < 0.5
    topk = get_wire("topk", topk_chunk=64, topk_k=16)
    y = topk.decode(topk.encode(x), x.numel())
    kept = y != 0
    assert torch.equal(y[kept], x[kept])  # fp32 values travel exactly
    # every dropped value is at most the smallest kept magnitude of its chunk
    for c in range(0, 4096, 64):
        xs, ks = x[c:c + 64].abs(), kept[c:c + 64]
        assert int(ks.sum()) == 16 and xs[~ks].max() <= xs[ks].min()


@pytest.mark.parametrize("name", MESSAGE_CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_decodes_non_finite(name: str, bad: float) -> None:
    codec = get_wire(name, block_size=16, topk_chunk=64, topk_k=2)
    x = torch.randn(300, generator=torch.Generator().manual_seed(3))
    x[123] = bad
    y = codec.decode(codec.encode(x), 300)
    assert not bool(torch.isfinite(y).all())


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_two_phase_codecs_keep_non_finite_visible(name: str) -> None:
    codec = get_codec(name, block_size=16)
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    y = codec.decode(codec.encode(x), 64)
    assert bool(torch.isfinite(y[0]).all()) and not bool(torch.isfinite(y[1, :16]).all())


def test_message_sizes_match_the_byte_formulas() -> None:
    m = 10_000
    b, c, k = 64, 256, 8
    nb, nc = -(-m // b), -(-m // c)
    assert get_wire("int4", b).message_nbytes(m) == nb * b // 2 + 4 * nb
    assert get_wire("int2", b).message_nbytes(m) == nb * b // 4 + 4 * nb
    nv = nc * k
    assert get_wire("topk", b, c, k).message_nbytes(m) == nv * 8 // 8 + 4 * nv  # log2(256) = 8-bit offsets
    nvb = -(-nv // b)
    assert get_wire("topk-int2", b, c, k).message_nbytes(m) == nv + nvb * b // 4 + 4 * nvb
    assert get_wire("topk-int4", b, 4096, k).message_nbytes(m) == \
        -(-(-(-m // 4096) * k * 12) // 8) + get_wire("int4", b).message_nbytes(-(-m // 4096) * k)  # 12-bit
    assert wire_bytes_per_rank(get_wire("int2", b), m, 4) == 3 * get_wire("int2", b).message_nbytes(m)
    assert wire_bytes_per_rank(get_codec("int8", b), m, 4) == 2 * 3 * get_codec("int8", b).encoded_nbytes(2560)


@pytest.mark.parametrize("bits", [1, 2, 4, 7, 8, 12, 16])
def test_pack_bits_round_trip(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits))
    buf = pack_bits(codes, bits)
    assert buf.dtype == torch.uint8 and buf.numel() == -(-1001 * bits // 8)
    assert torch.equal(unpack_bits(buf, 1001, bits), codes)


def test_message_codec_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^wire codec must be one of fp64, fp32, bf16, fp8, int8, int4, int2, topk, "
                                         r"topk-int4, topk-int2, topk-rice, topk-rice-int4, topk-rice-int2; "
                                         r"got 'int3'$"):
        get_wire("int3")
    with pytest.raises(ValueError, match=r"^codec topk_chunk must be a power of two in \[2, 65536\]; got 100$"):
        get_wire("topk", topk_chunk=100)
    with pytest.raises(ValueError, match=r"^codec topk_k must be in \[1, codec topk_chunk = 64\]; got 65$"):
        get_wire("topk-int2", topk_chunk=64, topk_k=65)
    with pytest.raises(ValueError, match=r"^codec block_size must be a positive multiple of 4; got 6$"):
        get_wire("int4", block_size=6)
    with pytest.raises(ValueError, match="1-D float"):
        get_wire("int2").encode(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="1-D uint8 message of"):
        get_wire("int2").decode(torch.zeros(3, dtype=torch.uint8), 100)


@pytest.mark.parametrize("name", [*CODECS, *MESSAGE_CODECS])
def test_single_rank_wire_all_reduce_matches_reference_and_residual(name: str) -> None:
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    codec = get_wire(name, block_size=16, topk_chunk=32, topk_k=4)
    dtype = torch.float64 if name == "fp64" else torch.float32
    x = torch.randn(101, dtype=dtype)
    ref = reference_wire_all_reduce([x], codec, "avg")
    y = x.clone()
    res = torch.empty_like(x)
    wire_all_reduce(comm, y, codec, op="avg", tag="t", residual_out=res)
    assert torch.equal(y, ref)
    assert torch.equal(res, x - sender_roundtrip(codec, x, 1))
    assert ledger.count(tag="t") == (1 if name in MESSAGE_CODECS else 2) and ledger.wire_bytes() == 0


@pytest.mark.parametrize("name", ["int8", "topk-int2"])
def test_avg_over_divides_by_the_contributors(name: str) -> None:
    """``avg_over=U``: the sum divided by U instead of N (fault-tolerant DiLoCo: healed replicas send zeros).
    Three inputs, the third zero: the reference with U = 2 is (x0 + x1) / 2 through the codec, which differs
    from the plain average over 3; a single rank with U = 1 is the plain reduction; U outside 1..N and U
    with op 'sum' are refused."""
    codec = get_wire(name, block_size=16, topk_chunk=32, topk_k=8)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(101, generator=g), torch.randn(101, generator=g), torch.zeros(101)]
    two = reference_wire_all_reduce(xs, codec, avg_over=2)
    three = reference_wire_all_reduce(xs, codec)
    summed = reference_wire_all_reduce(xs, codec, op="sum")
    assert not torch.equal(two, three)
    if name == "topk-int2":  # a message codec divides the decoded sum: exactly the sum / 2
        assert torch.equal(two, summed / 2)
    else:  # int8 re-encodes the reduced chunk: sum / 2 and sum are each within half a quantum (block max / 127)
        assert torch.allclose(two, summed / 2, rtol=0, atol=float(summed.abs().max()) / 127)
    comm = Comm(ledger=CommLedger())
    y = xs[0].clone()
    wire_all_reduce(comm, y, codec, avg_over=1)
    assert torch.equal(y, reference_wire_all_reduce(xs[:1], codec))
    for bad, op in ((0, "avg"), (2, "avg"), (True, "avg"), (1, "sum")):
        with pytest.raises(ValueError, match="avg_over"):
            wire_all_reduce(comm, xs[0].clone(), codec, op=op, avg_over=bad)
    with pytest.raises(ValueError, match="avg_over"):
        reference_wire_all_reduce(xs, codec, avg_over=4)


@pytest.mark.parametrize("divisor", [3.0, 7.0, 127.0, 448.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_true_div_is_ieee_division_not_a_reciprocal_multiply(divisor: float, dtype: torch.dtype) -> None:
    """The codecs' scales and averages divide with ``true_div``: on CPU it is bitwise ``t / divisor`` (CPU
    results unchanged), and it is not ``t * (1 / divisor)``, the rounding CUDA's kernel uses for a
    Python-number divisor (on one H200 that made fp8/int8/int4/int2 bytes differ from CPU's:
    docs/PERFORMANCE.md, GPU; ``scripts/gpu_parity.py`` checks the CUDA side)."""
    from lowband.comm.comm import true_div, true_div_

    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0), dtype=dtype) * 1e3
    out = true_div(t, divisor)
    assert torch.equal(out, t / divisor) and out.dtype == dtype
    assert torch.equal(true_div_(t.clone(), divisor), t / divisor)
    assert not torch.equal(out, t * (1.0 / divisor))
