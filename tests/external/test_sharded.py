"""ShardedAdamW / ShardedMuon and sparse tables on an outside-style GPT (tests/external/outside_gpt.py),
2 and 4 gloo ranks, against a single-process reference on the same global batch.

What a user's own script does: per-rank seeds (``seed + rank``), the optimizer built from
``model.parameters()`` (or :func:`lowband.plan.muon_split`), global-norm clipping through the
optimizer, an LR schedule, evaluation on rank 0 only, checkpoints through torch DCP
(``get_state_dict`` / ``set_state_dict`` + ``dcp.save`` / ``dcp.load``), and the traps of issue 11:
per-rank seeds, one lr written into every group, a sparse table tied to the output head.

Tolerances: float64 throughout (Muon's Newton-Schulz too). The sharded run and the reference evaluate
the same sums in other orders (rank-mean of per-rank mean gradients vs one global mean; the clipping
norm as per-shard partial sums), so each step's gradient differs by a relative O(k eps), k <= 10^3
terms (<= 2e-13); AdamW and Muon map that to parameter changes of lr * O(k eps) per step: after a few
steps far below the project's float64 bound of 1e-10, which we use. Where the arithmetic order is
identical (sparse vs dense exchange of the same table: both sum the same rows in rank order) we
assert bitwise equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger
from lowband.optim import Muon, ShardedAdamW, ShardedMuon
from lowband.optim.sparse_rows import SparseTable, sparse_table_for, sparse_tables_from_plan
from lowband.plan import muon_split
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model

TOL = 1e-10
SEED = 3
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
MUON_LR, MUON_MOMENTUM = 0.02, 0.95
BATCH = 2  # rows per rank per step
MAX_NORM = 0.05  # below the gradient norm at every step here, so clipping is active


def lr_factor(step: int) -> float:
    return 1.0 / (1.0 + 0.25 * step)


def global_batch(step: int, world: int, cfg: OutsideConfig) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(random_batch(step, r, BATCH, cfg) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def _reference(algo: str, tie: bool, world: int, steps: int, clip: bool = True) -> dict:
    """Single process, rank 0's initial weights (what init_sync broadcasts), global batch, torch AdamW
    (or lowband's single-device Muon + torch AdamW), torch's clip_grad_norm_, LambdaLR."""
    cfg = OutsideConfig(tie=tie)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    if algo == "adamw":
        opts = [torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]
    else:
        muon, adam = muon_split(model, outside_plan(model))
        opts = [Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64),
                torch.optim.AdamW(adam, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in opts]
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world, cfg)
        _, loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _make_opt(model, algo: str, comm: Comm, **kw):
    if algo == "adamw":
        return ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=comm, **kw)
    muon, adam = muon_split(model, outside_plan(model))
    return ShardedMuon(muon, adam, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64,
                       adamw_lr=LR, adamw_betas=BETAS, adamw_weight_decay=WD, comm=comm, **kw)


def _train_steps(model, opt, sched, steps: range, cfg: OutsideConfig, *, sparse: bool = False,
                 clip: bool = True) -> list[float]:
    rank = dist.get_rank()
    losses = []
    for step in steps:
        x, y = random_batch(step, rank, BATCH, cfg)
        if sparse:
            opt.observe_tokens(x)
        _, loss = model(x, y)
        loss.backward()
        if clip:
            opt.clip_grad_norm(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)  # test bookkeeping only (the global-batch loss), not lowband traffic
        losses.append(float(t) / dist.get_world_size())
    return losses


# ------------------------------------------------------------------ per-rank seeds, AdamW and Muon
def _per_rank_seeds(algo: str, tie: bool, steps: int, param_gather: str) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=tie)
    model = seeded_model(SEED, rank, cfg, torch.float64)  # nanoGPT-style: ranks start apart
    differs_before = not torch.equal(model.transformer.wte.weight, seeded_model(SEED, 0, cfg, torch.float64)
                                     .transformer.wte.weight)
    ledger = CommLedger()
    opt = _make_opt(model, algo, Comm(ledger=ledger), module=model, param_gather=param_gather)
    init = [(r.op, r.numel, r.wire_bytes) for r in ledger.select(tag="init_sync")]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses = _train_steps(model, opt, sched, range(steps), cfg)
    opt.wait_for_params()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "differs_before": differs_before, "init": init, "units": [u.numel for u in opt.units],
            "tied_after": model.transformer.wte.weight is model.lm_head.weight}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_per_rank_seeds_equal_single_process(world: int, algo: str) -> None:
    """init_sync (default) broadcasts rank 0's weights: per-rank-seeded ranks train exactly like one
    process on the global batch (tied wte/lm_head, biases, clipping, LambdaLR over both Muon and AdamW
    groups); one broadcast per unit, exact bytes."""
    steps = 4
    res = run_ranks(_per_rank_seeds, world, algo, True, steps, "step")
    ref = _reference(algo, True, world, steps)
    for r in res:
        assert r["tied_after"]
        if dist_rank(res, r) > 0:
            assert r["differs_before"]
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
        # OutsideGPT computes its cross-entropy in float32: per-rank means of BATCH * block_size tokens,
        # averaged over ranks, vs one mean of all tokens: (tokens + world) float32 roundings at most
        loss_tol = (world * BATCH * OutsideConfig().block_size + world) * 2.0**-24
        for a, b in zip(r["losses"], ref["losses"]):
            assert abs(a - b) <= loss_tol * abs(b), (a, b)
        # one broadcast per unit (the flat parameter buffer; no frozen params or buffers here)
        assert r["init"] == [("broadcast", n, (world - 1) * n * 8 // world) for n in r["units"]]


def dist_rank(res: list[dict], r: dict) -> int:
    return next(i for i, x in enumerate(res) if x is r)


# ------------------------------------------------------------------ init_sync=False / "verify"
def _init_sync_modes() -> dict:
    rank = dist.get_rank()
    out = {}
    model = seeded_model(SEED, rank, OutsideConfig(), torch.float64)
    ledger = CommLedger()
    try:
        ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), module=model, init_sync="verify")
        out["verify"] = None
    except ValueError as e:
        out["verify"] = str(e)
    out["verify_records"] = [(r.op, r.tag) for r in ledger.records]
    same = seeded_model(SEED, 0, OutsideConfig(), torch.float64)  # equal on every rank: verify passes
    ShardedAdamW(same.parameters(), comm=Comm(), module=same, init_sync="verify")
    model = seeded_model(SEED, rank, OutsideConfig(), torch.float64)
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    ShardedAdamW(model.parameters(), comm=Comm(), init_sync=False)
    out["untouched"] = torch.equal(model.transformer.h[0].attn.c_attn.weight, before)
    try:
        ShardedAdamW(seeded_model(SEED, 0).parameters(), init_sync="yes")
        out["bad_value"] = None
    except ValueError as e:
        out["bad_value"] = str(e)
    return out


def test_init_sync_verify_names_the_first_differing_parameter() -> None:
    res = run_ranks(_init_sync_modes, 2)
    msg = res[0]["verify"]
    assert msg is not None and all(r["verify"] == msg for r in res)  # same error on every rank
    assert "transformer.wte.weight" in msg and "init_sync=True" in msg
    assert res[0]["verify_records"] == [("all_gather_object", "validate"), ("all_gather_object", "init_sync")]
    assert all(r["untouched"] for r in res)  # init_sync=False leaves the weights alone
    assert "init_sync='yes' is not allowed" in res[0]["bad_value"]


# ------------------------------------------------------------------ the one-lr loop trap
def _one_lr_loop() -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    out = {}
    for check in (True, False):
        model = seeded_model(SEED, rank, cfg, torch.float64)
        opt = _make_opt(model, "muon", Comm(), lr_ratio_check=check)
        for g in opt.param_groups:  # the common loop: one lr for every group
            g["lr"] = 3e-4
        x, y = random_batch(0, rank, BATCH, cfg)
        model(x, y)[1].backward()
        try:
            opt.step()
            out[check] = None
        except ValueError as e:
            out[check] = str(e)
    # scaling every group's own lr by one factor is fine; all-zero lrs too
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _make_opt(model, "muon", Comm())
    for factor in (0.5, 0.0):
        for g, base in zip(opt.param_groups, opt.base_lrs):
            g["lr"] = base * factor
        model(*random_batch(0, rank, BATCH, cfg))[1].backward()
        opt.step()
        opt.zero_grad()
    out["base_lrs"] = opt.base_lrs
    return out


def test_one_lr_for_every_group_is_caught() -> None:
    res = run_ranks(_one_lr_loop, 2)
    for r in res:
        assert r[True] is not None and "runs Muon at the AdamW lr" in r[True], r[True]
        assert "group 0 (muon): 0.02 -> 0.0003" in r[True] and "lr_ratio_check=False" in r[True]
        assert r[False] is None  # opted out
        assert r["base_lrs"] == [MUON_LR, LR]


# ------------------------------------------------------------------ sparse tables
def _tied_sparse_table() -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=True)
    model = seeded_model(SEED, rank, cfg, torch.float64)
    out = {}
    for what, build in (("plan", lambda: sparse_tables_from_plan(model, ["wte"], plan=outside_plan(model))),
                        ("param", lambda: sparse_table_for(model, "transformer.wte.weight", name="wte"))):
        try:
            build()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    raw = SparseTable("wte", model.transformer.wte.weight, vocab_size=cfg.vocab_size)  # bypasses the helpers
    ledger = CommLedger()
    try:
        ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), module=model, sparse_tables=[raw])
        out["module"] = None
    except ValueError as e:
        out["module"] = str(e)
    out["module_records"] = len(ledger.records)
    opt = ShardedAdamW(model.parameters(), comm=Comm(), sparse_tables=[raw])  # no module: runtime check
    x, y = random_batch(0, rank, BATCH, cfg)
    opt.observe_tokens(x)
    try:
        model(x, y)[1].backward()
        opt.step()
        out["runtime"] = None
    except RuntimeError as e:
        out["runtime"] = str(e)
    return out


def test_sparse_table_tied_to_the_head_is_refused_by_name() -> None:
    """wte is tied to lm_head, whose gradient touches every row: refused at construction (plan helper,
    parameter helper, optimizer with module=), before any collective; without the model, the first
    launch finds gradient rows outside the tokens' rows and raises on every rank."""
    for r in run_ranks(_tied_sparse_table, 2):
        for what in ("plan", "param", "module"):
            assert r[what] is not None and "'transformer.wte.weight' is tied to ['lm_head.weight']" in r[what], r
        assert r["module_records"] == 0  # refused before any collective
        assert r["runtime"] is not None and "sparse table 'wte'" in r["runtime"]
        assert "tokens do not name" in r["runtime"]


def _untied_sparse(mode: str, steps: int, clip: bool = False) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig(tie=False)
    model = seeded_model(SEED, rank, cfg, torch.float64)
    ledger = CommLedger()
    tables = sparse_tables_from_plan(model, ["wte"], plan=outside_plan(model)) if mode != "none" else []
    opt = ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=Comm(ledger=ledger),
                       module=model, sparse_tables=tables, sparse_mode=mode if tables else "auto")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    ledger.mark_step()
    losses = _train_steps(model, opt, sched, range(steps), cfg, sparse=bool(tables), clip=clip)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "a2a": ledger.count(op="all_to_all", tag="sparse:wte:rows"),
            "counts": ledger.count(op="all_gather", tag="sparse:wte:counts")}


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_table_on_untied_model_equals_dense(world: int) -> None:
    """tie=False: wte's gradient touches only the tokens' rows; the row-sparse exchange gives bitwise
    the dense result (same rows summed in the same rank order) and matches the reference. No clipping
    here: the table's own unit changes how the norm's partial sums group, so a clipped run would differ
    from the dense one in the last bits of the clip coefficient (test_per_rank_seeds covers clipping)."""
    steps = 3
    dense = run_ranks(_untied_sparse, world, "none", steps)
    sparse = run_ranks(_untied_sparse, world, "sparse", steps)
    ref = _reference("adamw", False, world, steps, clip=False)
    for d, s in zip(dense, sparse):
        assert s["a2a"] == steps and s["counts"] == steps and d["a2a"] == 0
        for k, v in d["params"].items():
            assert torch.equal(s["params"][k], v), k
            torch.testing.assert_close(v, ref["params"][k], rtol=TOL, atol=TOL, msg=k)
    # global-norm clipping with a sparse table: the table's owned shards hold its whole averaged
    # gradient, so the norm (and the clipped run) equals torch's clip_grad_norm_ on one process
    clipped = run_ranks(_untied_sparse, world, "sparse", steps, True)
    ref_clip = _reference("adamw", False, world, steps)
    for r in clipped:
        for k, v in ref_clip["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


# ------------------------------------------------------------------ evaluation on rank 0 only
def _eval_rank0(algo: str) -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    opt = _make_opt(model, algo, Comm(), module=model, param_gather="forward")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    _train_steps(model, opt, sched, range(2), cfg)
    eval_loss = None
    if rank == 0:  # gathers still in flight (param_gather="forward"): the pre-hooks only wait for them
        with torch.no_grad():
            eval_loss = float(model(*global_batch(99, 1, cfg))[1])
        model.train()
    _train_steps(model, opt, sched, range(2, 4), cfg)
    opt.wait_for_params()
    if rank == 0:
        opt.wait_for_params()  # again, rank 0 only: purely local
        with torch.no_grad():
            final_eval = float(model(*global_batch(99, 1, cfg))[1])
    else:
        final_eval = None
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "eval": eval_loss,
            "final_eval": final_eval}


