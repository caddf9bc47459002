"""Issue 27 for GTP: a user's DDP-script habits on the outside-style GPT (tests/external/outside_gpt.py),
2 and 4 gloo ranks, float64, against the single-process equivalent of DDP + torch running the same habit
(tests/external/parallel_ref.py: one loss per rank, gradients averaged over ranks, as DDP does).

Each cell is exact (1e-10, the project's float64 bound; see tests/external/test_gtp.py for why the
orderings of the float64 sums stay far below it) with every rank bitwise equal, or refused on every rank
with one line naming the habit and the lowband way.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lowband.comm import default_ledger
from lowband.parallel import (
    GTPCollectiveError,
    GTPOptions,
    GTPRuntime,
    GTPStateError,
    shard_embeddings,
    shard_linears,
    sync_replicated_grads,
    unsharded_copy,
)
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, random_batch, seeded_model
from tests.external.parallel_ref import BATCH, LR, SEED, WD

TOL = 1e-10
STEPS = 3
ACCUM = 2
EMA = 0.9


def _model(cfg: OutsideConfig, dtype: torch.dtype = torch.float64):
    return seeded_model(SEED, dist.get_rank(), cfg, dtype)


def _shard(model, **opts) -> GTPRuntime:
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp, GTPOptions(**opts))
    shard_embeddings(model, rt)
    shard_linears(model, rt)
    return rt


def _logical(model) -> dict[str, torch.Tensor]:
    plain = unsharded_copy(model)  # collective, every rank
    return {n: p.detach().clone() for n, p in plain.named_parameters()}


def _micro(step: int, m: int) -> int:
    return 10 * step + m


def _gtp_run(habit: str, world: int, tie: bool) -> dict:
    """The user's script with one habit: no lowband gradient call anywhere (GTP reduces in backward)."""
    cfg = OutsideConfig(tie=tie)
    model = _model(cfg)
    if habit == "opt_before_shard":  # nanoGPT's order: configure_optimizers, then shard
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        rt = _shard(model)
    else:
        rt = _shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ema = copy.deepcopy(model) if habit == "ema" else None
    rank = dist.get_rank()
    accum = ACCUM if habit in ("accum", "accum_no_sync", "accum_sync_call") else 1
    for step in range(1, STEPS + 1):
        for m in range(accum):
            x, y = random_batch(_micro(step, m), rank, BATCH, cfg)
            ctx = rt.no_sync() if habit == "accum_no_sync" and m < accum - 1 else _null()
            with ctx:
                _, loss = model(x, y)
                (loss / accum).backward()
        if habit == "accum_sync_call":
            before = len(default_ledger().records)
            sync_replicated_grads(rt, model)  # the old call: a no-op now (nothing sent, nothing averaged twice)
            assert len(default_ledger().records) == before
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.lerp_(p, 1 - EMA)
    out = {"params": _logical(model)}
    if ema is not None:
        x, _ = random_batch(99, 0, BATCH, cfg)
        with torch.no_grad():
            out["ema_logits"] = ema(x)[0].clone()  # every rank: the copy gathers its own shards
        out["ema"] = _logical(ema)
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _reference(habit: str, world: int, tie: bool) -> dict:
    """DDP + torch, single process: per micro-batch, every rank's loss / (accum * world) backward."""
    cfg = OutsideConfig(tie=tie)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ema = copy.deepcopy(model)
    accum = ACCUM if habit.startswith("accum") else 1
    for step in range(1, STEPS + 1):
        for m in range(accum):
            for r in range(world):
                x, y = random_batch(_micro(step, m), r, BATCH, cfg)
                (model(x, y)[1] / (accum * world)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(p, 1 - EMA)
    x, _ = random_batch(99, 0, BATCH, cfg)
    with torch.no_grad():
        logits = ema(x)[0]
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ema": {n: p.detach().clone() for n, p in ema.named_parameters()}, "ema_logits": logits}


def _assert_close_and_equal(res: dict, ref: dict, world: int, key: str) -> None:
    for r in range(world):
        assert set(res[r][key]) == set(ref[key])
        for k, v in ref[key].items():
            torch.testing.assert_close(res[r][key][k], v, rtol=0, atol=TOL, msg=f"{key} {k} rank {r}")
            assert torch.equal(res[r][key][k], res[0][key][k]), f"{key} {k}: rank {r} differs from rank 0"


HABITS = ["plain", "accum", "accum_no_sync", "accum_sync_call", "opt_before_shard", "ema"]


@pytest.mark.parametrize("habit", HABITS)
@pytest.mark.parametrize("world", [2, 4])
def test_habit_is_exact(world: int, habit: str) -> None:
    tie = habit != "opt_before_shard"  # untied: every linear and both embeddings sharded (all 29 tensors)
    res = run_ranks(_gtp_run, world, habit, world, tie)
    ref = _reference(habit, world, tie)
    _assert_close_and_equal(res, ref, world, "params")
    if habit == "ema":
        _assert_close_and_equal(res, ref, world, "ema")
        for r in range(world):
            torch.testing.assert_close(res[r]["ema_logits"], ref["ema_logits"], rtol=0, atol=TOL)


def _torch_clip(_: int) -> str:
    cfg = OutsideConfig(tie=True)
    model = _model(cfg)
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    x, y = random_batch(1, dist.get_rank(), BATCH, cfg)
    model(x, y)[1].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # per-rank norm of local shards
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except GTPStateError as e:
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # nothing stepped
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2, 4])
def test_torch_clip_grad_norm_is_refused_on_every_rank(world: int) -> None:
    msgs = run_ranks(_torch_clip, world, 0)
    assert len(set(msgs)) == 1 and "\n" not in msgs[0]
    assert "torch.nn.utils.clip_grad_norm_" in msgs[0] and "lowband.parallel.clip_grad_norm_" in msgs[0]


