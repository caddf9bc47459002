"""Issue 27 for ShardedAdamW / ShardedMuon: habits a user keeps from a DDP + torch.optim script, on the
outside-style GPT (tests/external/outside_gpt.py), float64, 2 and 4 gloo ranks.

Each cell is either exact (1e-10 against the single-process equivalent of DDP + torch running the
same habit, ranks bitwise equal) or refused on every rank with one line naming the habit and the
lowband way:

| habit | result |
| --- | --- |
| ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` after backward | refused at ``step()`` |
| ``GradScaler("cpu")``: ``scale(loss).backward(); [unscale_(opt); opt.clip_grad_norm]; step(opt)`` |
  exact; an inf step skipped on every rank |
| nanoGPT resume: every rank ``state_dict()``, rank 0 saves, every rank loads | refused; ``full_state_dict`` works |
| ``opt.state_dict()`` on rank 0 alone | one-line error after ``state_timeout`` |
| ``p.data = p.data * 0.9`` after building the optimizer | exact (re-adopted) |
| ``model.float()`` after building the optimizer | refused at ``step()`` |
| ``CosineAnnealingLR(opt, T_max, eta_min)`` with ``ShardedMuon`` | exact |

Tolerances as in tests/external/test_sharded.py: the sharded run and the reference sum the same
gradients in other orders (rank mean of per-rank means vs one mean; the clip norm from per-shard
partial sums): O(k eps) relative per step, k <= 10^3, far below 1e-10 after a few steps. GradScaler's
scale is a power of two, so scaling and unscaling are exact and add no error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.optim import Muon, ShardedAdamW, ShardedMuon
from lowband.plan import muon_split
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model

TOL = 1e-10
SEED = 5
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
MUON_LR, MUON_MOMENTUM = 0.02, 0.95
BATCH = 2
MAX_NORM = 0.05
ETA_MIN = 1e-4


def _sharded(model, algo: str, **kw):
    if algo == "adamw":
        return ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=Comm(), module=model, **kw)
    muon, adam = muon_split(model, outside_plan(model))
    return ShardedMuon(muon, adam, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64,
                       adamw_lr=LR, adamw_betas=BETAS, adamw_weight_decay=WD, comm=Comm(), module=model, **kw)


def _torch_opts(model, algo: str) -> list[torch.optim.Optimizer]:
    if algo == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]
    muon, adam = muon_split(model, outside_plan(model))
    return [Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64),
            torch.optim.AdamW(adam, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]


def _ddp_loss(model, step: int, world: int, cfg: OutsideConfig, inf_at: int | None = None) -> torch.Tensor:
    """What DDP's averaged gradient differentiates: the mean over ranks of each rank's loss (rank 1's
    loss times inf at step ``inf_at``)."""
    total = 0
    for r in range(world):
        loss = model(*random_batch(step, r, BATCH, cfg))[1]
        if step == inf_at and r == 1:
            loss = loss * float("inf")
        total = total + loss
    return total / world


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_exact(res: list[dict], ref: dict[str, torch.Tensor]) -> None:
    for r in res:
        for k, v in ref.items():
            assert torch.equal(r["params"][k], res[0]["params"][k]), k  # ranks bitwise equal
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


def _one_line(msg: str | None) -> str:
    assert msg is not None and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ torch's clip on p.grad: refused
def _torch_clip(kind: str) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _sharded(model, "adamw")
    out: dict = {}
    for step in range(2):
        model(*random_batch(step, rank, BATCH, cfg))[1].backward()
        if step == 1:
            before = _params(model)
            if kind == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif kind == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            elif kind == "data-clamp":  # the pre-1.0 clip_grad_value_: through .data, no version bump
                for p in model.parameters():
                    p.grad.data.clamp_(min=-1e-3, max=1e-3)
            elif rank == dist.get_world_size() - 1:  # "data-one": one element, one rank, through .data
                g = next(p.grad for p in model.parameters() if p.numel() > 1000)
                g.data.view(-1)[1] += 1.0  # between any 64 evenly spaced samples: every bit is compared
        try:
            opt.step()
        except ValueError as e:
            out["error"] = str(e)
            out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        opt.zero_grad()
    # and training goes on with lowband's clip
    model(*random_batch(2, rank, BATCH, cfg))[1].backward()
    opt.clip_grad_norm(MAX_NORM)
    opt.step()
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["norm", "value", "data-clamp", "data-one"])
def test_torch_clip_on_p_grad_is_refused_on_every_rank(world: int, kind: str) -> None:
    """p.grad holds the local gradient lowband already reduced: torch's clip edits it in place (version
    counter), which step() sees and refuses on every rank, before any update, naming the parameter. An edit
    through ``.data`` bumps no version; step() compares every bit of each gradient with its copy, so one
    element changed on one rank is refused on every rank too."""
    res = run_ranks(_torch_clip, world, kind)
    msgs = {_one_line(r.get("error")) for r in res}
    assert len(msgs) == 1  # the same line on every rank
    msg = msgs.pop()
    assert "was changed after lowband reduced it" in msg and "opt.clip_grad_norm(max_norm)" in msg
    assert "transformer." in msg or "lm_head" in msg  # named by module path (module= given)
    assert all(r["unchanged"] for r in res)


# ------------------------------------------------------------------ GradScaler
def _scaler_run(algo: str, unscale: bool, steps: int, inf_at: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _sharded(model, algo)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        loss = model(*random_batch(step, rank, BATCH, cfg))[1]
        if step == inf_at and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
            opt.clip_grad_norm(MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {"params": _params(model), "scale": float(scaler.get_scale()), "world": world}


def _scaler_reference(algo: str, unscale: bool, steps: int, inf_at: int, world: int) -> tuple[dict, float]:
    cfg = OutsideConfig()
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opts = _torch_opts(model, algo)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        scaler.scale(_ddp_loss(model, step, world, cfg, inf_at)).backward()
        if unscale:
            for o in opts:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for o in opts:
            scaler.step(o)
        scaler.update()
        for o in opts:
            o.zero_grad()
    return _params(model), float(scaler.get_scale())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("algo", "unscale"), [("adamw", True), ("adamw", False), ("muon", True)])
def test_grad_scaler_equals_ddp(world: int, algo: str, unscale: bool) -> None:
    """scale(loss).backward(); [unscale_(opt); opt.clip_grad_norm]; scaler.step(opt); update(): equal to
    DDP + torch with the same calls; the step where rank 1's loss is inf is skipped on every rank and
    every rank's scaler backs off alike (found_inf made global)."""
    steps, inf_at = 5, 2
    res = run_ranks(_scaler_run, world, algo, unscale, steps, inf_at)
    ref, ref_scale = _scaler_reference(algo, unscale, steps, inf_at, world)
    assert ref_scale == 2.0**15  # the reference skipped the inf step and halved its scale once
    assert all(r["scale"] == ref_scale for r in res)
    _assert_exact(res, ref)


