"""``lowband.comm.codecs.codec_reduce_scatter`` on 1, 2 and 4 gloo ranks against its single-process
reference (bitwise: the same encode, the same decode, the same fp32 sums in rank order) and the exact
ledger bytes; plus the documented error bound against the exact fp64 mean.

Bound (fp8, per element of the mean): each rank's value is off by at most ``2^-4 |x| + 2^-10 s +
2^-20 |x|`` (the codec's round trip, ``s`` = its block's amax / 448), the mean of N such errors is at
most their mean, and the fp32 sum of N terms adds ``N * 2^-24`` relative of the sum of magnitudes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, default_ledger
from lowband.comm.codecs import (
    codec_reduce_scatter,
    get_codec,
    reduce_scatter_wire_bytes,
    reference_reduce_scatter,
)
from lowband.testing import run_ranks

SHARD = 300  # not a multiple of the block size: every chunk is padded
BLOCK = 64


def _inputs(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    # magnitudes over several decades, so blocks have different scales and fp8 subnormals occur
    return [torch.randn(world * SHARD, generator=g) * torch.logspace(-4, 2, world * SHARD) for _ in range(world)]


def _rank(name: str, op: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    x = _inputs(world)[rank]
    out = torch.empty(SHARD)
    ledger = default_ledger()
    ledger.reset()
    handle = codec_reduce_scatter(Comm(), out, x, get_codec(name, block_size=BLOCK), op=op, async_op=True, tag="rs")
    x.fill_(float("nan"))  # the input may be reused as soon as the call returns
    handle.wait()
    recs = ledger.select(tag="rs")
    return {"out": out, "ops": [r.op for r in recs], "bytes": ledger.wire_bytes(tag="rs")}


@pytest.mark.parametrize(("world", "name", "op"), [(1, "fp8", "avg"), (2, "fp8", "avg"), (4, "fp8", "avg"),
                                                   (2, "int8", "sum"), (4, "bf16", "avg")])
def test_codec_reduce_scatter_equals_reference(world: int, name: str, op: str) -> None:
    res = run_ranks(_rank, world, name, op)
    codec = get_codec(name, block_size=BLOCK)
    ref = reference_reduce_scatter(_inputs(world), codec, op)
    for r in range(world):
        assert torch.equal(res[r]["out"], ref[r]), r
        assert res[r]["ops"] == ["all_to_all"]
        assert res[r]["bytes"] == reduce_scatter_wire_bytes(codec, SHARD, world)
    if world > 1:  # scaled codecs: 320 padded elements per chunk, 1 byte each + one fp32 scale per 64;
        # bf16 has no blocks (no padding): 2 bytes per element
        expect = {"fp8": 320 + 4 * 5, "int8": 320 + 4 * 5, "bf16": 2 * 300}[name]
        assert res[0]["bytes"] == (world - 1) * expect


def test_fp8_mean_is_within_the_codec_bound() -> None:
    world = 4
    inputs = _inputs(world)
    codec = get_codec("fp8", block_size=BLOCK)
    got = torch.cat(reference_reduce_scatter(inputs, codec, "avg")).double()
    xs = torch.stack([x.double() for x in inputs])
    exact = xs.mean(0)
    blocks = torch.nn.functional.pad(xs.view(world, world, SHARD), (0, 20)).view(world, world, -1, BLOCK)
    scale = (blocks.abs().amax(-1, keepdim=True) / 448).expand_as(blocks).reshape(world, world, -1)[..., :SHARD]
    per_rank = 2.0**-4 * xs.abs() + 2.0**-10 * scale.reshape(world, -1) + 2.0**-20 * xs.abs()
    bound = per_rank.mean(0) + world * 2.0**-24 * xs.abs().mean(0) * 2
    err = (got - exact).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0  # fp8 is lossy: the comparison can fail
