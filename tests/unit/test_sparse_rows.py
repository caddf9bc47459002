"""Single-process pieces of the row-sparse exchange: touched-row tracking, owner ranges, the chooser,
and the 1-rank exchange (torch.distributed not initialized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowband.comm import Comm, CommLedger
from lowband.comm.sparse import (
    RowTracker,
    SparseRowExchange,
    choose_mode,
    owner_bounds,
    padded_rows,
)
from lowband.model.bigram import bigram_hash_np


def test_owner_bounds_pad_to_world():
    assert padded_rows(13, 4) == 16 and padded_rows(12, 4) == 12 and padded_rows(5, 1) == 5
    assert owner_bounds(13, 4).tolist() == [0, 4, 8, 12, 16]
    assert owner_bounds(50_000, 2).tolist() == [0, 25_000, 50_000]


def test_tracker_union_over_microbatches_token_ids():
    t = RowTracker("tok", 10)
    t.add(np.array([[1, 1, 3]]))
    t.add(torch.tensor([[3, 9]]))
    t.add(np.array([[0, 1]], dtype=np.int32))
    rows, bad = t.take()
    assert rows.tolist() == [0, 1, 3, 9] and rows.dtype == np.int64 and bad is None
    rows, bad = t.take()  # take() resets
    assert rows.size == 0 and bad is None


def test_tracker_bigram_hash_matches_model_hash():
    tok = np.array([[5, 7, 5, 7, 300], [1, 2, 3, 4, 5]])
    t = RowTracker("bigram", 1000, rows_fn=bigram_hash_np, vocab_size=320)
    t.add(tok[:1])
    t.add(tok[1:])
    rows, bad = t.take()
    assert bad is None
    assert rows.tolist() == sorted(set(bigram_hash_np(tok, 1000).reshape(-1).tolist()))
    assert 999 in rows.tolist()  # reserved row of position 0


def test_tracker_records_bad_range_instead_of_raising():
    t = RowTracker("tok_emb", 320)
    t.add(np.array([[1, 2]]))
    t.add(np.array([[400, 5, -1]]))
    t.add(np.array([[320]]))
    _rows, bad = t.take()
    assert bad == (-1, 400)
    tb = RowTracker("bigram", 100, rows_fn=bigram_hash_np, vocab_size=50)
    tb.add(np.array([[1, 60]]))
    assert tb.take()[1] == (60, 60)


def test_tracker_bad_arguments():
    with pytest.raises(TypeError, match="rows_fn must be callable or None, got str"):
        RowTracker("x", 10, rows_fn="md5")
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        RowTracker("x", 0)
    with pytest.raises(TypeError, match="tokens must be integers"):
        RowTracker("x", 10).add(np.array([1.5]))


def test_choose_mode_break_even():
    # 2 ranks; rank r sends counts[r, 1-r] rows of 4 + 4 bytes; dense 128 B; counts 48 B
    for k, expect in ((0, "sparse"), (9, "sparse"), (10, "dense"), (20, "dense")):
        counts = np.array([[3, k], [k // 2, 5]])
        mode, sparse = choose_mode(counts, row_bytes=4, index_bytes=4, counts_bytes=48, dense_bytes=128)
        assert sparse == 8 * k + 48 and mode == expect
    assert choose_mode(np.array([[0, 50], [0, 0]]), row_bytes=4, index_bytes=4, counts_bytes=0,
                       dense_bytes=1, mode="sparse")[0] == "sparse"
    assert choose_mode(np.zeros((2, 2)), row_bytes=4, index_bytes=4, counts_bytes=0, dense_bytes=1,
                       mode="dense")[0] == "dense"
    with pytest.raises(ValueError, match="allowed: \\['auto', 'sparse', 'dense'\\]"):
        choose_mode(np.zeros((2, 2)), row_bytes=4, index_bytes=4, counts_bytes=0, dense_bytes=1, mode="x")


@pytest.mark.parametrize("mode", ["sparse", "dense", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_rank_exchange_is_identity(mode, dtype):
    ledger = CommLedger()
    ex = SparseRowExchange("tok", 7, 3, Comm(ledger=ledger), mode=mode)
    grad = torch.zeros(7, 3, dtype=dtype)
    grad[[1, 4]] = torch.randn(2, 3, dtype=dtype)
    plan = ex.plan(np.array([1, 4]), grad_dtype=dtype)
    out = torch.empty(7, 3, dtype=dtype)
    ex.reduce_scatter(out, grad, plan, op="avg")
    assert torch.equal(out, grad)
    assert ledger.wire_bytes() == 0 and ex.last_stats.wire_bytes == 0
    assert ex.last_stats.density == pytest.approx(2 / 7)
    assert plan.mode == ("dense" if mode == "auto" else mode)  # 1 rank: a local copy is cheapest


def test_exchange_bad_arguments():
    comm = Comm(ledger=CommLedger())
    with pytest.raises(ValueError, match="mode='fast' is not allowed"):
        SparseRowExchange("t", 8, 2, comm, mode="fast")
    with pytest.raises(ValueError, match="index_dtype"):
        SparseRowExchange("t", 8, 2, comm, index_dtype=torch.int16)
    # int32 holds indices up to 2**31 - 1: a taller table would wrap them onto other rows
    assert SparseRowExchange("t", 2**31, 2, comm, index_dtype=torch.int32).index_dtype == torch.int32
    assert SparseRowExchange("t", 2**31 + 1, 2, comm).index_dtype == torch.int64
    with pytest.raises(ValueError, match=r"index_dtype=torch.int32 cannot hold .* 2147483649 rows"):
        SparseRowExchange("t", 2**31 + 1, 2, comm, index_dtype=torch.int32)
    ex = SparseRowExchange("t", 8, 2, comm)
    plan = ex.plan(np.array([0]))
    with pytest.raises(ValueError, match="grad has shape"):
        ex.reduce_scatter(torch.empty(8, 2), torch.zeros(9, 2), plan)
    with pytest.raises(ValueError, match="op 'max'"):
        ex.reduce_scatter(torch.empty(8, 2), torch.zeros(8, 2), plan, op="max")
    with pytest.raises(ValueError, match="sparse table 't': token ids out of range \\[0, 8\\)"):
        ex.plan(np.array([3, 9]))


# ------------------------------------------------------------------ tables for any model, from its plan
def test_comm_does_not_import_model_and_a_bigram_table_rows_by_the_models_hash():
    import subprocess
    import sys

    code = ("import sys, lowband.comm.sparse; "
            "bad = [m for m in sys.modules if m.startswith('lowband.model')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    import lowband.model as model_pkg
    from lowband.optim.sparse_rows import HASHES, SparseTable, SparseTableUnit

    assert HASHES == {"none": None, "bigram": model_pkg.bigram_hash_np}
    table = SparseTable("bigram", torch.zeros(7, 2), hash="bigram")
    unit = SparseTableUnit(table, Comm(None), count_comm=None, mode="auto", wire_dtype=None)
    unit.observe(np.array([[3, 5, 6]]))
    assert unit.tracker.take()[0].tolist() == sorted(set(bigram_hash_np(np.array([[3, 5, 6]]), 7).ravel().tolist()))


def test_sparse_tables_from_plan_and_by_path():
    from lowband.model import GPT, GPTConfig
    from lowband.optim.sparse_rows import sparse_table_for, sparse_tables_from_plan
    from tests.external.outside_gpt import OutsideConfig, OutsideGPT, outside_plan

    gpt = GPT(GPTConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=2, n_embd=8, bigram_rows=7))
    tables = sparse_tables_from_plan(gpt)  # the plan GPT ships: tok_emb (ids) and bigram (hash)
    assert [(t.name, t.hash, t.vocab_size) for t in tables] == [("tok_emb", "none", 16), ("bigram", "bigram", 16)]
    assert tables[1].param is gpt.bigram.weight
    with pytest.raises(ValueError, match=r"sparse.tables: the model plan has no sparse table 'x'; it has "
                                         r"\['tok_emb', 'bigram'\]"):
        sparse_tables_from_plan(gpt, ["x"], where="sparse.tables")
    untied = OutsideGPT(OutsideConfig(tie=False))
    (t,) = sparse_tables_from_plan(untied, ["wte"], plan=outside_plan(untied))
    assert t.param is untied.transformer.wte.weight and t.vocab_size == 96
    assert sparse_table_for(untied, "transformer.wpe.weight").name == "transformer.wpe.weight"
    with pytest.raises(ValueError, match=r"has no parameter 'nope\.weight'"):
        sparse_table_for(untied, "nope.weight")
    tied = OutsideGPT(OutsideConfig(tie=True))
    for call in (lambda: sparse_tables_from_plan(tied, plan=outside_plan(tied)),
                 lambda: sparse_table_for(tied, "lm_head.weight")):
        with pytest.raises(ValueError, match=r"is tied to \[.*\]: the other use's gradient touches rows"):
            call()
