"""Sharded Muon (+ AdamW for embeddings, head and 1-D params) on 1, 2 and 4 gloo ranks against the
single-process :class:`lowband.optim.Muon` + ``torch.optim.AdamW`` on the concatenated global batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lowband.optim import ShardedMuon, split_params_for_muon
from lowband.optim.buckets import matrix_cost
from lowband.testing import run_ranks
from tests.distributed.test_sharded_adamw import (
    BATCH,
    DIM,
    HID,
    MUON_KW,
    TinyModel,
    batch,
    check_ledger,
    loss_fn,
    lr_lambda,
    train_and_compare,
)

# the Muon matrices of TinyModel (frozen excluded): l1 8x6, l2..l4 8x8, l5 6x8
MUON_SHAPES = [(8, 6), (8, 8), (8, 8), (8, 8), (6, 8)]
N_ADAMW_PARAMS = 8  # embed, head, 5 biases, unused


def _muon_state_bytes(units: list, rank: int, acc: int) -> int:
    return sum(real[rank] * shape[0] * shape[1] * acc for kind, _, _, shape, real in units if kind == "muon")


def _adamw_state_bytes(units: list, n: int, acc: int, never_used: list[int] = ()) -> int:
    return sum(2 * numel // n * acc for ui, (kind, numel, *_) in enumerate(units)
               if kind == "adamw" and ui not in never_used)


def _check_muon_layout(res: list[dict], world: int) -> None:
    units = res[0]["units"]
    muon = [u for u in units if u[0] == "muon"]
    # every real matrix appears once, pads < N per unit, all ranks own whole matrices
    assert sum(sum(real) for *_, real in muon) == len(MUON_SHAPES)
    for _, numel, shard, (rows, cols), real in muon:
        assert numel % (world * rows * cols) == 0
        c = shard // (rows * cols)
        assert all(c - 1 <= x <= c for x in real)
    # balanced by cost over shape groups: per-rank load differs by at most one matrix's cost
    loads = [sum(real[r] * matrix_cost(*shape) for *_, shape, real in muon) for r in range(world)]
    assert max(loads) - min(loads) <= max(matrix_cost(*s) for s in MUON_SHAPES), loads
    for r in res:
        assert r["units"] == units
        assert r["state_bytes"] == _muon_state_bytes(units, r["rank"], 8) + _adamw_state_bytes(
            units, world, 8, r["never_used_units"])
    # summed over ranks the momentum is exactly one copy of the Muon matrices
    total = sum(_muon_state_bytes(units, r, 8) for r in range(world))
    assert total == sum(a * b for a, b in MUON_SHAPES) * 8


@pytest.mark.parametrize("world", [1, 2, 4])
def test_muon_fp64_matches_reference(world: int) -> None:
    """NS5 in float64; groups of 1 and 3 same-shape matrices (padded to N), a tall and a wide shape,
    frozen + unused params, 3 microbatches, clipping, LambdaLR; 5 steps; 1e-10."""
    cfg = dict(algo="muon", dtype="float64", ns_dtype="float64", bucket_mb=25.0, micro=3, clip=0.05, steps=5)
    res = run_ranks(train_and_compare, world, cfg)
    for r in res:
        assert r["param_err"] < 1e-10, r["param_err"]
        assert r["state_err"] < 1e-10, r["state_err"]
        assert r["n_state_tensors"] == len(MUON_SHAPES) + 2 * (N_ADAMW_PARAMS - 1)  # ``unused`` has none
        assert r["frozen_unchanged"]
        for a, b in zip(r["norms"], r["ref_norms"]):
            assert abs(a - b) <= 1e-12 * b
    check_ledger(res, "float64", None, clip=True)
    _check_muon_layout(res, world)


@pytest.mark.parametrize("world", [2, 4])
def test_muon_small_buckets_polar_express(world: int) -> None:
    """Bucket cap smaller than one 8x8 group: a shape group splits into several units; Polar Express."""
    cfg = dict(algo="muon", dtype="float64", ns_dtype="float64", ns_method="polar_express",
               bucket_mb=600 / 2**20, micro=1, clip=None, steps=5)
    res = run_ranks(train_and_compare, world, cfg)
    for r in res:
        assert r["param_err"] < 1e-10, r["param_err"]
    check_ledger(res, "float64", None, clip=False)
    _check_muon_layout(res, world)


@pytest.mark.parametrize("world", [2, 4])
def test_muon_fp32_bf16_ns_and_bf16_wire(world: int) -> None:
    """Default precision (fp32 params, NS in bf16): matches the single-process Muon with bf16 NS; with
    bf16 gradients the wire bytes of the reduce-scatters halve."""
    cfg = dict(algo="muon", dtype="float32", ns_dtype="bfloat16", bucket_mb=25.0, micro=1, clip=0.05, steps=5)
    res = run_ranks(train_and_compare, world, cfg)
    for r in res:
        # bf16 Newton-Schulz: batched (owner) vs one-at-a-time (reference) bf16 matmuls may round
        # differently. Each Muon step moves W by lr_t * sqrt(max(1, rows/cols)) * O with |O_ij| <= 1
        # (orthogonal), and O's two computations differ by at most bf16's relative rounding 2^-8 per
        # element and per side: |dW| <= 2 * 2^-8 * sqrt(8/6) * sum_t lr_t (the 8x6 matrix has the
        # largest shape scale; AdamW parameters are fp32 and far inside it).
        bound = 2 * 2.0**-8 * math.sqrt(HID / DIM) * sum(MUON_KW["lr"] * lr_lambda(t) for t in range(cfg["steps"]))
        assert r["param_abs_err"] < bound, (r["param_abs_err"], bound)
    check_ledger(res, "float32", None, clip=True)
    res16 = run_ranks(train_and_compare, world, dict(cfg, wire="bfloat16"))
    check_ledger(res16, "float32", "bfloat16", clip=True)
    assert 2 * sum(b for *_, b in res16[0]["steps"][0]["rs"]) == sum(b for *_, b in res[0]["steps"][0]["rs"])


def _muon_resume(full_state: dict | None, params: list | None, steps: tuple[int, int]) -> dict:
    torch.set_default_dtype(torch.float64)
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyModel()
    if params is not None:
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
    muon, adam = split_params_for_muon(model)
    opt = ShardedMuon(muon, adam, lr=0.03, momentum=0.9, ns_dtype=torch.float64, adamw_lr=1e-2)
    if full_state is not None:
        opt.load_full_state_dict(full_state)
    for step in range(*steps):
        idx, tgt = batch(step)
        rows = BATCH // n
        loss_fn(model, idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "full": opt.full_state_dict()}


def test_muon_full_state_reshards_4_to_2() -> None:
    """2 steps on 4 ranks, full state to 2 ranks, 2 more == 4 steps straight on 1 rank."""
    first = run_ranks(_muon_resume, 4, None, None, (0, 2))
    second = run_ranks(_muon_resume, 2, first[0]["full"], first[0]["params"], (2, 4))
    straight = run_ranks(_muon_resume, 1, None, None, (0, 4))
    for p, q in zip(second[0]["params"], straight[0]["params"]):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)
    for i, st in straight[0]["full"]["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(second[1]["full"]["state"][i][k], v, rtol=1e-10, atol=1e-10)
