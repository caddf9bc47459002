"""``Comm`` promises on 2-4 gloo ranks: bf16/fp16 sums accumulate in fp32 in rank order, and a handle that says
it is completed holds its result.

* A bf16 (fp16) tensor summed or averaged over 3+ ranks with no ``wire_dtype``: gloo's own all-reduce rounded
  every partial sum to bf16, so results differed from the fp32 rank-order sum by up to several bf16 ulps (the
  reduce-scatter already summed in fp32). The reference is exact: the fp32 sum of N bf16 values in rank order,
  rounded once to bf16.
* ``is_completed()`` returned True when the transfers were done but before the local sum (reduce-scatter,
  codec reduce-scatter) had written the output; polling callers read stale data.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger
from lowband.comm.codecs import codec_reduce_scatter, get_codec
from lowband.testing import run_ranks

TIMEOUT = 90


def _narrow_sum(dtype_name: str, op: str) -> dict:
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    every = [(torch.randn(4099, generator=gen) * torch.logspace(-3, 2, 4099)).to(dtype) for _ in range(n)]
    x = every[rank].clone()
    Comm(ledger=CommLedger()).all_reduce(x, op)
    acc = every[0].float()
    for t in every[1:]:
        acc = acc + t.float()
    if op == "avg":
        acc = acc / n
    gathered = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(gathered, x)
    return {"exact": torch.equal(x, acc.to(dtype)), "ranks_equal": all(torch.equal(g, x) for g in gathered)}


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize(("dtype", "op"), [("bfloat16", "sum"), ("float16", "sum"), ("bfloat16", "avg")])
def test_narrow_all_reduce_accumulates_in_fp32_in_rank_order(world: int, dtype: str, op: str) -> None:
    assert run_ranks(_narrow_sum, world, dtype, op, timeout=TIMEOUT) == [{"exact": True, "ranks_equal": True}] * world


def _polled() -> dict:
    n = dist.get_world_size()
    comm = Comm(ledger=CommLedger())

    def poll(h) -> None:
        t0 = time.monotonic()
        while not h.is_completed():
            assert time.monotonic() - t0 < 60
            time.sleep(0.001)

    x = torch.ones(n * 1024)
    out = torch.full((1024,), -1.0)
    h = comm.reduce_scatter(out, x, "sum", async_op=True)
    poll(h)
    rs = float(out.min())
    out2 = torch.full((1024,), -1.0)
    h2 = codec_reduce_scatter(comm, out2, x, get_codec("int8", 64), op="sum", async_op=True)
    poll(h2)
    crs = float(out2.min())
    y = torch.ones(1024)
    h3 = comm.all_reduce(y, "sum", wire_dtype=torch.bfloat16, async_op=True)  # completes in wait() only
    chained_before = h3.is_completed()
    h3.wait()
    return {"rs": rs, "codec_rs": crs, "chained_before": chained_before, "chained_after": h3.is_completed(),
            "all_reduce": float(y.min())}


@pytest.mark.parametrize("world", [2, 3])
def test_a_completed_handle_holds_its_result(world: int) -> None:
    want = {"rs": float(world), "codec_rs": float(world), "chained_before": False, "chained_after": True,
            "all_reduce": float(world)}
    assert run_ranks(_polled, world, timeout=TIMEOUT) == [want] * world