# ------------------------------------------------------------------ nanoGPT resume: refused
def _nanogpt_resume(algo: str, path: str) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _sharded(model, algo)
    for step in range(2):
        model(*random_batch(step, rank, BATCH, cfg))[1].backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()  # every rank (collective)
    if rank == 0:
        torch.save({"optimizer": sd}, path)
    full = opt.full_state_dict()
    if rank == 0:
        torch.save({"optimizer": full}, path + ".full")
    dist.barrier()  # test bookkeeping: the files exist
    out: dict = {}
    try:
        opt.load_state_dict(torch.load(path, weights_only=False)["optimizer"])
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    opt.load_state_dict(opt.state_dict())  # its own rank's state: fine
    before = opt.full_state_dict()
    opt.load_full_state_dict(torch.load(path + ".full", weights_only=False)["optimizer"])  # the way out
    after = opt.full_state_dict()
    out["full_same"] = all(torch.equal(v, after["state"][i][k]) for i, st in before["state"].items()
                           for k, v in st.items())
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_nanogpt_resume_of_one_ranks_state_dict_is_refused(world: int, algo: str, tmp_path: Path) -> None:
    res = run_ranks(_nanogpt_resume, world, algo, str(tmp_path / "ckpt.pt"))
    msgs = {_one_line(r["error"]) for r in res}
    assert len(msgs) == 1  # refused on every rank, with the same line
    msg = msgs.pop()
    assert "saved by rank 0 of" in msg and "full_state_dict()" in msg and "get_state_dict" in msg
    assert all(r["full_same"] for r in res)


