"""Issue 27 for tensor parallelism: a user's DDP-script habits on the outside-style GPT
(tests/external/outside_gpt.py) under ``shard_tp`` with torch AdamW on the slices, 2 ranks (TP 2) and
4 ranks (TP 2 x DP 2), float64, against the single-process reference (tests/external/parallel_ref.py:
one loss per data lane, lanes' gradients averaged, the same clip, torch AdamW).

Each cell is exact (1e-10, the project's float64 bound; tests/external/test_tp.py says why the float64
sums in other orders stay far below it) or refused on every rank with one line naming the habit and the
lowband way:

* ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` clips each TP rank by the norm of its own
  slices: refused at ``optimizer.step()`` (:mod:`lowband.parallel.tp_grads`), nothing stepped;
* ``clip_grad_value_`` is elementwise, the same on every rank: refused by default like every edit,
  exact with ``shard_tp(..., check_grad_edits=False)``;
* ``torch.amp.GradScaler`` (scale, backward, DP average, ``unscale_``, lowband's clip, ``step``,
  ``update``) and gradient accumulation with ``zero_grad(set_to_none=False)``: exact, not refused
  (a power-of-two scale and its unscale are exact in float64); an overflow confined to one TP rank's
  slice is skipped on every rank, as under DDP (``shard_tp(..., share_nonfinite=False)`` shows the
  divergence it prevents).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.parallel import (
    TPGradEditError,
    TPInputGather,
    TPInputMismatchError,
    clip_grad_norm_,
    shard_tp,
    unsharded_copy,
)
from lowband.parallel.gtp import reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model
from tests.external.parallel_ref import LR, SEED, WD, lanes_of, reference_step

TOL = 1e-10
STEPS = 3
MAX_NORM = 0.05
CLIP_VALUE = 1e-3
ACCUM = 2
TP = 2
INF_AT = 1  # the step whose gradient overflows in the scaler_inf runs
EMA = 0.9


def _tp_run(habit: str, check_grad_edits: bool = True, share_nonfinite: bool = True) -> dict:
    cfg = OutsideConfig(tie=True)
    model = seeded_model(SEED, dist.get_rank(), cfg, torch.float64)
    mesh = build_mesh(tp=TP)
    shard_tp(model, outside_plan(model), mesh.tp, sync_comm=Comm(), check_grad_edits=check_grad_edits,
             share_nonfinite=share_nonfinite)
    wrapped = TPInputGather(model, mesh.tp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ema = copy.deepcopy(model) if habit == "ema" else None  # the copy keeps the TP layout and group
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if habit.startswith("scaler") else None
    accum = ACCUM if habit == "accum" else 1
    armed = [False]
    if habit == "scaler_inf" and mesh.tp.rank == 1:  # an overflow in TP rank 1's slice of c_attn only
        def put_inf(g: torch.Tensor) -> torch.Tensor:
            if armed[0]:
                g = g.clone()
                g[0, 0] = float("inf")
            return g

        model.get_submodule("transformer.h.0.attn.c_attn").weight.register_hook(put_inf)
    for step in range(1, STEPS + 1):
        armed[0] = step == INF_AT
        for m in range(accum):
            x, y = random_batch(10 * step + m if accum > 1 else step, dist.get_rank(), 2, cfg)
            loss = wrapped(x, y)[1] / accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if mesh.dp.size > 1:
            reduce_grads(mesh.dp, model.parameters(), "avg", tag="grad")
        if scaler is not None:
            scaler.unscale_(opt)
        if habit == "torch_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # each rank's own slices
        elif habit == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        else:
            clip_grad_norm_(model, MAX_NORM)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        except TPGradEditError as e:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # nothing stepped
            return {"error": str(e)}
        opt.zero_grad(set_to_none=habit != "accum")
        if ema is not None:
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.lerp_(p, 1 - EMA)
    plain = unsharded_copy(model)
    out = {"params": {n: p.detach().clone() for n, p in plain.named_parameters()}}
    if ema is not None:
        out["ema"] = {n: p.detach().clone() for n, p in unsharded_copy(ema).named_parameters()}
    if scaler is not None:
        out["scale"] = float(scaler.get_scale())
    return out


def _reference(world: int, habit: str, ema_out: dict | None = None) -> dict[str, torch.Tensor]:
    """DDP + torch: an overflow anywhere in the gradient (``scaler_inf``) makes every rank skip its step.
    ``ema_out``: filled with the EMA copy's parameters (``copy.deepcopy`` + ``lerp_`` after each step)."""
    cfg = OutsideConfig(tie=True)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ema = copy.deepcopy(model)
    lanes = lanes_of(world, TP)
    for step in range(1, STEPS + 1):
        if habit == "scaler_inf" and step == INF_AT:
            continue
        if habit == "accum":  # per micro-batch m the lanes' batches of step 10*step+m, loss / ACCUM
            for m in range(ACCUM):
                for lane in lanes:
                    xs, ys = zip(*(random_batch(10 * step + m, r, 2, cfg) for r in lane))
                    (model(torch.cat(xs), torch.cat(ys))[1] / (ACCUM * len(lanes))).backward()
        else:
            reference_step(model, step, lanes, cfg)
        if habit == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(p, 1 - EMA)
    if ema_out is not None:
        ema_out.update({n: p.detach().clone() for n, p in ema.named_parameters()})
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_exact(res: list[dict], ref: dict[str, torch.Tensor]) -> None:
    for r, got in enumerate(res):
        assert "error" not in got, got.get("error")
        assert got["params"].keys() == ref.keys()
        for k, v in ref.items():
            torch.testing.assert_close(got["params"][k], v, rtol=0, atol=TOL, msg=f"{k} rank {r}")
            assert torch.equal(got["params"][k], res[0]["params"][k]), f"{k}: rank {r} differs from rank 0"


