"""Issue 27 for GTP: a user's DDP-script habits on the outside-style GPT (tests/external/outside_gpt.py),
2 and 4 gloo ranks, float64, against the single-process equivalent of DDP + torch running the same habit
(tests/external/parallel_ref.py: one loss per rank, gradients averaged over ranks, as DDP does).

Each cell is exact (1e-10, the project's float64 bound; see tests/external/test_gtp.py for why the
orderings of the float64 sums stay far below it) with every rank bitwise equal, or refused on every rank
with one line naming the habit and the lowband way. Among them: ``torch.amp.GradScaler`` with an
overflow confined to one rank's shard rows (exact: skipped on every rank, DDP's scale), nanoGPT's
resume of rank 0's torch-optimizer state on every rank (refused), each rank's own state or
GTPStateLayout + DCP (exact).
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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
from lowband.parallel.gtp_state import GTPStateLayout
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


def _reference(habit: str, world: int, tie: bool, steps: int = STEPS) -> dict:
    """DDP + torch, single process: per micro-batch, every rank's loss / (accum * world) backward."""
    cfg = OutsideConfig(tie=tie)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ema = copy.deepcopy(model)
    accum = ACCUM if habit.startswith("accum") else 1
    for step in range(1, steps + 1):
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
    # one thread, as every rank of lowband.testing runs: a CPU kernel may split a reduction by thread count (with
    # AVX512-BF16, layer norm's weight gradient under autocast differs by 1 ulp between 1 and 2 threads), and
    # the bitwise claim is about lowband's communication, not about that (the conftest restores the count)
    torch.set_num_threads(1)
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


# ------------------------------------------------------------------ torch.amp.GradScaler
MAX_NORM = 0.05
_OVERFLOW = [False]


