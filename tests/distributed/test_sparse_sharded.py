"""Sharded AdamW with the bigram and token tables as row-sparse units, on 1, 2 and 4 gloo ranks:
parameters after 5 steps (3 accumulated microbatches each) equal the dense sharded path and a
single-process AdamW; ledger counts and bytes of the sparse exchange."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger
from lowband.model import GPT, GPTConfig
from lowband.optim import ShardedAdamW
from lowband.optim.sparse_rows import sparse_tables_from_plan
from lowband.testing import run_ranks

VOCAB, ROWS, SEQ, MB, ACCUM, STEPS = 16, 37, 6, 2, 3, 5
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(dtype: torch.dtype) -> GPT:
    torch.manual_seed(5)
    m = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, n_embd=8, bigram_rows=ROWS))
    with torch.no_grad():
        m.bigram.weight.normal_(0, 0.02)
    return m.to(dtype)


def _tokens(step: int, n: int, vocab: int = VOCAB) -> torch.Tensor:
    """Global batch of one step: ``ACCUM x N x MB`` sequences; only a few token ids so rows repeat."""
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, 5, (ACCUM, n, MB, SEQ + 1), generator=g) * 3 % vocab


def _train(dtype: torch.dtype, variant: str) -> tuple[dict[str, torch.Tensor], CommLedger]:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(dtype)
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger)
    kw = {}
    if variant != "dense":
        mode = "sparse" if variant.startswith("sparse") else "dense" if variant == "table-dense" else "auto"
        kw = dict(sparse_tables=sparse_tables_from_plan(model, ["bigram", "tok_emb"]), sparse_mode=mode)
    opt = ShardedAdamW(model.parameters(), comm=comm, bucket_mb=1e-3, **HP, **kw)
    for step in range(STEPS):
        tok = _tokens(step, n)
        mine = tok[:, rank]
        if variant in ("sparse", "auto"):  # the trainer's path: host tokens before forward
            opt.observe_tokens(mine[..., :-1])
            opt.plan_sparse()
        elif variant == "sparse-from-grad":
            opt.plan_sparse()  # nothing observed: no-op; the launch reads the rows from the gradient
        for m in range(ACCUM):
            x, y = mine[m, :, :-1], mine[m, :, 1:]
            if m < ACCUM - 1:
                with opt.no_sync():
                    (model(x, y) / ACCUM).backward()
            else:
                (model(x, y) / ACCUM).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, ledger, opt


def _reference(dtype: torch.dtype, n: int) -> dict[str, torch.Tensor]:
    model = _model(dtype)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    for step in range(STEPS):
        tok = _tokens(step, n)
        for m in range(ACCUM):
            for r in range(n):
                x, y = tok[m, r, :, :-1], tok[m, r, :, 1:]
                (model(x, y) / (ACCUM * n)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _sparse_equals_dense(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    n = dist.get_world_size()
    dense, _, _ = _train(dtype, "dense")
    # The tables' dense reduce-scatter (same row ownership as the sparse exchange) is the bitwise reference.
    # Up to 2 ranks every reduce-scatter sums in rank order, so it also equals the plain dense path (tables in
    # ordinary units) bitwise; from 3 ranks the sharded optimizer's reduce-scatter is the ring, which sums
    # each element from the rank after its owner around to the owner, so elements owned by another rank in
    # the plain layout are added in another order: within the reference bound below, not bitwise.
    table_dense, _, _ = _train(dtype, "table-dense")
    for k in dense:
        if n <= 2:
            assert torch.equal(table_dense[k], dense[k]), (k, (table_dense[k] - dense[k]).abs().max())
    out = {}
    for variant in ("sparse", "sparse-from-grad", "auto"):
        got, ledger, opt = _train(dtype, variant)
        for k in dense:
            assert torch.equal(got[k], table_dense[k]), (variant, k, (got[k] - table_dense[k]).abs().max())
        # one count all-gather per table per step; the table unit never uses the dense grad RS
        assert ledger.count(op="all_gather", tag="sparse:bigram:counts") == STEPS
        assert ledger.count(op="all_gather", tag="sparse:tok_emb:counts") == STEPS
        assert ledger.count(op="reduce_scatter", tag="grad") == (len(opt.units) - 2) * STEPS
        stats = opt.sparse_stats()
        assert set(stats) == {"bigram", "tok_emb"}
        if variant.startswith("sparse"):
            assert ledger.count(op="all_to_all", tag="sparse:bigram:rows") == STEPS
            assert ledger.count(op="reduce_scatter", tag="sparse") == 0
            st = stats["bigram"]
            assert st.mode == "sparse" and 0 < st.density <= 1
            # last step's bytes: rows not owned x (8 floats + int32 index)
            tab = opt.sparse_units["bigram"].exchange
            lo, hi = tab.owner_range(dist.get_rank())
            tok = _tokens(STEPS - 1, n)[:, dist.get_rank(), :, :-1]
            from lowband.model.bigram import bigram_hash_np
            rows = set(bigram_hash_np(tok.numpy(), ROWS).reshape(-1).tolist())
            sent = sum(1 for r in rows if not lo <= r < hi)
            last_rows = ledger.select(op="all_to_all", tag="sparse:bigram:rows")[-1]
            last_idx = ledger.select(op="all_to_all", tag="sparse:bigram:index")[-1]
            if n > 1:
                assert last_rows.wire_bytes == sent * 8 * torch.empty((), dtype=dtype).element_size()
                assert last_idx.wire_bytes == sent * 4
            assert st.touched_rows == len(rows)
        out[variant] = stats["bigram"].mode
    ref = _reference(dtype, n)
    # different summation orders of the same gradient terms (ACCUM * N * MB * SEQ token contributions
    # per element) for STEPS AdamW steps (scale-invariant update, lr 1e-2 < |p|): the error is at most
    # STEPS * terms * u of the dtype (see test_sharded_adamw.fp32_param_bound); float64 well inside 1e-10
    terms = ACCUM * n * MB * SEQ
    tol = 1e-10 if dtype == torch.float64 else STEPS * terms * 2.0**-24
    for k in ref:
        torch.testing.assert_close(dense[k], ref[k], rtol=tol, atol=tol)
        torch.testing.assert_close(table_dense[k], ref[k], rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sparse_tables_equal_dense_fp64(world):
    res = run_ranks(_sparse_equals_dense, world, "float64")
    assert all(r == res[0] for r in res)


def test_sparse_tables_equal_dense_fp32_two_ranks():
    run_ranks(_sparse_equals_dense, 2, "float32")


def _bad_token(bad_rank: int) -> str:
    rank = dist.get_rank()
    model = _model(torch.float32)
    ledger = CommLedger()
    opt = ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), bucket_mb=1e-3, **HP,
                       sparse_tables=sparse_tables_from_plan(model, ["bigram"]))
    n_before = len(ledger.records)
    tok = torch.tensor([[1, 2, 3]]) if rank != bad_rank else torch.tensor([[1, VOCAB + 4, 3]])
    opt.observe_tokens(tok)
    try:
        opt.plan_sparse()
    except ValueError as e:
        assert len(ledger.records) == n_before + 1  # only the count all-gather ran
        return str(e)
    return ""


@pytest.mark.parametrize("world", [1, 2])
def test_bad_token_raises_on_every_rank(world):
    msgs = run_ranks(_bad_token, world, world - 1)
    assert all(m == msgs[0] for m in msgs)
    assert "'bigram'" in msgs[0] and f"[0, {VOCAB})" in msgs[0] and f"rank {world - 1}: ids in [20, 20]" in msgs[0]


# ------------------------------------------------------------------------------------------ trainer
def _train_cfg(cfg) -> dict:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False)
    return {"params": {k: v.detach().clone() for k, v in res.strategy.unwrapped().state_dict().items()},
            "extras": [r["extras"] for r in res.rows if "loss" in r], "wire": [r["wire_bytes"] for r in res.rows
                                                                          if "loss" in r]}


def test_trainer_sparse_bigram_equals_dense(tmp_path):
    """sharded-adamw on 2 ranks with ``sparse_embeddings = ["bigram"]`` (2 microbatches) trains to the
    same parameters as without it; the log extras carry the table's mode, MB and density."""
    import numpy as np

    from lowband.data import write_shard
    from lowband.train.config import Config

    shard = str(write_shard(tmp_path / "train.bin", np.random.default_rng(0).integers(0, 320, 20_000)))

    def cfg(sparse: bool) -> Config:
        c = Config()
        c.run.world_size, c.run.steps, c.run.dtype = 2, 3, "float64"
        c.run.val_every, c.run.val_batches, c.run.log_every, c.run.threads = 0, 1, 1, 1
        c.model.n_layer, c.model.n_embd, c.model.n_head, c.model.seq_len, c.model.bigram_rows = 1, 16, 2, 8, 500
        c.data.source, c.data.train_bin, c.data.batch_size, c.data.grad_accum = "bin", shard, 4, 2
        c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.optim.grad_clip = 1e-2, 0, 0.1, 0.0
        c.strategy.name = "sharded-adamw"
        if sparse:
            c.sparse.tables, c.sparse.mode = ["bigram"], "sparse"
        return c

    dense = run_ranks(_train_cfg, 2, cfg(False))
    sparse = run_ranks(_train_cfg, 2, cfg(True))
    for d, s in zip(dense, sparse, strict=True):
        for k in d["params"]:
            torch.testing.assert_close(s["params"][k], d["params"][k], rtol=1e-12, atol=1e-12)
        ex = s["extras"][-1]
        assert ex["bigram_density"] > 0 and ex["bigram_mb"] > 0 and ex["bigram_mode"] == "sparse"
        assert all(w_s < w_d for w_s, w_d in zip(s["wire"], d["wire"], strict=True))


