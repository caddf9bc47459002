"""Wire codecs: round-trip error within each codec's documented bound, layout, byte counts, errors."""

from __future__ import annotations

import pytest
import torch

from lowband.comm import Comm, CommLedger
from lowband.comm.codecs import CODECS, codec_all_reduce, get_codec, reference_all_reduce


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
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4, got 6"):
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