# ------------------------------------------------------------------ a state collective on rank 0 alone
def _rank0_state_dict() -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _sharded(model, "adamw", state_timeout=3.0)
    model(*random_batch(0, rank, BATCH, cfg))[1].backward()
    opt.step()
    out = {"error": None}
    if rank == 0:
        try:
            opt.state_dict()
        except RuntimeError as e:
            out["error"] = str(e)
    return out


def test_state_dict_on_rank0_alone_ends_with_one_line() -> None:
    """opt.state_dict() entered by rank 0 alone ends after state_timeout (3 s here) with one line naming
    the call, instead of hanging for the process group's timeout (the run is bounded by 30 s)."""
    res = run_ranks(_rank0_state_dict, 2, timeout=30)
    msg = _one_line(res[0]["error"])
    assert "ShardedAdamW.state_dict" in msg and "state_timeout=3 s" in msg and "every rank" in msg
    assert res[1]["error"] is None


# ------------------------------------------------------------------ storage: p.data = ..., model.float()
def _rebind(algo: str, steps: int, what: str) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _sharded(model, algo)
    out: dict = {"error": None}
    for step in range(steps):
        if step == 2:
            with torch.no_grad():
                if what == "rebind":
                    for p in model.parameters():
                        p.data = p.data * 0.9
                else:
                    model.float()
        model(*random_batch(step, rank, BATCH, cfg))[1].backward()
        try:
            opt.clip_grad_norm(MAX_NORM)  # the next lowband call after model.float() refuses
            opt.step()
        except ValueError as e:
            out["error"] = str(e)
            break
        opt.zero_grad()
    out["params"] = _params(model)
    return out


def _rebind_reference(algo: str, steps: int, world: int) -> dict:
    cfg = OutsideConfig()
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opts = _torch_opts(model, algo)
    for step in range(steps):
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data * 0.9
        _ddp_loss(model, step, world, cfg).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for o in opts:
            o.step()
            o.zero_grad()
    return _params(model)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_rebinding_p_data_is_readopted(world: int, algo: str) -> None:
    """p.data = p.data * 0.9 moves every parameter out of lowband's flat buffer; step() copies the new
    values back in and re-points p.data: training continues exactly as with torch."""
    res = run_ranks(_rebind, world, algo, 4, "rebind")
    assert all(r["error"] is None for r in res)
    _assert_exact(res, _rebind_reference(algo, 4, world))


def test_model_to_another_dtype_is_refused_on_every_rank() -> None:
    res = run_ranks(_rebind, 2, "adamw", 4, "float")
    msgs = {_one_line(r["error"]) for r in res}
    assert len(msgs) == 1
    msg = msgs.pop()
    assert "torch.float32" in msg and "torch.float64" in msg and "build the optimizer after model.to" in msg


# ------------------------------------------------------------------ torch lr schedulers with ShardedMuon
def _cosine(steps: int) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _sharded(model, "muon")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=ETA_MIN)
    for step in range(steps):
        model(*random_batch(step, rank, BATCH, cfg))[1].backward()
        opt.clip_grad_norm(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"params": _params(model), "lrs": [g["lr"] for g in opt.param_groups]}


@pytest.mark.parametrize("world", [2, 4])
def test_cosine_annealing_with_eta_min_on_sharded_muon(world: int) -> None:
    """CosineAnnealingLR(eta_min) changes the Muon/AdamW lr ratio by design; with the scheduler attached
    the ratio check stands aside, and the run equals Muon + AdamW each with its own scheduler."""
    steps = 4
    res = run_ranks(_cosine, world, steps)
    cfg = OutsideConfig()
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opts = _torch_opts(model, "muon")
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps, eta_min=ETA_MIN) for o in opts]
    for step in range(steps):
        _ddp_loss(model, step, world, cfg).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
            o.zero_grad()
    _assert_exact(res, _params(model))
    assert all(r["lrs"] == [o.param_groups[0]["lr"] for o in opts] for r in res)