def _overflow_hook(_mod, _inp, out: torch.Tensor) -> None:
    """Forward hook on the token embedding: when armed, the gradient reaching its output gets an inf at
    the first position, so the overflow lands in one row of ``wte``'s weight gradient only (the row of
    that token, held by one GTP rank), as a local fp16 overflow would; nothing else sees it."""
    if _OVERFLOW[0]:
        def put_inf(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g[0, 0, 0] = float("inf")
            return g

        out.register_hook(put_inf)


def _scaler_gtp(unscale: bool, steps: int, inf_at: int, share: bool) -> dict:
    """The DDP script's GradScaler lines kept: scale(loss).backward(); [unscale_(opt); clip]; step; update."""
    from lowband.parallel import clip_grad_norm_

    cfg = OutsideConfig(tie=False)  # wte sharded: its rows live on different ranks
    model = _model(cfg)
    rt = _shard(model, share_nonfinite=share)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu")
    model.transformer.wte.register_forward_hook(_overflow_hook)
    rank = dist.get_rank()
    wte = model.transformer.wte.weight
    local_inf = None
    for step in range(steps):
        _OVERFLOW[0] = step == inf_at and rank == 1
        x, y = random_batch(_micro(step, 0), rank, BATCH, cfg)
        if step == inf_at:  # the overflowing row and its owner (for the test's own bookkeeping)
            tok = int(random_batch(_micro(step, 0), 1, BATCH, cfg)[0][0, 0])
            owner = tok // wte.gtp.shard_rows
        scaler.scale(model(x, y)[1]).backward()
        if step == inf_at:
            local_inf = [n for n, p in model.named_parameters()
                         if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if unscale:
            scaler.unscale_(opt)
            clip_grad_norm_(model, MAX_NORM)  # lowband's global clip (torch's is refused under GTP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    _OVERFLOW[0] = False
    assert rt.pending()["reduce_scatters"] == 0
    return {"params": _logical(model), "scale": float(scaler.get_scale()), "local_inf": local_inf,
            "owner": owner}


def _scaler_reference(unscale: bool, steps: int, inf_at: int, world: int) -> dict:
    """DDP + torch AdamW + the same scaler calls, single process: each rank's scaled loss / world."""
    cfg = OutsideConfig(tie=False)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu")
    model.transformer.wte.register_forward_hook(_overflow_hook)
    for step in range(steps):
        for r in range(world):
            _OVERFLOW[0] = step == inf_at and r == 1
            x, y = random_batch(_micro(step, 0), r, BATCH, cfg)
            scaler.scale(model(x, y)[1] / world).backward()
        _OVERFLOW[0] = False
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "scale": float(scaler.get_scale())}


@pytest.mark.parametrize("unscale", [True, False])
def test_grad_scaler_skips_an_overflow_on_every_rank_as_ddp(unscale: bool) -> None:
    """An inf confined to one row of wte's gradient (one GTP rank's rows) at step 1: under DDP the
    all-reduce carries it to every rank, every rank skips and halves the scale. GTP flags it in the
    replicated all-reduce and writes NaN into the other ranks' wte shard gradient, so unscale_ finds
    it everywhere: parameters equal DDP's to 1e-10, ranks bitwise equal, every scale DDP's (2**15).
    GradScaler's factors are powers of two: scaling and unscaling add no error."""
    world, steps, inf_at = 2, 4, 1
    res = run_ranks(_scaler_gtp, world, unscale, steps, inf_at, True)
    ref = _scaler_reference(unscale, steps, inf_at, world)
    assert ref["scale"] == 2.0**15  # the reference skipped the overflow step and backed off once
    assert [r["scale"] for r in res] == [ref["scale"]] * world
    owner = res[0]["owner"]
    for r in range(world):  # after the backward, every rank's wte shard gradient shows it, nothing else
        assert res[r]["local_inf"] == ["transformer.wte.weight"], (r, owner, res[r]["local_inf"])
    _assert_close_and_equal(res, ref, world, "params")


def test_grad_scaler_overflow_without_sharing_diverges() -> None:
    """The same run with GTPOptions(share_nonfinite=False): only the owner of the overflowing row sees
    it, one rank skips while the other steps, and the scales part (what the default prevents)."""
    res = run_ranks(_scaler_gtp, 2, True, 2, 1, False)
    owner = res[0]["owner"]
    assert res[owner]["local_inf"] == ["transformer.wte.weight"] and res[1 - owner]["local_inf"] == []
    assert res[owner]["scale"] == 2.0**15 and res[1 - owner]["scale"] == 2.0**16


# ------------------------------------------------------------------ nanoGPT resume with torch AdamW over GTP shards
def _resume(path: str, habit: str, muon: bool = False) -> dict:
    """Train 2 steps, checkpoint the optimizer, build a fresh AdamW (the resumed script), load, train 2 more.

    ``habit="nanogpt"``: every rank ``opt.state_dict()``, rank 0 ``torch.save``s it, every rank loads it.
    ``habit="per_rank"``: each rank saves and loads its own file (the lowband way for a torch optimizer);
    ``habit="dcp"``: ``GTPStateLayout`` + ``torch.distributed.checkpoint`` (the reshardable way);
    ``habit="logical_rank0"``: every rank ``GTPStateLayout.logical_state_dict()`` (whole tensors, collective), rank 0
    ``torch.save``s it, every rank loads it."""
    cfg = OutsideConfig(tie=True)
    model = _model(cfg)
    rt = _shard(model)

    def make_opt() -> torch.optim.Optimizer:
        if not muon:
            return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        from lowband.optim.gtp_muon import GTPMuon
        from lowband.parallel.gtp import is_gtp_param

        mats = [p for n, p in model.named_parameters() if is_gtp_param(p) and ".h." in n]
        ids = {id(p) for p in mats}
        rest = [p for p in model.parameters() if id(p) not in ids]
        return GTPMuon([{"params": mats, "algorithm": "muon", "lr": 0.05}, {"params": rest, "algorithm": "adamw"}],
                       rt.comm, lr=LR, weight_decay=WD, ns_dtype=torch.float64)

    opt = make_opt()
    rank = dist.get_rank()
    ledger = default_ledger()
    checks: list[int] = []  # "gtp:optim_state" collectives per optimizer.step()

    def train(step: int) -> None:
        x, y = random_batch(_micro(step, 0), rank, BATCH, cfg)
        model(x, y)[1].backward()
        start = len(ledger.records)
        try:
            opt.step()
        finally:
            checks.append(sum(r.tag == "gtp:optim_state" for r in ledger.records[start:]))
        opt.zero_grad(set_to_none=True)

    for step in (1, 2):
        train(step)
    mine = f"{path}.rank{rank}"
    if habit == "dcp":
        dcp.save(GTPStateLayout(model, opt).state_dict(), checkpoint_id=path)
    elif habit == "logical_rank0":
        whole = GTPStateLayout(model, opt).logical_state_dict()  # every rank (collective)
        if rank == 0:
            torch.save(whole, path)
    else:
        sd = opt.state_dict()  # every rank
        if habit == "nanogpt":
            if rank == 0:
                torch.save({"optimizer": sd}, path)
        else:
            torch.save({"optimizer": sd}, mine)
    dist.barrier()  # test bookkeeping: the files exist
    opt = make_opt()
    if habit == "dcp":
        layout = GTPStateLayout(model, opt)
        sd = layout.state_dict()
        dcp.load(sd, checkpoint_id=path)
        layout.load_state_dict(sd)
    elif habit == "logical_rank0":
        GTPStateLayout(model, opt).load_state_dict(torch.load(path))
    else:
        opt.load_state_dict(torch.load(path if habit == "nanogpt" else mine)["optimizer"])
    before = [p.detach().clone() for p in model.parameters()]
    try:
        for step in (3, 4):
            train(step)
    except GTPStateError as e:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        return {"error": str(e), "unchanged": unchanged, "checks": checks}
    return {"error": None, "params": _logical(model), "checks": checks}


@pytest.mark.parametrize("muon", [False, True])
def test_nanogpt_resume_of_rank0s_torch_optimizer_state_is_refused_on_every_rank(tmp_path, muon: bool) -> None:
    """torch AdamW over GTP shards, and GTPMuon (whole-matrix momenta on their owners, AdamW on the rest)."""
    res = run_ranks(_resume, 2, str(tmp_path / "ckpt.pt"), "nanogpt", muon)
    msgs = {r["error"] for r in res}
    assert len(msgs) == 1 and None not in msgs  # the same line on every rank, rank 0 (own state) included
    msg = msgs.pop()
    assert "\n" not in msg and "made on GTP rank 0 of 2" in msg and "nanoGPT" in msg
    assert "each rank's own opt.state_dict()" in msg and "GTPStateLayout" in msg
    assert all(r["unchanged"] for r in res)  # refused before anything stepped
    assert all(r["checks"] == [0, 0, 1] for r in res)  # the fresh run's steps send nothing


@pytest.mark.parametrize("habit", ["per_rank", "dcp", "logical_rank0"])
def test_per_rank_or_dcp_torch_optimizer_resume_is_exact(tmp_path, habit: str) -> None:
    """Each rank saves and loads its own opt.state_dict(), or GTPStateLayout + DCP, or rank 0's file of the
    whole (logical) state loaded on every rank: 4 steps equal DDP's uninterrupted 4 steps (1e-10, ranks bitwise
    equal). Cost: one 3-element all-reduce on the GTP state group at the first step after loading a pickled
    state, none at any other step (none for DCP and the logical form: the loaded tensors carry no stamp; the
    logical form's step counter was rank 0's live, stamped tensor and was refused as another rank's)."""
    world = 2
    res = run_ranks(_resume, world, str(tmp_path / "ckpt.pt"), habit)
    assert all(r["error"] is None for r in res), [r["error"] for r in res]
    assert all(r["checks"] == ([0, 0, 1, 0] if habit == "per_rank" else [0, 0, 0, 0]) for r in res)
    _assert_close_and_equal(res, _reference("plain", world, True, steps=4), world, "params")


def _load_on_rank0_alone(path: str) -> str:
    cfg = OutsideConfig(tie=True)
    model = _model(cfg)
    _shard(model, state_timeout=2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    rank = dist.get_rank()
    model(*random_batch(1, rank, BATCH, cfg))[1].backward()
    opt.step()
    if rank == 0:  # only rank 0 resumes from its own file: its check waits for peers that never come
        torch.save(opt.state_dict(), path)
        opt.load_state_dict(torch.load(path))
    out = "stepped"
    try:
        opt.step()
    except GTPCollectiveError as e:
        out = str(e)
    dist.barrier()
    return out


def test_load_on_some_ranks_fails_within_the_state_timeout(tmp_path) -> None:
    """The check after a load is a collective of the GTP group (on its state group): a rank that loaded
    alone gets one line within GTPOptions.state_timeout (2 s here), not the process group's timeout."""
    res = run_ranks(_load_on_rank0_alone, 2, str(tmp_path / "opt0.pt"), timeout=60)
    assert res[1] == "stepped"
    assert "\n" not in res[0] and "within 2 s" in res[0] and "every rank" in res[0], res[0]
