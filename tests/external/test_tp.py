"""Tensor parallelism from a model plan on an outside-style GPT (tests/external/outside_gpt.py), 2 and 4
gloo ranks, against the single-process reference (tests/external/parallel_ref.py).

A user's script: per-rank seeds, ``shard_tp(model, outside_plan(model), mesh.tp, sync_comm=world)``
(c_attn column-parallel in 3 sections of whole heads, c_proj row-parallel, c_fc column, mlp c_proj
row; every linear with a bias), ``TPInputGather`` so a TP group computes on its ranks' union, the DP
gradient average across TP groups, ``lowband.parallel.clip_grad_norm_``, torch AdamW on the slices.
OutsideGPT has 2 heads, so TP 2 is the largest the plan allows: 2 ranks run TP 2, 4 ranks TP 2 x DP 2,
and TP 4 is refused by the plan.

Tolerances: as in tests/external/test_gtp.py. The reference computes one float32 cross-entropy per
data lane (a TP group is one lane) like the TP run; the remaining differences are float64 sums in
other orders (the row-parallel all-reduce of partial products, the column-parallel dX all-reduce,
the norm's partial sums): relative O(k eps64) per step, k <= 10^3, so the project's float64 bound
1e-10 holds with a wide margin; the norm to 1e-12 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, default_ledger
from lowband.optim.tp_state import TPStateLayout, full_state
from lowband.parallel import (
    TPInputGather,
    TPStateError,
    clip_grad_norm_,
    shard_tp,
    unsharded_copy,
)
from lowband.parallel.gtp import reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.plan import ModelPlan, ParallelLinear
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model
from tests.external.parallel_ref import BATCH, LR, SEED, WD, lanes_of, reference_run, reference_step

TOL = 1e-10
STEPS = 4
MAX_NORM = 0.05
TP = 2


def _build(tie: bool, *, init_sync: bool = True, plan: ModelPlan | None = None):
    cfg = OutsideConfig(tie=tie)
    model = seeded_model(SEED, dist.get_rank(), cfg, torch.float64)
    mesh = build_mesh(tp=TP)
    shard_tp(model, plan or outside_plan(model), mesh.tp, init_sync=init_sync, sync_comm=Comm())
    return cfg, model, mesh


def _train(model, mesh, opt, cfg, steps) -> tuple[dict, dict]:
    wrapped = TPInputGather(model, mesh.tp)
    losses, norms = {}, {}
    for step in steps:
        x, y = random_batch(step, dist.get_rank(), BATCH, cfg)
        _, loss = wrapped(x, y)
        loss.backward()
        if mesh.dp.size > 1:
            reduce_grads(mesh.dp, model.parameters(), "avg", tag="grad")
        norms[step] = float(clip_grad_norm_(model, MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = float(loss.detach())
    return losses, norms


def _parity(tie: bool) -> dict:
    ledger = default_ledger()
    cfg, model, mesh = _build(tie)
    kinds = {name: type(model.get_submodule(name)).__name__ for name in
             ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.1.mlp.c_fc",
              "transformer.h.1.mlp.c_proj", "lm_head")}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = _train(model, mesh, opt, cfg, range(1, STEPS + 1))
    plain = unsharded_copy(model)
    return {"losses": losses, "norms": norms, "kinds": kinds,
            "tied": model.lm_head.weight is model.transformer.wte.weight,
            "params": {n: p.detach().clone() for n, p in plain.named_parameters()},
            "syncs": len(ledger.select(op="broadcast", tag="init_sync")),
            "norm_allreduces": ledger.count(op="all_reduce", tag="tp:norm")}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_outside_gpt_equals_single_process(world: int, tie: bool) -> None:
    res = run_ranks(_parity, world, tie)
    ref = reference_run(OutsideConfig(tie=tie), lanes_of(world, TP), STEPS, MAX_NORM)
    for r in range(world):
        got = res[r]
        assert got["kinds"] == {"transformer.h.0.attn.c_attn": "ColumnParallelLinear",
                                "transformer.h.0.attn.c_proj": "RowParallelLinear",
                                "transformer.h.1.mlp.c_fc": "ColumnParallelLinear",
                                "transformer.h.1.mlp.c_proj": "RowParallelLinear", "lm_head": "Linear"}
        assert got["tied"] is tie
        assert got["syncs"] == 1 and got["norm_allreduces"] == STEPS
        for s in range(1, STEPS + 1):
            assert got["norms"][s] > MAX_NORM
            assert got["norms"][s] == pytest.approx(ref["norms"][s], rel=1e-12, abs=0)
            assert got["losses"][s] == pytest.approx(ref["losses"][s][r // TP], rel=TOL, abs=0)
        assert got["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=0, atol=TOL, msg=k)


def _plan_refuses(_: int) -> str:
    cfg = OutsideConfig()
    model = seeded_model(SEED, dist.get_rank(), cfg, torch.float64)
    mesh = build_mesh(tp=dist.get_world_size())
    try:
        shard_tp(model, outside_plan(model), mesh.tp)
    except ValueError as e:
        assert not default_ledger().records
        return str(e)
    return "no error"


def test_tp_larger_than_the_plan_allows_is_refused_on_every_rank() -> None:
    msgs = run_ranks(_plan_refuses, 4, 0)
    assert len(set(msgs)) == 1 and "n_head (2) must be divisible by the TP size 4" in msgs[0]


def _tied_plan(_: int) -> str:
    model = seeded_model(SEED, dist.get_rank(), OutsideConfig(tie=True), torch.float64)
    plan = outside_plan(model)
    plan = ModelPlan(parallel_linears=(*plan.parallel_linears, ParallelLinear("lm_head", "column")),
                     tp_divisors=plan.tp_divisors)
    try:
        shard_tp(model, plan, build_mesh(tp=TP).tp)
    except ValueError as e:
        assert not default_ledger().records
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2, 4])
def test_a_tied_linear_in_the_plan_is_refused_by_name(world: int) -> None:
    msgs = run_ranks(_tied_plan, world, 0)
    assert len(set(msgs)) == 1 and "lm_head.weight is tied to ['transformer.wte.weight']" in msgs[0]


def _seed_trap(_: int) -> str:
    try:
        _build(True, init_sync=False)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_seeds_without_init_sync_raise_on_every_rank(world: int) -> None:
    msgs = run_ranks(_seed_trap, world, 0)
    assert len(set(msgs)) == 1 and "initial weights differ" in msgs[0]


def _rank0_eval(_: int) -> dict:
    cfg, model, _mesh = _build(True)
    plain = unsharded_copy(model)
    out = {"kinds": sorted({type(m).__name__ for m in plain.modules()}
                           & {"ColumnParallelLinear", "RowParallelLinear", "Linear"})}
    if dist.get_rank() == 0:
        x, y = random_batch(5, 0, BATCH, cfg)
        before = len(default_ledger().records)
        with torch.no_grad():
            alone = plain(x, y)[0]
            ref = seeded_model(SEED, 0, cfg, torch.float64)(x, y)[0]
        out["equal"] = torch.equal(alone, ref)  # the copy is rank 0's initial model, bit for bit
        out["collectives"] = len(default_ledger().records) - before
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_rank0_evaluation_through_unsharded_copy(world: int) -> None:
    res = run_ranks(_rank0_eval, world, 0)
    assert all(r["kinds"] == ["Linear"] for r in res)
    assert res[0]["equal"] and res[0]["collectives"] == 0


def _dcp_save(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cfg, model, mesh = _build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _train(model, mesh, opt, cfg, range(1, 3))
    try:
        get_state_dict(model, opt)
        refused = ""
    except TPStateError as e:
        refused = str(e)
    layout = TPStateLayout(model, opt, mesh.tp.size, mesh.dp.size)
    sd = layout.state_dict()
    dcp.save(sd, checkpoint_id=path)
    return {"refused": refused, "full": full_state(sd, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)}


def _dcp_load(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    cfg, model, mesh = _build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    layout = TPStateLayout(model, opt, mesh.tp.size, mesh.dp.size)
    sd = layout.state_dict()
    dcp.load(sd, checkpoint_id=path)
    layout.load_state_dict(sd)
    full = full_state(layout.state_dict(), lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
    losses, _ = _train(model, mesh, opt, cfg, range(3, 5))
    return {"full": full, "losses": losses,
            "params": {n: p.detach().clone() for n, p in unsharded_copy(model).named_parameters()}}


@pytest.mark.parametrize(("saved", "new"), [(2, 4), (4, 2)])
def test_dcp_checkpoint_saves_resumes_and_reshards(tmp_path: Path, saved: int, new: int) -> None:
    """TP 2 x DP 1 <-> TP 2 x DP 2 (the DP degree changes; TP-size resharding of the same layout is
    covered for the reference GPT by tests/distributed/test_checkpoint_tp.py)."""
    path = str(tmp_path / "ckpt")
    out = run_ranks(_dcp_save, saved, path)
    assert all("TPStateLayout" in o["refused"] for o in out)
    back = run_ranks(_dcp_load, new, path)
    for r in range(new):
        assert back[r]["full"].keys() == out[0]["full"].keys()
        for k, v in out[0]["full"].items():
            got = back[r]["full"][k]
            assert (torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v), k
    # continue 2 steps at the new size == the single-process reference resumed from the saved state
    ref = reference_run(OutsideConfig(tie=True), lanes_of(saved, TP), 2, MAX_NORM)
    model, opt = ref["model"], ref["opt"]
    for k, v in ref["params"].items():
        # sectioned tensors (c_attn: q|k|v) are stored as (sections, rows / sections, ...) in canonical order
        torch.testing.assert_close(out[0]["full"][f"model.{k}"].reshape(v.shape), v, rtol=0, atol=TOL, msg=k)
    cfg = OutsideConfig(tie=True)
    losses = {}
    for step in (3, 4):
        losses[step] = reference_step(model, step, lanes_of(new, TP), cfg)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in range(new):
        for s in (3, 4):
            assert back[r]["losses"][s] == pytest.approx(losses[s][r // TP], rel=TOL, abs=0)
        for k, p in model.named_parameters():
            torch.testing.assert_close(back[r]["params"][k], p.detach(), rtol=0, atol=TOL, msg=k)
