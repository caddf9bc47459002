"""Issue 27 for sparse embedding tables: DDP-script habits under ``ShardedAdamW`` with the token
embedding's gradient sent row-sparse (``sparse_tables=...``, ``sparse_mode="sparse"``), on the
outside-style GPT (tests/external/outside_gpt.py, untied head), float64, 2 and 4 gloo ranks, against
DDP + torch AdamW running the same habit (single process: the mean over ranks of each rank's loss).

| habit | result |
| --- | --- |
| ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` after backward | refused at ``step()`` on every rank |
| ``GradScaler``: ``scale(loss).backward(); unscale_(opt); opt.clip_grad_norm; step(opt); update()`` | exact |
| the same with an overflow in one table row of one rank's gradient | skipped on every rank, DDP's scale |

Tolerances as in tests/external/test_habits_sharded.py: the same gradients summed in other orders,
O(k eps64) relative per step with k <= 10^3, far below 1e-10; GradScaler's power-of-two scale is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.optim import ShardedAdamW
from lowband.optim.sparse_rows import sparse_tables_from_plan
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model
from tests.external.test_habits_gtp import _OVERFLOW, _overflow_hook  # an inf in one row of wte's gradient

TOL = 1e-10
SEED = 5
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
BATCH = 2
MAX_NORM = 0.05
STEPS, INF_AT = 4, 1
def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sparse_run(habit: str) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=False)
    model = seeded_model(SEED, rank, cfg, torch.float64)
    model.transformer.wte.register_forward_hook(_overflow_hook)
    tables = sparse_tables_from_plan(model, ["wte"], plan=outside_plan(model))
    opt = ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=Comm(), module=model,
                       sparse_tables=tables, sparse_mode="sparse")
    scaler = torch.amp.GradScaler("cpu") if habit.startswith("scaler") else None
    for step in range(STEPS):
        x, y = random_batch(step, rank, BATCH, cfg)
        opt.observe_tokens(x)
        _OVERFLOW[0] = habit == "scaler_inf" and step == INF_AT and rank == 1
        loss = model(x, y)[1]
        (scaler.scale(loss) if scaler is not None else loss).backward()
        _OVERFLOW[0] = False
        if habit == "torch_clip":
            before = _params(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # this rank's local gradients
            try:
                opt.step()
            except ValueError as e:
                same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
                return {"error": str(e), "unchanged": same}
            return {"error": None}
        if scaler is not None:
            scaler.unscale_(opt)
        opt.clip_grad_norm(MAX_NORM)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return {"params": _params(model), "scale": float(scaler.get_scale()) if scaler is not None else None}


def _reference(habit: str, world: int) -> tuple[dict[str, torch.Tensor], float]:
    cfg = OutsideConfig(tie=False)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    model.transformer.wte.register_forward_hook(_overflow_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(STEPS):
        total = 0
        for r in range(world):
            _OVERFLOW[0] = habit == "scaler_inf" and step == INF_AT and r == 1
            total = total + model(*random_batch(step, r, BATCH, cfg))[1]
            _OVERFLOW[0] = False
        scaler.scale(total / world).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _params(model), float(scaler.get_scale())


@pytest.mark.parametrize("world", [2, 4])
def test_torch_clip_grad_norm_is_refused_on_every_rank(world: int) -> None:
    res = run_ranks(_sparse_run, world, "torch_clip")
    msgs = {r["error"] for r in res}
    assert len(msgs) == 1 and None not in msgs
    msg = msgs.pop()
    assert "\n" not in msg and "was changed after lowband reduced it" in msg and "opt.clip_grad_norm(max_norm)" in msg
    assert all(r["unchanged"] for r in res)


@pytest.mark.parametrize(("world", "habit"), [(2, "scaler"), (2, "scaler_inf"), (4, "scaler_inf")])
def test_grad_scaler_equals_ddp(world: int, habit: str) -> None:
    """With ``scaler_inf`` rank 1's gradient of one ``wte`` row is inf at step 1: DDP's all-reduce shows
    it everywhere and every rank skips; the sparse exchange sends that row to its owner only, and the
    sharded optimizer's global found_inf makes every rank skip and back off alike."""
    res = run_ranks(_sparse_run, world, habit)
    ref, ref_scale = _reference(habit, world)
    assert ref_scale == (2.0**15 if habit == "scaler_inf" else 2.0**16)
    for r in res:
        assert r["scale"] == ref_scale
        for k, v in ref.items():
            assert torch.equal(r["params"][k], res[0]["params"][k]), k  # ranks bitwise equal
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