@pytest.mark.parametrize("world", [2, 4])
def test_torch_clip_grad_norm_is_refused_on_every_rank(world: int) -> None:
    res = run_ranks(_tp_run, world, "torch_clip")
    msgs = [r.get("error", "no error") for r in res]
    assert len(set(msgs)) == 1 and "\n" not in msgs[0], msgs
    assert "torch.nn.utils.clip_grad_norm_" in msgs[0] and "lowband.parallel.clip_grad_norm_" in msgs[0]
    assert "'transformer.h.0.attn.c_attn.weight'" in msgs[0]  # the first TP slice the optimizer holds


def test_clip_grad_value_is_refused_by_default_and_exact_when_allowed() -> None:
    msgs = [r.get("error", "no error") for r in run_ranks(_tp_run, 2, "clip_value")]
    assert len(set(msgs)) == 1 and "check_grad_edits=False" in msgs[0], msgs
    _assert_exact(run_ranks(_tp_run, 2, "clip_value", False), _reference(2, "clip_value"))


@pytest.mark.parametrize("world", [2, 4])
def test_grad_scaler_with_lowband_clip_is_exact(world: int) -> None:
    res = run_ranks(_tp_run, world, "scaler")
    _assert_exact(res, _reference(world, "scaler"))
    assert all(r["scale"] == 2.0**10 for r in res)  # no overflow, no growth within 3 steps


def test_accumulation_with_zero_grad_keeping_tensors_is_exact() -> None:
    _assert_exact(run_ranks(_tp_run, 4, "accum"), _reference(4, "accum"))


@pytest.mark.parametrize("world", [2, 4])
def test_grad_scaler_skips_an_overflow_in_one_tp_slice_on_every_rank(world: int) -> None:
    """An inf in TP rank 1's slice of c_attn's gradient at step 1: under DDP every rank sees it and
    skips; here the TP group's inf/NaN flags make every rank skip too and back off to the same scale."""
    res = run_ranks(_tp_run, world, "scaler_inf")
    _assert_exact(res, _reference(world, "scaler_inf"))
    assert all(r["scale"] == 2.0**9 for r in res)  # one backoff, on every rank


def _tp_run_or_mismatch(*args: Any) -> dict:
    try:
        return _tp_run(*args)
    except TPInputMismatchError as e:
        return {"mismatch": str(e)}


def test_grad_scaler_overflow_without_sharing_diverges() -> None:
    """The same with shard_tp(share_nonfinite=False): TP rank 1 skips, rank 0 steps (the test above can fail), so
    their replicated weights differ and the next forward's TP layers see other inputs on each rank: every rank
    stops there with TPInputMismatchError (lowband.parallel.tensor's input digest), instead of training on."""
    res = run_ranks(_tp_run_or_mismatch, 2, "scaler_inf", True, False)
    for r, out in enumerate(res):
        assert "mismatch" in out, (r, sorted(out))
        assert "computed layer 'transformer.h.0.attn.c_attn' on different inputs" in out["mismatch"], out


def test_ema_deepcopy_of_a_tp_model_is_exact() -> None:
    """``ema = copy.deepcopy(model)`` of the TP model (the copy keeps its slices' layout and the TP group),
    ``lerp_`` after every step, gathered with ``unsharded_copy``: equal to DDP's EMA."""
    res = run_ranks(_tp_run, 2, "ema")
    ema_ref: dict = {}
    _assert_exact(res, _reference(2, "ema", ema_ref))
    for r, got in enumerate(res):
        assert got["ema"].keys() == ema_ref.keys()
        for k, v in ema_ref.items():
            torch.testing.assert_close(got["ema"][k], v, rtol=0, atol=TOL, msg=f"ema {k} rank {r}")
