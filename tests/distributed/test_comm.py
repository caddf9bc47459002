"""Each collective through `Comm` on 1, 2 and 4 gloo ranks against torch's own result and the
ring-model byte count."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger, ring_wire_bytes
from lowband.testing import DistributedTestError, DistributedTimeout, run_ranks


def _data(rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _collectives_match_torch(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger)
    m = 37  # chunk elements, odd on purpose
    x = _data(rank, n * m, dtype)
    esize = x.element_size()

    # reduce-scatter (sum and avg) vs torch all_reduce + chunk
    ref = x.clone()
    dist.all_reduce(ref)
    out = torch.empty(m, dtype=dtype)
    comm.reduce_scatter(out, x)
    # rank-order sum: reproduce exactly
    allx = [_data(r, n * m, dtype) for r in range(n)]
    exact = allx[0][rank * m:(rank + 1) * m].clone()
    for r in range(1, n):
        exact += allx[r][rank * m:(rank + 1) * m]
    assert torch.equal(out, exact)
    # ref: gloo's all-reduce may sum in another order. n <= 4 terms of O(1) values: |err| <= (n-1) eps sum|x|,
    # about 1.3e-15 in float64 and 7e-7 in float32, whatever kernels this CPU picks.
    torch.testing.assert_close(out, ref[rank * m:(rank + 1) * m], rtol=1e-12 if dtype == torch.float64
                               else 1e-6, atol=1e-12 if dtype == torch.float64 else 1e-6)
    h = comm.reduce_scatter(out, x, op="avg", async_op=True)
    assert h.wait() is out
    assert torch.equal(out, exact / n)

    # all-gather vs torch all_gather
    mine = _data(rank, m, dtype)
    full = torch.empty(n * m, dtype=dtype)
    comm.all_gather(full, mine)
    ref_list = [torch.empty(m, dtype=dtype) for _ in range(n)]
    dist.all_gather(ref_list, mine)
    assert torch.equal(full, torch.cat(ref_list))
    bcast = Comm(name="world", ledger=CommLedger(), algorithms={"all_gather": "broadcast"})
    full2 = torch.empty(n * m, dtype=dtype)
    bcast.all_gather(full2, mine, async_op=True).wait()
    assert torch.equal(full2, full)
    assert bcast.ledger.records[0].algorithm == ("broadcast" if n > 1 else "local")
    assert bcast.ledger.wire_bytes() == (n - 1) * m * esize

    # all-reduce sum / avg / max
    y = x.clone()
    comm.all_reduce(y)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    y = x.clone()
    comm.all_reduce(y, "avg", async_op=True).wait()
    torch.testing.assert_close(y, ref / n, rtol=0, atol=0)
    y = x.clone()
    comm.all_reduce(y, "max")
    assert torch.equal(y, torch.stack(allx).max(0).values)

    # all-to-all, even and variable splits
    a2a_out = torch.empty_like(x)
    comm.all_to_all(a2a_out, x)
    expect = torch.cat([allx[r][rank * m:(rank + 1) * m] for r in range(n)])
    assert torch.equal(a2a_out, expect)
    # rank r sends (j + r + 1) rows of width 3 to rank j
    send_splits = [j + rank + 1 for j in range(n)]
    recv_splits = [rank + r + 1 for r in range(n)]
    rows = torch.arange(sum(send_splits) * 3, dtype=dtype).view(-1, 3) + 1000 * rank
    recv = torch.empty(sum(recv_splits), 3, dtype=dtype)
    comm.all_to_all(recv, rows, recv_splits, send_splits, tag="var")
    off = 0
    for r in range(n):
        their_splits = [j + r + 1 for j in range(n)]
        start = sum(their_splits[:rank])
        theirs = torch.arange(sum(their_splits) * 3, dtype=dtype).view(-1, 3) + 1000 * r
        assert torch.equal(recv[off:off + recv_splits[r]], theirs[start:start + their_splits[rank]])
        off += recv_splits[r]

    # broadcast from the last rank
    b = _data(rank, 11, dtype)
    comm.broadcast(b, src=n - 1)
    assert torch.equal(b, _data(n - 1, 11, dtype))

    # ledger: exact counts and ring bytes
    assert ledger.count("reduce_scatter") == 2
    assert ledger.wire_bytes("reduce_scatter") == 2 * ring_wire_bytes("reduce_scatter", n, n * m * esize)
    assert ledger.wire_bytes("reduce_scatter") == 2 * ((n - 1) * m * esize)
    assert ledger.count("all_gather") == 1
    assert ledger.wire_bytes("all_gather") == (n - 1) * m * esize
    assert ledger.count("all_reduce") == 3
    assert ledger.wire_bytes("all_reduce") == 3 * (2 * (n - 1) * n * m * esize // n)
    assert ledger.count("all_to_all") == 2
    var_sent = (sum(send_splits) - send_splits[rank]) * 3 * esize
    assert ledger.wire_bytes("all_to_all", tag="var") == var_sent
    assert ledger.wire_bytes("all_to_all") == (n - 1) * m * esize + var_sent
    assert ledger.count("broadcast") == 1
    assert ledger.wire_bytes("broadcast") == (n - 1) * 11 * esize // n
    for r in ledger.records:
        assert r.group == "world" and r.group_size == n and r.elapsed_s is not None
    # gloo defaults of a user's Comm: gloo's collectives (p2p is the sharded optimizer's private default)
    algos = {rec.op: rec.algorithm for rec in ledger.records}
    assert algos["reduce_scatter"] == ("alltoall+sum" if n > 1 else "local")
    assert algos["all_gather"] == algos["all_to_all"] == ("native" if n > 1 else "local")
    totals = ledger.mark_step()
    assert totals.count == 9 and totals.wire_bytes == sum(r.wire_bytes for r in ledger.records)
    assert ledger.mark_step().count == 0


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_collectives_match_torch(world: int, dtype_name: str) -> None:
    run_ranks(_collectives_match_torch, world, dtype_name)


def _bf16_wire() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    m = 64
    allx = [_data(r, n * m) for r in range(n)]
    x = allx[rank]
    out = torch.empty(m)
    comm.reduce_scatter(out, x, op="avg", wire_dtype=torch.bfloat16)
    # reference: each contribution rounded to bf16, summed in fp32 in rank order
    exact = allx[0][rank * m:(rank + 1) * m].bfloat16().float()
    for r in range(1, n):
        exact += allx[r][rank * m:(rank + 1) * m].bfloat16().float()
    assert torch.equal(out, exact / n)
    assert ledger.wire_bytes("reduce_scatter") == (n - 1) * m * 2
    assert ledger.records[-1].wire_dtype == "bfloat16"

    full = torch.empty(n * m)
    comm.all_gather(full, x[:m], wire_dtype=torch.bfloat16)
    assert torch.equal(full, torch.cat([a[:m].bfloat16().float() for a in allx]))
    bcast = Comm(ledger=CommLedger(), algorithms={"all_gather": "broadcast"})
    full2 = torch.empty(n * m)
    bcast.all_gather(full2, x[:m], wire_dtype=torch.bfloat16)
    assert torch.equal(full2, full)
    assert ledger.wire_bytes("all_gather") == (n - 1) * m * 2

    y = x.clone()
    comm.all_reduce(y, "sum", wire_dtype=torch.bfloat16)
    ref = torch.stack([a.bfloat16().float() for a in allx]).sum(0)
    torch.testing.assert_close(y, ref.bfloat16().float(), rtol=0, atol=0)
    gathered = [torch.empty_like(y) for _ in range(n)]
    dist.all_gather(gathered, y)
    assert all(torch.equal(g, y) for g in gathered)  # identical on every rank
    assert ledger.wire_bytes("all_reduce") == 2 * (n - 1) * n * m * 2 // n


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_wire_accumulates_in_fp32(world: int) -> None:
    run_ranks(_bf16_wire, world)


def _native_override_matches() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm(algorithms={"reduce_scatter": "native", "all_gather": "native"}, ledger=CommLedger())
    m = 16
    x = _data(rank, n * m, torch.float64)
    out = torch.empty(m, dtype=torch.float64)
    comm.reduce_scatter(out, x)
    ref = x.clone()
    dist.all_reduce(ref)
    # float64, n <= 4 O(1) terms in possibly another order: |err| <= (n-1) eps sum|x| ~ 1.3e-15 < 1e-14
    torch.testing.assert_close(out, ref[rank * m:(rank + 1) * m], rtol=1e-14, atol=1e-14)
    full = torch.empty(n * m, dtype=torch.float64)
    comm.all_gather(full, out)
    torch.testing.assert_close(full, ref, rtol=1e-14, atol=1e-14)
    assert [r.algorithm for r in comm.ledger.records] == ["native", "native"]


def test_native_override() -> None:
    run_ranks(_native_override_matches, 2)


def _algorithms_agree_bitwise() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    m = 1031  # chunk elements, odd
    x = _data(rank, n * m)
    results = {}
    for rs, ag, a2a in (("p2p", "p2p", "p2p"), ("alltoall", "broadcast", "native"), ("alltoall", "native", "native")):
        comm = Comm(algorithms={"reduce_scatter": rs, "all_gather": ag, "all_to_all": a2a}, ledger=CommLedger())
        # several exchanges in flight at once, waited for in reverse order: each has its own tag
        outs = [torch.empty(m), torch.empty(m), torch.empty(n * m), torch.empty(n * m)]
        handles = [comm.reduce_scatter(outs[0], x, async_op=True),
                   comm.reduce_scatter(outs[1], x * 2, op="avg", wire_dtype=torch.bfloat16, async_op=True),
                   comm.all_gather(outs[2], x[:m], async_op=True), comm.all_to_all(outs[3], x, async_op=True)]
        for h in reversed(handles):
            h.wait()
        results[(rs, ag, a2a)] = outs
        assert comm.ledger.wire_bytes() == 2 * (n - 1) * m * 4 + (n - 1) * m * 2 + (n - 1) * m * 4
    first = results[("p2p", "p2p", "p2p")]
    for outs in results.values():
        assert all(torch.equal(a, b) for a, b in zip(first, outs, strict=True))
    allx = [_data(r, n * m) for r in range(n)]
    exact = allx[0][rank * m:(rank + 1) * m].clone()
    for r in range(1, n):
        exact += allx[r][rank * m:(rank + 1) * m]
    assert torch.equal(first[0], exact)
    assert torch.equal(first[2], torch.cat([a[:m] for a in allx]))
    assert torch.equal(first[3], torch.cat([a[rank * m:(rank + 1) * m] for a in allx]))


@pytest.mark.parametrize("world", [2, 4])
def test_point_to_point_algorithms_match_the_collective_ones_bitwise(world: int) -> None:
    run_ranks(_algorithms_agree_bitwise, world)


def gather_on_rank_zero_only(algorithm: str = "p2p") -> str:
    """Rank 0 alone calls an all-gather (``algorithm``, tag ``"param"``); the others wait until it is done."""
    comm = Comm(ledger=CommLedger(), algorithms={"all_gather": algorithm})
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() != 0:  # stays up (its connections open) until rank 0 is done, however long it takes
        store.wait([f"{algorithm}_test_done"], timedelta(seconds=50))
        return "skipped"
    try:
        comm.all_gather(torch.empty(dist.get_world_size() * 8), torch.ones(8), tag="param")
        return "returned"
    except RuntimeError as e:
        return str(e)
    finally:
        store.set(f"{algorithm}_test_done", "1")


def test_point_to_point_exchange_without_a_partner_times_out() -> None:
    # a point-to-point receive waits forever unless given a timeout: lowband gives it the group's
    res = run_ranks(gather_on_rank_zero_only, 2, timeout=60, pg_timeout=3)
    assert res[1] == "skipped"
    assert "timed out" in res[0].lower(), res[0]


def test_bad_arguments_single_process() -> None:
    comm = Comm(ledger=CommLedger())
    with pytest.raises(ValueError, match="algorithms"):
        Comm(algorithms={"reduce_scatter": "magic"})
    with pytest.raises(ValueError, match="op"):
        comm.all_reduce(torch.zeros(2), "prod")
    with pytest.raises(ValueError, match="wire_dtype"):
        comm.all_reduce(torch.zeros(2, dtype=torch.int64), wire_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected"):
        comm.reduce_scatter(torch.zeros(3), torch.zeros(4))


def _rank() -> int:
    return dist.get_rank()


def _raises_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")


def test_harness_reports_failing_rank() -> None:
    from lowband.testing.multirank import _POOLS, STARTUP_RETRIES

    assert run_ranks(_rank, 2) == [0, 1]
    pool, retries = _POOLS[2], STARTUP_RETRIES[0]
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2[\s\S]*boom on purpose"):
        run_ranks(_raises_on_rank_one, 2)
    assert run_ranks(_rank, 2) == [0, 1]
    # both ranks reported back (rank 0 returned, rank 1 raised): the same processes serve the next call,
    # unless a process group failed to start under load (gloo's "connection closed by peer"), which
    # retries on fresh processes
    if STARTUP_RETRIES[0] == retries:
        assert _POOLS.get(2) is pool and pool.alive()


def test_a_rendezvous_that_does_not_finish_is_retried_on_fresh_processes(monkeypatch) -> None:
    """gloo's full-mesh set-up under load can log "connection closed by peer" and then hang without failing: a
    call whose ranks have not all formed the process group within the rendezvous window is a startup failure,
    retried on fresh processes, not a 120 s timeout. A window of 0 makes every attempt one."""
    from lowband.testing import multirank

    monkeypatch.setattr(multirank, "RENDEZVOUS_TIMEOUT_S", 0.0)
    retries = multirank.STARTUP_RETRIES[0]
    with pytest.raises(DistributedTestError, match=r"failed on rank 0 of 1:\nranks \[0\] did not form the "
                                                   r"process group within 0s"):
        run_ranks(_rank, 1, timeout=30)
    assert multirank.STARTUP_RETRIES[0] - retries == multirank.MAX_STARTUP_RETRIES
    assert 1 not in multirank._POOLS  # a failed start takes its pool down
    monkeypatch.undo()
    assert run_ranks(_rank, 1) == [0]


def _sleep_forever() -> None:
    import time
    time.sleep(60)


def test_harness_times_out() -> None:
    # one rank is enough to time out, and the pool it tears down is the cheapest to start again
    with pytest.raises(DistributedTimeout, match="timed out after 3s on 1 ranks; ranks \\[0\\] did not finish"):
        run_ranks(_sleep_forever, 1, timeout=3)


def test_own_pools_stops_only_the_pools_started_inside() -> None:
    # Stand-in pools at world sizes no test uses: a real pool's start can fail and be retried on fresh
    # processes (gloo's "connection closed by peer" under load), which would change the identities.
    from lowband.testing import own_pools
    from lowband.testing.multirank import _POOLS

    class _FakePool:
        def __init__(self) -> None:
            self.closed = 0

        def close(self, kill: bool = False) -> None:
            self.closed += 1

    caller, replaced, started, replacement = _FakePool(), _FakePool(), _FakePool(), _FakePool()
    _POOLS[1001], _POOLS[1002] = caller, replaced
    try:
        with own_pools():
            _POOLS[1003] = started  # a world size first used inside the block
            _POOLS[1002] = replacement  # a pool torn down and started again inside the block
        assert _POOLS.get(1001) is caller and caller.closed == 0  # the caller's pool serves its next call
        assert started.closed == 1 and 1003 not in _POOLS
        assert replacement.closed == 1 and 1002 not in _POOLS and replaced.closed == 0
    finally:
        for world_size in (1001, 1002, 1003):
            _POOLS.pop(world_size, None)


def _gather_left_in_flight() -> bool:
    comm = Comm(ledger=CommLedger(), algorithms={"all_gather": "p2p"})
    big = 1 << 22
    out = torch.empty(2 * big)
    handle = comm.all_gather(out, torch.full((big,), 7.0 if dist.get_rank() == 0 else 1.0), async_op=True)
    if dist.get_rank() == 0:  # never waited for: the harness's destroy_process_group follows at once
        return True
    time.sleep(1.0)  # rank 0 is in destroy_process_group by now (this passed here with the drain switched off
    # too: gloo's teardown did not drop the send in these runs; the test states the contract, it cannot catch
    # its loss on this machine)
    handle.wait()
    return bool((out[:big] == 7.0).all() and (out[big:] == 1.0).all())


def test_exchange_left_in_flight_is_finished_before_the_group_is_destroyed() -> None:
    # like a queued gloo collective, a point-to-point exchange nobody waited for still completes when its
    # process group is destroyed (torch.distributed.destroy_process_group drains lowband's exchanges first)
    assert run_ranks(_gather_left_in_flight, 2, timeout=60, pg_timeout=30) == [True, True]