# -------------------------------------------------------------------------------------------- bench
def test_bench_sparse_suite_bytes(tmp_path):
    """``python -m lowband.bench sparse`` (tiny): the table's bytes obey the acceptance bound, the dense
    contender moves exactly the dense reduce-scatter (+ counts), and the JSON has the shared keys."""
    import json

    from lowband.bench.__main__ import main

    out = tmp_path / "sparse.json"
    assert main(["sparse", "--world", "2", "--repeats", "2", "--warmup", "1", "--out", str(out), "--n-layer", "1",
                 "--n-embd", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "2", "--bigram-rows", "3000",
                 "--data", "random"]) == 0
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["results"]}
    assert set(rows) == {"dense", "sparse", "auto"}
    counts = 1 * 2 * 6 * 8 // 2
    assert rows["dense"]["table_dense_bytes"] == 3000 * 16 * 4 // 2
    assert rows["dense"]["table_wire_bytes"] == 3000 * 16 * 4 // 2 + counts and rows["dense"]["modes"] == ["dense"]
    for name in ("sparse", "auto"):
        r = rows[name]
        assert r["modes"] == ["sparse"] and 0 < r["touched_fraction"] < 0.05
        assert r["table_bytes_ratio"] <= r["table_bytes_bound"]
        assert r["wire_bytes_per_step_per_rank"] < rows["dense"]["wire_bytes_per_step_per_rank"]
        assert "dense" in r["ratio_vs"]