def _eval_reference(algo: str, world: int) -> tuple[float, dict]:
    ref2 = _reference(algo, True, world, 2)
    cfg = OutsideConfig()
    model = seeded_model(SEED, 0, cfg, torch.float64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref2["params"][n])
        loss = float(model(*global_batch(99, 1, cfg))[1])
    return loss, _reference(algo, True, world, 4)["params"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_evaluation_on_rank0_only(world: int, algo: str) -> None:
    """With param_gather="forward" the gathers are in flight when rank 0 alone runs an evaluation
    forward: no deadlock, the evaluation sees the updated weights, training goes on unchanged."""
    res = run_ranks(_eval_rank0, world, algo, timeout=120)
    ref_eval, ref_params = _eval_reference(algo, world)
    # the evaluation loss is the model's float32 cross-entropy of identical (1e-10) float64 weights:
    # a few float32 roundings apart at most (block_size * BATCH tokens summed in one order either way)
    assert abs(res[0]["eval"] - ref_eval) <= BATCH * OutsideConfig().block_size * 2.0**-24 * abs(ref_eval)
    assert all(r["eval"] is None for r in res[1:])
    for r in res:
        for k, v in ref_params.items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


# ------------------------------------------------------------------ checkpoints through torch DCP
def _dcp_run(algo: str, path: str, steps: tuple[int, int], resume: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED + 100 * resume, rank, cfg, torch.float64)  # resumed weights come from the checkpoint
    ledger = CommLedger()
    opt = _make_opt(model, algo, Comm(ledger=ledger), module=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    if resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        sched.last_epoch = steps[0] - 1  # the schedule resumes where it left off
        sched.step()
        assert model.transformer.wte.weight is model.lm_head.weight
    _train_steps(model, opt, sched, range(*steps), cfg)
    labels_ok = True
    if not resume and path:
        model_sd, optim_sd = get_state_dict(model, opt)
        # labelled by parameter, full shapes (the old unit-indexed state was silently mislabelled)
        params = dict(model.named_parameters())
        labels_ok = set(optim_sd["state"]) == set(params) and all(
            tuple(v.shape) == tuple(params[fqn].shape) for fqn, st in optim_sd["state"].items()
            for k, v in st.items() if k != "step")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state_gathers": ledger.count(tag="state"), "labels_ok": labels_ok}


@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_dcp_save_resume_reshard_2_to_4(algo: str, tmp_path: Path) -> None:
    """torch's get_state_dict + dcp.save on 2 ranks, then get_state_dict + dcp.load + set_state_dict
    on 2 ranks (resume) and on 4 ranks (reshard): the continued runs equal an uninterrupted run
    (world 2's global batches throughout, 1e-10)."""
    split, steps = 2, 4
    ckpt = str(tmp_path / "ckpt")
    assert all(r["labels_ok"] for r in run_ranks(_dcp_run, 2, algo, ckpt, (0, split), False))
    full = run_ranks(_dcp_run, 2, algo, "", (0, steps), False)
    resumed = run_ranks(_dcp_run, 2, algo, ckpt, (split, steps), True)
    for r in resumed:
        for k, v in full[0]["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
    # reshard to 4 ranks: the global batch after the split is then world 4's
    resharded = run_ranks(_dcp_run, 4, algo, ckpt, (split, steps), True)
    ref = _reshard_reference(algo, split, steps)
    for r in resharded:
        assert r["state_gathers"] > 0  # the Shard(0) state was gathered through lowband.comm
        for k, v in ref.items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)


def _reshard_reference(algo: str, split: int, steps: int) -> dict:
    """Single process: ``split`` steps on world 2's global batches, then world 4's."""
    cfg = OutsideConfig()
    model = seeded_model(SEED, 0, cfg, torch.float64)
    if algo == "adamw":
        opts = [torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]
    else:
        muon, adam = muon_split(model, outside_plan(model))
        opts = [Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64),
                torch.optim.AdamW(adam, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in opts]
    for step in range(steps):
        _, loss = model(*global_batch(step, 2 if step < split else 4, cfg))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ non-finite step: discard_step
def _discard_nonfinite() -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    ledger = CommLedger()
    opt = _make_opt(model, "muon", Comm(ledger=ledger), module=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    _train_steps(model, opt, sched, range(1), cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = opt.full_state_dict()
    x, y = random_batch(1, rank, BATCH, cfg)
    ledger.mark_step()
    loss = model(x, y)[1] * (float("nan") if rank == 1 else 1.0)  # one rank goes non-finite
    loss.backward()
    norm = opt.clip_grad_norm(MAX_NORM)  # global: NaN on every rank
    skipped = not bool(torch.isfinite(norm))
    if skipped:
        opt.discard_step()
    else:
        opt.step()
    rs = len(ledger.select(op="reduce_scatter", records=ledger.step_records()))
    ag = len(ledger.select(op="all_gather", records=ledger.step_records()))
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    state_after = opt.full_state_dict()
    same_state = all(torch.equal(v, state_after["state"][i][k]) for i, st in state_before["state"].items()
                     for k, v in st.items())
    grads_none = all(p.grad is None for p in model.parameters())
    _train_steps(model, opt, sched, range(1, 2), cfg)  # and training goes on, in step on every rank
    return {"skipped": skipped, "unchanged": unchanged, "same_state": same_state, "grads_none": grads_none,
            "rs": rs, "ag": ag, "units": len(opt.units)}


def test_nonfinite_step_is_discarded_on_every_rank() -> None:
    """A NaN loss on one rank makes the global clip norm NaN on every rank; discard_step then drops the
    step everywhere: reduce-scatters waited for (one per unit, none left in flight), no parameter
    all-gather, parameters and state unchanged, grads cleared, and the next step runs normally."""
    for r in run_ranks(_discard_nonfinite, 2):
        assert r["skipped"] and r["unchanged"] and r["same_state"] and r["grads_none"]
        assert r["rs"] == r["units"] and r["ag"] == 0
