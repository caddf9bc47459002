"""Row-sparse reduce-scatter of an embedding gradient on 1, 2 and 4 gloo ranks against the dense path
(``Comm.reduce_scatter`` of the same padded gradient) and a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowband.comm import Comm, CommLedger
from lowband.comm.sparse import RowTracker, SparseRowExchange, dense_reference
from lowband.model.bigram import bigram_hash, bigram_hash_np

V, D = 13, 3  # 13 rows: padded to 14 on 2 ranks, 16 on 4 ranks


def _tokens(rank: int, mb: int, scenario: str, n: int) -> torch.Tensor:
    """Token ids of one microbatch of one rank (deterministic, so every rank can rebuild all ranks')."""
    g = torch.Generator().manual_seed(100 + 10 * rank + mb)
    if scenario == "empty0" and rank == 0:
        return torch.empty(0, 4, dtype=torch.int64)
    if scenario == "full":
        return torch.arange(V, dtype=torch.int64).repeat(2).view(2, V)  # every row, each twice
    if scenario == "dups":
        return torch.randint(0, 3, (2, 6), generator=g) * 4  # rows {0, 4, 8}, many duplicates
    if scenario == "own_only":  # rank touches only rows it owns
        per = -(-V // n)
        lo, hi = rank * per, min((rank + 1) * per, V)
        return torch.randint(lo, max(hi, lo + 1), (1, 3), generator=g).clamp(max=V - 1)
    return torch.randint(0, V, (2, 3), generator=g)


def _local_grad(rank: int, scenario: str, n: int, dtype: torch.dtype, hashed: bool,
                tracker: RowTracker | None = None) -> torch.Tensor:
    """Gradient of a 3-microbatch accumulation of an embedding lookup on rank ``rank``."""
    w = torch.zeros(V, D, dtype=dtype, requires_grad=True)
    for mb in range(3):
        tok = _tokens(rank, mb, scenario, n)
        g = torch.Generator().manual_seed(7 + 10 * rank + mb)
        idx = bigram_hash(tok, V) if hashed else tok
        coeff = torch.randn(*idx.shape, D, generator=g, dtype=torch.float64).to(dtype)
        (F.embedding(idx, w) * coeff).sum().backward()
        if tracker is not None:
            tracker.add(tok.numpy())
    return w.grad


def _owner_slice_matches_dense(dtype_name: str, scenario: str, hashed: bool, rs_algo: str | None = None) -> dict:
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger, algorithms={"reduce_scatter": rs_algo} if rs_algo else None)
    ring = comm.reduce_scatter_algorithm(torch.zeros(n, dtype=dtype), torch.zeros(1, dtype=dtype)) == "ring"
    assert ring == (rs_algo == "ring" and n > 2)
    tracker = RowTracker("bigram" if hashed else "tok", V, rows_fn=bigram_hash_np if hashed else None,
                         vocab_size=V)
    grad = _local_grad(rank, scenario, n, dtype, hashed, tracker)
    rows, bad = tracker.take()
    assert bad is None
    nz = set(torch.nonzero(grad.abs().sum(1) > 0).view(-1).tolist())
    assert nz <= set(rows.tolist())  # the tracker covers every non-zero gradient row
    ex = SparseRowExchange("tbl", V, D, comm)
    per = ex.rows_per_rank
    # dense path: Comm.reduce_scatter of the zero-padded gradient
    padded = torch.zeros(ex.padded_rows, D, dtype=dtype)
    padded[:V] = grad
    dense = torch.empty(per, D, dtype=dtype)
    comm.reduce_scatter(dense.view(-1), padded.view(-1), op="avg")
    # single-process reference from every rank's (rebuilt) gradient
    allg = [_local_grad(r, scenario, n, dtype, hashed) for r in range(n)]
    ref = dense_reference([torch.cat([g, torch.zeros(ex.padded_rows - V, D, dtype=dtype)]) for g in allg],
                          per, rank, "avg", ring=ring).to(dtype)
    assert torch.equal(dense, ref)
    out = {}
    for mode in ("sparse", "dense", "auto"):
        ledger.reset()
        plan = ex.plan(rows, bad, grad_dtype=dtype, mode=mode)
        o = torch.full((per, D), float("nan"), dtype=dtype)
        h = ex.reduce_scatter(o, grad, plan, op="avg", async_op=True)
        assert h.wait() is o
        assert torch.equal(o, dense), (mode, o, dense)  # bit-equal: same arithmetic order
        st = ex.last_stats
        assert st.mode == plan.mode and st.touched_rows == rows.size
        assert ledger.count(op="all_gather", tag="sparse:tbl:counts") == 1
        cbytes = (n - 1) * n * (n + 4) * 8 // n
        assert ledger.wire_bytes(tag="sparse:tbl:counts") == cbytes
        if plan.mode == "sparse":
            lo, hi = ex.owner_range(rank)
            sent = int(((rows < lo) | (rows >= hi)).sum())
            assert ledger.count(op="all_to_all", tag="sparse:tbl:index") == 1
            assert ledger.count(op="all_to_all", tag="sparse:tbl:rows") == 1
            assert ledger.count(op="reduce_scatter") == 0
            if n > 1:
                assert ledger.wire_bytes(tag="sparse:tbl:index") == sent * 4
                assert ledger.wire_bytes(tag="sparse:tbl:rows") == sent * D * grad.element_size()
            assert st.wire_bytes == ledger.wire_bytes(tag="sparse:tbl")
        else:
            assert ledger.count(op="all_to_all") == 0
            assert ledger.count(op="reduce_scatter", tag="sparse:tbl:dense") == 1
            assert ledger.wire_bytes(tag="sparse:tbl:dense") == (n - 1) * ex.padded_rows * D * grad.element_size() // n
        out[mode] = plan.mode
        # sum works too
        plan = ex.plan(rows, bad, grad_dtype=dtype, mode=mode)
        o2 = torch.empty(per, D, dtype=dtype)
        ex.reduce_scatter(o2, grad, plan, op="sum")
        ref_sum = dense_reference([torch.cat([g, torch.zeros(ex.padded_rows - V, D, dtype=dtype)]) for g in allg],
                                  per, rank, "sum", ring=ring).to(dtype)
        assert torch.equal(o2, ref_sum)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("scenario", ["random", "empty0", "full", "dups", "own_only"])
def test_owner_slice_equals_dense_fp64(world, scenario):
    modes = run_ranks_checked(_owner_slice_matches_dense, world, "float64", scenario, False)
    assert all(m == modes[0] for m in modes)  # the auto choice is identical on all ranks


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rs_algo", [None, "ring"])
def test_owner_slice_equals_dense_fp32_bigram(world, rs_algo):
    """Also with the dense reduce-scatter on the ring (the sharded optimizer's default from 3 ranks): the
    sparse merge adds in the ring's order, so it stays bit-equal to the dense result."""
    modes = run_ranks_checked(_owner_slice_matches_dense, world, "float32", "random", True, rs_algo)
    assert all(m == modes[0] for m in modes)


def run_ranks_checked(fn, world, *args):
    from lowband.testing import run_ranks
    return run_ranks(fn, world, *args)


def _bf16_wire(world: int) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm(name="world", ledger=CommLedger())
    tracker = RowTracker("tok", V)
    grad = _local_grad(rank, "random", n, torch.float32, False, tracker)
    ex = SparseRowExchange("tok", V, D, comm, wire_dtype=torch.bfloat16, mode="sparse")
    rows, bad = tracker.take()
    o = torch.empty(ex.rows_per_rank, D)
    ex.reduce_scatter(o, grad, ex.plan(rows, bad), op="avg")
    padded = torch.zeros(ex.padded_rows, D)
    padded[:V] = grad
    dense = torch.empty(ex.rows_per_rank, D)
    comm.reduce_scatter(dense.view(-1), padded.view(-1), op="avg", wire_dtype=torch.bfloat16)
    assert torch.equal(o, dense)
    assert ex.last_stats.wire_bytes == comm.ledger.wire_bytes(tag="sparse:tok")


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_wire_equals_dense_bf16(world):
    run_ranks_checked(_bf16_wire, world, world)


def _chooser(k: int) -> tuple[str, int, int]:
    """N=2, V=64, d=1, fp32 rows (4 B) + int32 index (4 B): dense RS = 1/2*64*4 = 128 B; counts
    all-gather = 1/2*2*6*8 = 48 B; sparse = 8k + 48 -> sparse iff k < 10."""
    rank = dist.get_rank()
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger)
    ex = SparseRowExchange("t", 64, 1, comm)
    other = 1 - rank
    rows = torch.arange(other * 32, other * 32 + k).numpy()  # k rows, all owned by the other rank
    grad = torch.zeros(64, 1)
    grad[rows] = torch.arange(1, k + 1, dtype=torch.float32).view(-1, 1) * (rank + 1)
    plan = ex.plan(rows)
    assert plan.dense_bytes == 128 and plan.counts_bytes == 48 and plan.sparse_bytes == 8 * k + 48
    out = torch.empty(32, 1)
    ex.reduce_scatter(out, grad, plan, op="sum")
    exp = torch.zeros(32, 1)
    exp[:k] = torch.arange(1, k + 1, dtype=torch.float32).view(-1, 1) * (other + 1)
    assert torch.equal(out, exp)
    return plan.mode, ledger.wire_bytes(tag="sparse:t"), ledger.count(op="all_to_all")