def _zero_grad_keep(_: int) -> bool:
    """``zero_grad(set_to_none=False)`` and lowband's clip are not edits GTP refuses."""
    from lowband.parallel import clip_grad_norm_

    cfg = OutsideConfig(tie=True)
    model = _model(cfg)
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in (1, 2):
        x, y = random_batch(step, dist.get_rank(), BATCH, cfg)
        model(x, y)[1].backward()
        clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return True


def test_zero_grad_without_none_and_lowband_clip_are_accepted() -> None:
    assert run_ranks(_zero_grad_keep, 2, 0) == [True, True]


def _rank0_alone(_: int) -> str:
    cfg = OutsideConfig(tie=True)
    model = _model(cfg)
    mesh = build_mesh(gtp=dist.get_world_size(), timeout=timedelta(seconds=30))
    rt = GTPRuntime(mesh.gtp, GTPOptions(state_timeout=2.0))
    shard_embeddings(model, rt)
    shard_linears(model, rt)
    dist.barrier()
    out = "peer"
    if dist.get_rank() == 0:
        try:
            unsharded_copy(model)  # rank 0 alone (nanoGPT: "if master_process: save/evaluate")
            out = "no error"
        except GTPCollectiveError as e:
            out = str(e)
    dist.barrier()
    return out


def test_rank0_alone_unsharded_copy_fails_within_the_state_timeout() -> None:
    res = run_ranks(_rank0_alone, 2, 0)
    assert res[1] == "peer"
    assert "\n" not in res[0] and "within 2 s" in res[0] and "every rank" in res[0], res[0]


def _autocast_run(_: int) -> dict:
    cfg = OutsideConfig(tie=True)
    model = _model(cfg, torch.float32)
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in (1, 2):
        x, y = random_batch(step, dist.get_rank(), BATCH, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": _logical(model)}


def _autocast_reference(world: int) -> dict:
    cfg = OutsideConfig(tie=True)
    model = seeded_model(SEED, 0, cfg, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in (1, 2):
        for r in range(world):  # DDP: each rank's own forward under autocast, grads averaged in float32
            x, y = random_batch(step, r, BATCH, cfg)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world", [2, 4])
def test_autocast_bf16_matches_ddp_under_the_same_autocast(world: int) -> None:
    """float32 model, ``torch.autocast("cpu", dtype=torch.bfloat16)``. Each rank's forward and backward
    are DDP's bit for bit (the same bf16 GEMMs on the same gathered full weight; the wgrad rounded to
    bf16 then widened, as F.linear's backward under autocast); what differs is only the order of the
    float32 average over ranks (exact for 2 ranks: one addition and a halving; for 4, at most 3
    roundings, relative 3 * 2^-24 of the summed magnitudes). AdamW maps that to an update difference of
    lr * O(1e-7), and a parameter can then round to the neighbouring float32: 1 ulp, <= 2.4e-7 for
    |p| < 2. Two steps: atol 1e-6 (4 such ulps); 2 ranks are asserted bitwise."""
    res = run_ranks(_autocast_run, world, 0)
    ref = _autocast_reference(world)
    for r in range(world):
        for k, v in ref["params"].items():
            atol = 0.0 if world == 2 else 1e-6
            torch.testing.assert_close(res[r]["params"][k], v, rtol=0, atol=atol, msg=k)
            assert torch.equal(res[r]["params"][k], res[0]["params"][k]), k
