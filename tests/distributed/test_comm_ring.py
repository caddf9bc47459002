"""The pipelined ring reduce-scatter and all-gather (:mod:`lowband.comm.ring`) on 3 and 4 gloo ranks:
bitwise equal to the single-process ring-order reference, within the summation-order bound of the rank-order
sum, exact bytes in the ledger, several operations in flight with other collectives between them, the
defaults of the sharded optimizer's private group, a missing partner timing out with the operation named, and
an operation nobody waited for finished before its group is destroyed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger
from lowband.comm.comm import true_div
from lowband.comm.ring import RING_MAX_PIECES, RING_MIN_CHUNK, RING_PIECE, ring_order_sum, ring_pieces
from lowband.testing import run_ranks
from tests.distributed.test_comm import gather_on_rank_zero_only

# chunk sizes: one element, two pieces (the fewest of a longer chunk), three pieces with a ragged tail, the most
# pieces (capped)
CHUNKS = (1, 1031, 3 * RING_PIECE + 7, (RING_MAX_PIECES + 3) * RING_PIECE)


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -3, 4, (numel,), generator=g)).to(dtype)


def _ring_matches_reference() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    for dtype in (torch.float32, torch.float64):
        for m in CHUNKS:
            ledger = CommLedger()
            comm = Comm(ledger=ledger, algorithms={"reduce_scatter": "ring", "all_gather": "ring"})
            x = _data(rank, n * m, dtype)
            outs = [torch.full((m,), float("nan"), dtype=dtype) for _ in range(2)]
            full = torch.full((n * m,), float("nan"), dtype=dtype)
            # three ring operations in flight at once, a gloo collective issued between them on the same group,
            # waited for in reverse order: each operation has its own tags and the ring thread runs them in order
            h_sum = comm.reduce_scatter(outs[0], x, async_op=True)
            h_avg = comm.reduce_scatter(outs[1], x, op="avg", async_op=True, tag="grad")
            flag = torch.tensor([float(rank)], dtype=torch.float64)
            comm.all_reduce(flag, "max")
            h_ag = comm.all_gather(full, x[rank * m:(rank + 1) * m], async_op=True, tag="param")
            fut = h_ag.future()
            for h in (h_ag, h_avg, h_sum):
                h.wait()
            assert h_sum.is_completed() and float(flag) == n - 1
            assert fut.wait() is full
            parts = [_data(r, n * m, dtype)[rank * m:(rank + 1) * m] for r in range(n)]
            ref = ring_order_sum(parts, rank)
            assert torch.equal(outs[0], ref)
            assert torch.equal(outs[1], true_div(ref, n))
            # against the sum in float64: a recursive sum of n terms is within (n - 1) u sum_i |x_i| of the exact
            # sum (u: unit roundoff of the dtype); in float64 the comparison sum has that error too, so twice
            exact = torch.stack([p.double() for p in parts]).sum(0)
            sums = 2 if dtype == torch.float64 else 1
            bound = sums * (n - 1) * torch.finfo(dtype).eps / 2 * torch.stack([p.double().abs() for p in parts]).sum(0)
            assert bool(((outs[0].double() - exact).abs() <= bound).all())
            assert torch.equal(full, torch.cat([_data(r, n * m, dtype)[r * m:(r + 1) * m] for r in range(n)]))
            esize = torch.empty((), dtype=dtype).element_size()
            recs = ledger.select(op="reduce_scatter") + ledger.select(op="all_gather")
            assert [r.algorithm for r in recs] == ["ring"] * 3
            assert all(r.wire_bytes == (n - 1) * m * esize for r in recs)
    assert [ring_pieces(m) for m in CHUNKS] == [1, 2, 3, RING_MAX_PIECES]


@pytest.mark.parametrize("world", [3, 4])
def test_ring_equals_the_ring_order_reference_bitwise(world: int) -> None:
    run_ranks(_ring_matches_reference, world)


def _defaults() -> dict:
    n, m, small = dist.get_world_size(), RING_MIN_CHUNK, RING_MIN_CHUNK - 1
    user = Comm(ledger=CommLedger())
    private = user.private("sharded")
    out = {}
    for name, comm in (("user", user), ("sharded", private)):
        comm.ledger.reset()
        comm.reduce_scatter(torch.empty(m), torch.ones(n * m))
        comm.reduce_scatter(torch.empty(m), torch.ones(n * m), wire_dtype=torch.bfloat16)
        comm.reduce_scatter(torch.empty(m, dtype=torch.float64), torch.ones(n * m, dtype=torch.float64))
        comm.reduce_scatter(torch.empty(small), torch.ones(n * small))
        comm.all_gather(torch.empty(n * m), torch.ones(m))
        comm.all_gather(torch.empty(n * small), torch.ones(small))
        out[name] = [r.algorithm for r in comm.ledger.records]
    return out


def test_defaults_ring_only_on_the_sharded_group_from_three_ranks() -> None:
    four = run_ranks(_defaults, 4)[0]
    # a narrower wire keeps fp32 sums at the owner; a chunk below RING_MIN_CHUNK goes as one exchange
    assert four["sharded"] == ["ring", "p2p+sum", "ring", "p2p+sum", "ring", "p2p"]
    assert four["user"] == ["alltoall+sum"] * 4 + ["native"] * 2
    two = run_ranks(_defaults, 2)[0]
    assert two["sharded"] == ["p2p+sum"] * 4 + ["p2p"] * 2  # at two ranks the ring is the exchange


def test_ring_without_partners_times_out_naming_the_operation() -> None:
    res = run_ranks(gather_on_rank_zero_only, 3, "ring", timeout=60, pg_timeout=3)
    assert res[1:] == ["skipped", "skipped"]
    assert "all_gather (tag 'param'" in res[0] and "ring" in res[0] and "timed out" in res[0].lower(), res[0]


def _ring_left_in_flight() -> bool:
    comm = Comm(ledger=CommLedger(), algorithms={"all_gather": "ring"})
    rank, n, big = dist.get_rank(), dist.get_world_size(), 1 << 20
    out = torch.empty(n * big)
    handle = comm.all_gather(out, torch.full((big,), float(rank)), async_op=True)
    if rank == 0:  # never waited for: the harness's destroy_process_group follows at once
        return True
    handle.wait()
    return all(bool((out[r * big:(r + 1) * big] == r).all()) for r in range(n))


def test_ring_left_in_flight_is_finished_before_the_group_is_destroyed() -> None:
    assert run_ranks(_ring_left_in_flight, 3, timeout=60, pg_timeout=30) == [True, True, True]


def test_ring_order_sum_single_process() -> None:
    parts = [torch.tensor([1e16]), torch.tensor([1.0]), torch.tensor([-1e16]), torch.tensor([1.0])]
    # owner 1: ((x2 + x3) + x0) + x1 = ((-1e16 + 1) + 1e16) + 1 = 0 + 1 in float64 rounding of -1e16 + 1
    assert ring_order_sum([p.double() for p in parts], 1).item() == ((-1e16 + 1.0) + 1e16) + 1.0
    assert ring_order_sum([p.double() for p in parts], 3).item() == ((1e16 + 1.0) + -1e16) + 1.0


def _child_workers(q) -> None:
    from lowband.comm import ring

    q.put(len(ring._WORKERS))


def test_forked_child_starts_without_the_parents_ring_threads() -> None:
    import multiprocessing as mp

    from lowband.comm import ring

    ring.worker_for(None, "fork-test")
    assert ring._WORKERS
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_workers, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5) == 0