def test_chooser_break_even_two_ranks():
    for k, mode in ((0, "sparse"), (9, "sparse"), (10, "dense"), (11, "dense"), (32, "dense")):
        res = run_ranks_checked(_chooser, 2, k)
        assert res[0] == res[1]
        got_mode, wire, a2a = res[0]
        assert got_mode == mode, (k, got_mode)
        if mode == "sparse":
            assert wire == 8 * k + 48 and a2a == 2
        else:
            assert wire == 128 + 48 and a2a == 0


def _bad_tokens(bad_rank: int) -> tuple[str, int]:
    rank = dist.get_rank()
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger)
    tracker = RowTracker("tok_emb", 320)
    tracker.add(torch.tensor([[1, 2, 3]]))
    if rank == bad_rank:
        tracker.add(torch.tensor([[5, 400, 320, 7]]))
        tracker.add(torch.tensor([[-2, 1]]))
    ex = SparseRowExchange("tok_emb", 320, 2, comm)
    rows, bad = tracker.take()
    try:
        ex.plan(rows, bad)
    except ValueError as e:
        # no row or dense collective ran; only the count all-gather
        return str(e), len(ledger.records)
    return "", len(ledger.records)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_out_of_range_tokens_raise_on_every_rank(world):
    res = run_ranks_checked(_bad_tokens, world, world - 1)
    for msg, nrec in res:
        assert msg == res[0][0] and nrec == 1
        assert "'tok_emb'" in msg and "[0, 320)" in msg and f"rank {world - 1}: ids in [-2, 400]" in msg
