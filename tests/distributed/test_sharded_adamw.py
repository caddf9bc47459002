"""Sharded AdamW on 1, 2 and 4 gloo ranks against single-process ``torch.optim.AdamW`` on the
concatenated global batch: values, collective counts, exact wire bytes, state bytes, state dicts.

The harness (``train_and_compare``) is shared with ``test_sharded_muon.py``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.optim import Muon, ShardedAdamW, ShardedMuon, ShardedOptimizer, split_params_for_muon
from lowband.testing import DistributedTestError, run_ranks

VOCAB, DIM, HID, SEQ, BATCH = 11, 6, 8, 3, 12


class TinyModel(nn.Module):
    """Embedding, a frozen linear, five hidden linears (shapes 8x6, 3 x 8x8, 6x8), a head and an
    unused parameter. Built from a fixed seed, identically on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.l1 = nn.Linear(DIM, HID)
        self.l2 = nn.Linear(HID, HID)
        self.l3 = nn.Linear(HID, HID)
        self.l4 = nn.Linear(HID, HID)
        self.l5 = nn.Linear(HID, DIM)
        self.unused = nn.Parameter(torch.randn(5))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(idx))
        h = torch.tanh(self.l1(x))
        h = h + torch.tanh(self.l2(h))
        h = h + torch.tanh(self.l3(h))
        h = h + torch.tanh(self.l4(h))
        return self.head(x + self.l5(h))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx, tgt


def loss_fn(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), tgt.reshape(-1))


def adamw_groups(model: TinyModel) -> list[dict]:
    """Two AdamW groups with different lr / weight decay; the frozen layer stays in group 1."""
    g0 = [model.embed.weight, model.head.weight]
    ids = {id(p) for p in g0}
    g1 = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": g0, "lr": 1e-2, "weight_decay": 0.1}, {"params": g1, "lr": 2e-2, "weight_decay": 0.0}]


MUON_KW = dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.05, adamw_lr=1e-2, adamw_betas=(0.9, 0.95),
               adamw_eps=1e-8, adamw_weight_decay=0.1)


def make_sharded(model: TinyModel, cfg: dict, comm: Comm) -> ShardedOptimizer:
    kw = dict(comm=comm, bucket_mb=cfg["bucket_mb"], grad_wire_dtype=cfg.get("wire"),
              param_wire_dtype=cfg.get("param_wire"),
              param_gather=cfg.get("param_gather", "step"),
              module=model if cfg.get("param_gather") == "forward" else None)
    if cfg["algo"] == "adamw":
        return ShardedAdamW(adamw_groups(model), betas=(0.9, 0.95), **kw)
    muon, adam = split_params_for_muon(model)
    return ShardedMuon(muon, adam, ns_method=cfg.get("ns_method", "ns5"), ns_dtype=cfg["ns_dtype"],
                       **MUON_KW, **kw)


def make_reference(model: TinyModel, cfg: dict) -> list[torch.optim.Optimizer]:
    if cfg["algo"] == "adamw":
        return [torch.optim.AdamW(adamw_groups(model), betas=(0.9, 0.95), foreach=False)]
    muon, adam = split_params_for_muon(model)
    kw = MUON_KW
    return [Muon(muon, lr=kw["lr"], momentum=kw["momentum"], nesterov=kw["nesterov"],
                 weight_decay=kw["weight_decay"], ns_method=cfg.get("ns_method", "ns5"), ns_dtype=cfg["ns_dtype"]),
            torch.optim.AdamW(adam, lr=kw["adamw_lr"], betas=kw["adamw_betas"], eps=kw["adamw_eps"],
                              weight_decay=kw["adamw_weight_decay"], foreach=False)]


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def train_and_compare(cfg: dict) -> dict:
    """Per rank: train the sharded optimizer and the single-process reference side by side.

    cfg keys: algo ("adamw"|"muon"), dtype, bucket_mb, wire, micro (microbatches), clip (max norm or
    None), steps, ns_dtype/ns_method (muon), param_gather.
    """
    dtype = getattr(torch, cfg["dtype"])
    if "ns_dtype" in cfg and isinstance(cfg["ns_dtype"], str):
        cfg = dict(cfg, ns_dtype=getattr(torch, cfg["ns_dtype"]))
    torch.set_default_dtype(dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    n = dist.get_world_size() if dist.is_initialized() else 1
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    model = TinyModel()
    opt = make_sharded(model, cfg, comm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ref = TinyModel()
    ref_opts = make_reference(ref, cfg)
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in ref_opts]
    construction_records = [(r.op, r.tag, r.numel, r.wire_bytes) for r in ledger.records]
    ledger.mark_step()
    out: dict = {"steps": [], "norms": [], "ref_norms": [], "rs_before_step": []}
    micro = cfg.get("micro", 1)
    for step in range(cfg.get("steps", 5)):
        idx, tgt = batch(step)
        rows = BATCH // n
        li, lt = idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]
        mrows = rows // micro
        for k in range(micro):
            ctx = opt.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(model, li[k * mrows:(k + 1) * mrows], lt[k * mrows:(k + 1) * mrows]) / micro).backward()
            if k < micro - 1:
                assert not ledger.select(op="reduce_scatter", records=ledger.step_records()), \
                    "no_sync must not communicate"
        out["rs_before_step"].append(len(ledger.select(op="reduce_scatter", records=ledger.step_records())))
        if cfg.get("clip") is not None:
            out["norms"].append(opt.clip_grad_norm(cfg["clip"]).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        recs = ledger.step_records()
        out["steps"].append({
            "rs": [(r.tag, r.numel, r.wire_dtype, r.wire_bytes) for r in recs if r.op == "reduce_scatter"],
            "ag": [(r.tag, r.numel, r.wire_dtype, r.wire_bytes) for r in recs if r.op == "all_gather"],
            "ar": [(r.tag, r.numel, r.wire_bytes) for r in recs if r.op == "all_reduce"],
            "ar_async": [r.async_op for r in recs if r.op == "all_reduce"],
            "other": [r.op for r in recs if r.op not in ("reduce_scatter", "all_gather", "all_reduce")],
        })
        ledger.mark_step()
        # reference: full global batch on one process
        loss_fn(ref, idx, tgt).backward()  # ``unused`` keeps grad None: torch leaves it untouched
        if cfg.get("clip") is not None:
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.requires_grad], cfg["clip"]).item())
        for o, s in zip(ref_opts, ref_scheds):
            o.step()
            s.step()
            o.zero_grad()
    opt.wait_for_params()
    out["param_err"] = max(_rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    out["param_norm_err"] = max(((p.double() - q.double()).norm() / q.double().norm()).item()
                                for p, q in zip(model.parameters(), ref.parameters()))
    out["param_abs_err"] = max((p.double() - q.double()).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters()))
    out["frozen_unchanged"] = torch.equal(model.frozen.weight, TinyModel().frozen.weight)
    out["bf16_representable"] = all(torch.equal(p, p.bfloat16().to(p.dtype)) for p in model.parameters()
                                    if p.requires_grad)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if dist.is_initialized():
        everyone = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(everyone, flat)
        out["params_equal_across_ranks"] = all(torch.equal(e, flat) for e in everyone)
    # full state vs the reference optimizers' state, by parameter
    full = opt.full_state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    ref_params = dict(zip((id(p) for p in model.parameters()), ref.parameters()))
    state_err = 0.0
    n_state = 0
    ref_state = {}
    for o in ref_opts:
        ref_state.update(o.state)
    # every parameter torch holds state for has it here; one torch never stepped has none (AdamW), or
    # what torch's first step would start from (zero momentum in a Muon unit that did step; step 0 and
    # zero moments next to an fp32 master, which exists from the unit's first step)
    assert {id(ref_params[id(p)]) for p in params if ref_params[id(p)] in ref_state} <= \
        {id(ref_params[id(params[i])]) for i in full["state"]}
    for i, st in full["state"].items():
        rp = ref_params[id(params[i])]
        if rp not in ref_state:
            assert set(st) in ({"momentum_buffer"}, {"momentum_buffer", "master"},
                               {"step", "exp_avg", "exp_avg_sq", "master"}), (i, st)
            assert all(not v.any() for k, v in st.items() if k != "master"), (i, st)
            continue
        rst = ref_state[rp]
        for k, v in st.items():
            if k == "master":  # fp32 master of a bf16 gather: no torch counterpart (checked elsewhere)
                continue
            if k == "step":
                assert float(v) == float(rst["step"]), (k, v, rst["step"])
            else:
                state_err = max(state_err, (v.double() - rst[k].double()).abs().max().item())
                n_state += 1
    out["state_err"] = state_err
    out["n_state_tensors"] = n_state
    out["state_bytes"] = opt.state_bytes()
    # units holding nothing but ``unused`` (never used on any rank): no moments until a first use
    out["never_used_units"] = [ui for ui, u in enumerate(opt.units)
                               if all(params[m.index] is model.unused for m in u.members)]
    out["units"] = [(u.kind, u.numel, u.shard_numel, u.matrix_shape, u.real_per_rank) for u in opt.units]
    out["gather_order"] = opt.gather_order
    out["construction_records"] = construction_records
    out["rank"], out["world"] = rank, n
    return out


def esize(name: str) -> int:
    return torch.empty((), dtype=getattr(torch, name)).element_size()


# flags of the per-step all-reduce: one level per trainable parameter (13), one flag per parameter
# left out of the units (the frozen layer's weight and bias), 8 bytes per param group (its hyperparameters'
# 4-byte digest and complement; adamw_groups makes 2 groups), and 4 trailing bytes (GradScaler factor
# as max and min codes, "a reduced shard is not finite", "a late gradient copy with no factor seen"), uint8
N_USED_FLAGS = 13 + 2 + 8 * 2 + 4


def check_ledger(results: list[dict], dtype: str, wire: str | None, clip: bool,
                 param_wire: str | None = None) -> None:
    """One RS and one AG per unit per step, exact ring-model bytes; on N > 1 ranks one all-reduce of
    the uint8 used flags (``grad_used``, after the last RS completed, so before the norm); one
    scalar all-reduce if clipping, issued asynchronously right behind the flags' (no round trip of its own)."""
    pw = param_wire or dtype
    for res in results:
        n = res["world"]
        units = res["units"]
        w = wire or dtype
        # the one agree() all_gather_object, then init_sync: one broadcast per unit (its flat parameter
        # buffer) and one coalesced broadcast of the frozen layer (weight 6x6 + bias 6), nothing else
        recs = res["construction_records"]
        assert recs[0][:2] == ("all_gather_object", "validate")
        if n == 1:
            assert len(recs) == 1
        else:
            es = esize(dtype)
            expect = [("broadcast", "init_sync", numel, (n - 1) * numel * es // n) for _k, numel, *_ in units]
            expect.append(("broadcast", "init_sync", DIM * DIM + DIM, (n - 1) * (DIM * DIM + DIM) * es // n))
            assert recs[1:] == expect, recs
        for st in res["steps"]:
            assert len(st["rs"]) == len(units) and len(st["ag"]) == len(units)
            assert st["other"] == []
            # reduce-scatters in unit (backward) order, parameter all-gathers in forward order
            assert sorted(res["gather_order"]) == list(range(len(units)))
            for (kind, numel, *_), rs in zip(units, st["rs"], strict=True):
                assert rs == (f"grad:{kind}", numel, w, (n - 1) * numel * esize(w) // n)
            for ui, ag in zip(res["gather_order"], st["ag"], strict=True):
                kind, numel = units[ui][:2]
                assert ag == (f"param:{kind}", numel, pw, (n - 1) * numel * esize(pw) // n)
            acc = 8 if dtype == "float64" else 4
            used = [("grad_used", N_USED_FLAGS, 2 * (n - 1) * N_USED_FLAGS // n)] if n > 1 else []
            assert st["ar"] == used + ([("grad_norm", 1, 2 * (n - 1) * acc // n)] if clip else [])
            if n > 1 and clip:  # the norm's all-reduce is issued behind the flags', both in flight at once
                assert st["ar_async"] == [True, True]


def _expected_adamw_state_bytes(units: list, n: int, acc_bytes: int, never_used: list[int] = ()) -> int:
    """exp_avg + exp_avg_sq of the owned shard of every AdamW unit but those never used."""
    return sum(2 * numel // n * acc_bytes for ui, (kind, numel, *_) in enumerate(units)
               if kind == "adamw" and ui not in never_used)


def _hand_adamw_units_one_bucket(n: int) -> list[int]:
    """Padded numel of each AdamW bucket when one bucket holds a whole group (computed by hand)."""
    g0 = VOCAB * DIM + VOCAB * DIM  # embed + head
    g1 = (DIM * HID + HID) + 3 * (HID * HID + HID) + (HID * DIM + DIM) + 5  # l1..l5 + unused (frozen excluded)
    return sorted([math.ceil(g0 / n) * n, math.ceil(g1 / n) * n])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_adamw_fp64_matches_torch(world: int) -> None:
    """Groups, frozen + unused params, 3 microbatches, clipping, LambdaLR, small buckets (a bucket
    boundary and shard boundaries cut through parameters); 5 steps; 1e-10."""
    cfg = dict(algo="adamw", dtype="float64", bucket_mb=200 / 2**20, micro=3, clip=0.05, steps=5)
    res = run_ranks(train_and_compare, world, cfg)
    for r in res:
        assert r["param_err"] < 1e-10, r["param_err"]
        assert r["state_err"] < 1e-10, r["state_err"]
        assert r["n_state_tensors"] == 2 * 12  # exp_avg + exp_avg_sq for the 12 trainable params used
        assert r["frozen_unchanged"]
        assert len(r["units"]) > 2
        assert r["state_bytes"] == _expected_adamw_state_bytes(r["units"], world, 8, r["never_used_units"])
        # clipping happened at least once and the sharded norm equals torch's
        assert max(r["ref_norms"]) > cfg["clip"]
        for a, b in zip(r["norms"], r["ref_norms"]):
            assert abs(a - b) <= 1e-12 * b
        # the last microbatch's backward launched reduce-scatters before step(); the bucket holding
        # the unused parameter (and every later one) waits for step(), so not all of them
        assert 0 < r["rs_before_step"][0] < len(r["units"])
    check_ledger(res, "float64", None, clip=True)
    assert all(r["units"] == res[0]["units"] for r in res)


@pytest.mark.parametrize("world", [2, 4])
def test_adamw_one_bucket_per_group_bytes_and_state(world: int) -> None:
    """Large buckets: one per group; padded sizes, bytes and state bytes against hand-computed counts."""
    cfg = dict(algo="adamw", dtype="float64", bucket_mb=25.0, micro=1, clip=None, steps=2)
    res = run_ranks(train_and_compare, world, cfg)
    hand = _hand_adamw_units_one_bucket(world)
    for r in res:
        assert sorted(numel for _, numel, *_ in r["units"]) == hand
        assert r["state_bytes"] == sum(2 * (x // world) * 8 for x in hand)
        assert r["param_err"] < 1e-10
        st = r["steps"][0]
        assert sum(b for *_, b in st["rs"]) == sum((world - 1) * x * 8 // world for x in hand)
        assert sum(b for *_, b in st["ag"]) == sum((world - 1) * x * 8 // world for x in hand)
    check_ledger(res, "float64", None, clip=False)


# bf16 gradient wire, the documented bound (docs/sharded_optim.md): each rank's gradient is rounded
# to bf16 (round to nearest, 8 significant bits: relative error <= 2^-8) and the owner sums in fp32, so every element of
# the averaged gradient satisfies |g_bf16 - g_exact| <= (2^-8 + 2^-22) * mean_r |g_r|. AdamW divides
# by sqrt(v), so where the averaged gradient nearly cancels across ranks a parameter can move up to
# ~lr per step differently; the parameter bound is therefore |dp| <= 2 * sum_t lr_t (loose; the
# measured error after 5 steps is ~2 * lr_max at N=4).
BF16_GRAD_REL_BOUND = 2.0**-8 + 2.0**-22


def _bf16_wire_grad_error() -> float:
    """max over elements of |g_bf16 - g_exact| / ((2^-8 + 2^-22) * mean_r |g_r|) (<= 1 required)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyModel()
    opt = ShardedAdamW(adamw_groups(model), bucket_mb=200 / 2**20, grad_wire_dtype="bf16")
    idx, tgt = batch(0)
    rows = BATCH // n
    loss_fn(model, idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]).backward()
    opt._launch_remaining()
    worst = 0.0
    for unit in opt._units:
        opt._reduce(unit)
        parts = [torch.empty_like(unit.grad_buf) for _ in range(n)]
        dist.all_gather(parts, unit.grad_buf)
        lo, hi = unit.layout.owner_range(rank)
        local = torch.stack([p[lo:hi].double() for p in parts])
        exact = local.mean(0)
        scale = BF16_GRAD_REL_BOUND * local.abs().mean(0)
        err = (unit.grad_shard.double() - exact).abs()
        assert bool((err[scale == 0] == 0).all())
        if bool((scale > 0).any()):
            worst = max(worst, (err[scale > 0] / scale[scale > 0]).max().item())
    return worst


FP32_U = 2.0**-24  # unit roundoff of float32


def fp32_param_bound(steps: int, terms: int) -> float:
    """Bound on the max-relative parameter difference between two fp32 runs that sum the same
    gradient terms in different orders (sharded vs single process). A sum of ``terms`` fp32 numbers
    in any order is within ``(terms - 1) * u * sum|x_i|`` of the exact sum; AdamW's update is
    scale-invariant in the gradient (m / sqrt(v)), so a relative gradient error moves each update by at
    most that relative amount of ``lr`` (<= |p|max here: TinyModel's parameters, biases included,
    start at O(0.1..1)), and the errors of ``steps`` steps add up. This assumes sums that are not
    dominated by cancellation (condition sum|x| / |sum x| of order 1, true on average for these random
    batches); measured here (avx512, avx2, default): 1.6e-7..1.6e-6 against 1.2e-5..1.3e-5."""
    return steps * terms * FP32_U


@pytest.mark.parametrize("world", [2, 4])
def test_adamw_fp32_and_bf16_wire(world: int) -> None:
    cfg = dict(algo="adamw", dtype="float32", bucket_mb=200 / 2**20, micro=3, clip=0.05, steps=5)
    res = run_ranks(train_and_compare, world, cfg)
    # terms per gradient element: BATCH * SEQ token contributions, the microbatch sum and the rank average
    bound = fp32_param_bound(cfg["steps"], BATCH * SEQ + cfg["micro"] + world)
    for r in res:
        assert r["param_err"] < bound, (r["param_err"], bound)
    check_ledger(res, "float32", None, clip=True)
    cfg_bf16 = dict(cfg, wire="bfloat16")
    res16 = run_ranks(train_and_compare, world, cfg_bf16)
    lr_sum = sum(2e-2 * lr_lambda(t) for t in range(5))
    for r in res16:
        assert 0 < r["param_abs_err"] <= 2 * lr_sum, r["param_abs_err"]
    check_ledger(res16, "float32", "bfloat16", clip=True)
    # bf16 gradients: reduce-scatter bytes exactly half of fp32
    rs32 = sum(b for *_, b in res[0]["steps"][0]["rs"])
    rs16 = sum(b for *_, b in res16[0]["steps"][0]["rs"])
    assert rs16 * 2 == rs32
    worst = run_ranks(_bf16_wire_grad_error, world)
    assert 0 < max(worst) <= 1.0, worst


@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_bf16_param_gather_with_fp32_master(algo: str) -> None:
    """param_wire_dtype=bf16: gathers move half the bytes, every rank computes with the same
    bf16-rounded parameters, the owner's fp32 master keeps the update precise (within the bf16
    wire bound of the fp32 run); the master is optimizer state (1/N of the parameters)."""
    cfg = dict(algo=algo, dtype="float32", ns_dtype="bfloat16", bucket_mb=200 / 2**20, micro=1, clip=0.05,
               steps=5, wire="bfloat16", param_wire="bfloat16")
    res = run_ranks(train_and_compare, 2, cfg)
    lr_sum = sum(3e-2 * lr_lambda(t) for t in range(5))
    for r in res:
        assert r["bf16_representable"] and r["params_equal_across_ranks"]
        assert 0 < r["param_abs_err"] <= 2 * lr_sum, r["param_abs_err"]
    check_ledger(res, "float32", "bfloat16", clip=True, param_wire="bfloat16")
    units = res[0]["units"]
    fp32 = run_ranks(train_and_compare, 2, dict(cfg, wire=None, param_wire=None))
    for rank, (r, r32) in enumerate(zip(res, fp32)):
        master = sum(numel // 2 * 4 for kind, numel, *_ in units if kind == "adamw") + sum(
            real[rank] * shape[0] * shape[1] * 4 for kind, _, _, shape, real in units if kind == "muon")
        # a unit never used has no moments in the fp32 run, but with masters its first step creates
        # the master and with it the (zero) moments
        late = _expected_adamw_state_bytes(units, 2, 4) - _expected_adamw_state_bytes(
            units, 2, 4, r["never_used_units"])
        assert r32["never_used_units"] == r["never_used_units"]
        assert r["state_bytes"] == r32["state_bytes"] + master + late


@pytest.mark.parametrize("world", [1, 2])
def test_adamw_param_gather_forward(world: int) -> None:
    """Lazy all-gather waits (forward pre-hooks) give the same result."""
    cfg = dict(algo="adamw", dtype="float64", bucket_mb=200 / 2**20, micro=1, clip=None, steps=3,
               param_gather="forward")
    for r in run_ranks(train_and_compare, world, cfg):
        assert r["param_err"] < 1e-10


# ------------------------------------------------------------------------------ state dicts
def _resume(full_state: dict | None, params: list | None, steps: tuple[int, int]) -> dict:
    """Train steps[0]..steps[1] from (params, full optimizer state); return both at the end."""
    torch.set_default_dtype(torch.float64)
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyModel()
    if params is not None:
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
    opt = ShardedAdamW(adamw_groups(model), betas=(0.9, 0.95), bucket_mb=200 / 2**20)
    if full_state is not None:
        opt.load_full_state_dict(full_state)
    for step in range(*steps):
        idx, tgt = batch(step)
        rows = BATCH // n
        loss_fn(model, idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
    local = opt.shard_state_dict()
    # local round trip: a fresh optimizer loading this rank's shard reproduces it
    opt2 = ShardedAdamW(adamw_groups(TinyModel()), betas=(0.9, 0.95), bucket_mb=200 / 2**20)
    opt2.load_shard_state_dict(local)
    same = all(torch.equal(opt2.state[u][k], opt.state[u][k]) for u in opt.state for k in ("exp_avg", "exp_avg_sq"))
    return {"params": [p.detach().clone() for p in model.parameters()], "full": opt.full_state_dict(),
            "local_roundtrip": same and all(opt2.state[u]["steps"] == opt.state[u]["steps"] for u in opt.state)}


def _reference_adamw(steps: int) -> tuple[list, dict]:
    torch.set_default_dtype(torch.float64)
    model = TinyModel()
    opt = torch.optim.AdamW(adamw_groups(model), betas=(0.9, 0.95), foreach=False)
    for step in range(steps):
        loss_fn(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def test_full_state_reshards_2_to_4_and_matches_torch() -> None:
    """3 steps on 2 ranks, full state -> 4 ranks, 2 more steps == 5 torch AdamW steps (1e-10); the
    full state dict is torch.optim.AdamW-compatible both ways."""
    first = run_ranks(_resume, 2, None, None, (0, 3))
    assert all(r["local_roundtrip"] for r in first)
    second = run_ranks(_resume, 4, first[0]["full"], first[0]["params"], (3, 5))
    ref_params, ref_state = _reference_adamw(5)
    for r in second:
        for p, q in zip(r["params"], ref_params):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)
        assert set(r["full"]["state"]) == set(ref_state["state"])  # ``unused`` has no state in either
        for i, st in r["full"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(st[k], ref_state["state"][i][k], rtol=1e-10, atol=1e-12)
            assert float(st["step"]) == 5.0
    # a torch.optim.AdamW state dict loads into the sharded optimizer (2 ranks) and continues
    third = run_ranks(_resume, 2, ref_state, ref_params, (5, 6))
    ref6, _ = _reference_adamw(6)
    for p, q in zip(third[0]["params"], ref6):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)


def _lr0_zero_grads_is_noop() -> bool:
    """What DCP's get_optimizer_state_dict does to a fresh optimizer: zero grads, lr 0, step()."""
    model = TinyModel()
    before = [p.detach().clone() for p in model.parameters()]
    opt = ShardedAdamW(adamw_groups(model), weight_decay=0.1, bucket_mb=200 / 2**20)
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step(closure=None)
    model2 = TinyModel()
    m2, a2 = split_params_for_muon(model2)
    opt2 = ShardedMuon(m2, a2, lr=0.0, adamw_lr=0.0, weight_decay=0.1, adamw_weight_decay=0.1)
    for p in model2.parameters():
        p.grad = torch.zeros_like(p)
    opt2.step(closure=None)
    return (all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            and all(torch.equal(a, p) for a, p in zip(before, model2.parameters())))


def test_lr0_zero_grad_step_changes_nothing() -> None:
    assert all(run_ranks(_lr0_zero_grads_is_noop, 2))


def _closure_step() -> float:
    torch.set_default_dtype(torch.float64)
    model = TinyModel()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    rank, n = dist.get_rank(), dist.get_world_size()
    idx, tgt = batch(0)
    rows = BATCH // n

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(model, idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows])
        loss.backward()
        return loss

    loss = opt.step(closure)
    ref = TinyModel()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    loss_fn(ref, idx, tgt).backward()
    ropt.step()
    assert loss.requires_grad is False or loss.grad_fn is not None
    return max(_rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_step_with_closure() -> None:
    assert max(run_ranks(_closure_step, 2)) < 1e-10


# ------------------------------------------------------------------------------- bad input
def _bad_inputs() -> list[str]:
    """Each bad input raises ValueError before any collective (ledger stays empty)."""
    msgs = []
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    model = TinyModel()
    cases = [
        lambda: ShardedAdamW(model.parameters(), comm=comm, bucket_mb=0),
        lambda: ShardedAdamW(model.parameters(), comm=comm, bucket_mb=-1.0),
        lambda: ShardedAdamW([{"params": [model.l1.weight]}, {"params": [model.l1.weight, model.l2.weight]}],
                             comm=comm),
        lambda: ShardedOptimizer([{"params": [model.l1.bias], "algorithm": "muon"}], comm=comm),
        lambda: ShardedMuon([nn.Parameter(torch.zeros(2, 3, 4))], [], comm=comm),
        lambda: ShardedAdamW(model.parameters(), lr=-1.0, comm=comm),
        lambda: ShardedAdamW(model.parameters(), comm=comm, grad_wire_dtype=torch.float16),
        lambda: ShardedAdamW(model.parameters(), comm=comm, param_gather="later"),
        lambda: ShardedOptimizer(model.parameters(), comm=comm, algorithm="sgd"),
    ]
    for case in cases:
        try:
            case()
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("NO ERROR")
    assert ledger.records == [], ledger.records
    return msgs


def _rank_dependent_model() -> str:
    """Parameters that differ between ranks: the construction-time agree() raises on every rank."""
    rank = dist.get_rank()
    params = [nn.Parameter(torch.zeros(3 + rank)), nn.Parameter(torch.zeros(2))]
    try:
        ShardedAdamW(params)
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def test_bad_input_raises_before_any_collective() -> None:
    res = run_ranks(_bad_inputs, 2)
    assert res[0] == res[1]
    expect = ["bucket_mb", "bucket_mb", "appears twice", "muon", "muon", "learning rate", "grad_wire_dtype",
              "param_gather", "algorithm"]
    for msg, key in zip(res[0], expect):
        assert key in msg, (key, msg)
    res = run_ranks(_rank_dependent_model, 2)
    assert all("differs between ranks" in m for m in res), res


def test_single_process_without_distributed() -> None:
    """Works with torch.distributed uninitialized (1-rank Comm)."""
    cfg = dict(algo="adamw", dtype="float64", bucket_mb=200 / 2**20, micro=3, clip=0.05, steps=3)
    try:
        r = train_and_compare(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    assert r["param_err"] < 1e-10 and r["world"] == 1


def test_second_backward_after_launch_is_a_clear_error() -> None:
    with pytest.raises(DistributedTestError, match="no_sync"):
        run_ranks(_bad_step_twice, 1)


def _bad_step_twice() -> None:
    """A second backward without no_sync after a bucket launched is a clear RuntimeError."""
    model = TinyModel()
    opt = ShardedAdamW(model.parameters(), bucket_mb=25.0)
    idx, tgt = batch(0)
    model.unused.sum().mul(0).backward()  # unused gets a grad -> every bucket can launch
    loss_fn(model, idx, tgt).backward()
    loss_fn(model, idx, tgt).backward()
    opt.step()


# ------------------------------------------------------------------------- trainer strategies
@pytest.mark.parametrize("world", [2])
def test_trainer_sharded_adamw_equals_single(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``strategy.name = sharded-adamw`` in the trainer (2 microbatches, clipping, warmup + cosine,
    weight decay) equals the ``single`` strategy on the concatenated batch; wire bytes are
    DDP's all-reduce plus bucket padding and the norm scalar; sharded-muon runs (identical params on
    every rank)."""
    import numpy as np

    from lowband.data import write_shard
    from tests.distributed.test_trainer import _train_and_return_params, tiny_config

    path = tmp_path_factory.mktemp("data") / "train.bin"
    write_shard(path, np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.uint16))
    ref = run_ranks(_train_and_return_params, 1, tiny_config(str(path), 1, "single", 2 * world, accum=2))[0]
    out = run_ranks(_train_and_return_params, world, tiny_config(str(path), world, "sharded-adamw", 2, accum=2))
    for rank_out in out:
        for k, v in ref["params"].items():
            torch.testing.assert_close(rank_out["params"][k], v, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rank_out["losses"], ref["losses"], rtol=1e-10)
        nparams = sum(v.numel() for v in ref["params"].values())
        ddp = 2 * (world - 1) * nparams * 8 // world
        # RS + AG over buckets padded to a multiple of N, plus one fp64 scalar all-reduce
        assert all(ddp <= w <= ddp + 8 * world * 8 + 16 for w in rank_out["wire"]), (rank_out["wire"], ddp)
    muon = run_ranks(_train_and_return_params, world, tiny_config(str(path), world, "sharded-muon", 2, accum=2))
    assert all(np.isfinite(m["losses"]).all() for m in muon)
    for k in muon[0]["params"]:
        assert torch.equal(muon[0]["params"][k], muon[1]["params"][k])


# ------------------------------------------------------------------ init_sync: parameters and buffers
def _init_sync_buffers() -> dict:
    """Per-rank weights, a frozen parameter and buffers (BatchNorm running stats, an int64 counter)."""
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    model[2].bias.requires_grad_(False)
    with torch.no_grad():
        model[1].running_mean.add_(rank)
        model[1].num_batches_tracked.fill_(7 + rank)
    ledger = CommLedger()
    opt = ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), module=model)
    recs = [(r.op, r.numel, str(r.wire_dtype)) for r in ledger.select(tag="init_sync")]
    flat = torch.cat([t.detach().double().reshape(-1) for t in [*model.parameters(), *model.buffers()]])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return {"equal": all(torch.equal(e, everyone[0]) for e in everyone), "recs": recs,
            "units": [u.numel for u in opt.units], "counter": int(model[1].num_batches_tracked)}


@pytest.mark.parametrize("world", [2, 4])
def test_init_sync_broadcasts_parameters_and_buffers(world: int) -> None:
    for r in run_ranks(_init_sync_buffers, world):
        assert r["equal"] and r["counter"] == 7  # rank 0's values everywhere
        # one broadcast per unit, then one coalesced broadcast per dtype of the rest: the frozen bias
        # (3) + running_mean/var (6 + 6) in float32, num_batches_tracked (1) in int64
        assert r["recs"] == [("broadcast", n, "float32") for n in r["units"]] + [
            ("broadcast", 3 + 6 + 6, "float32"), ("broadcast", 1, "int64")]


def _gather_launch_order() -> dict:
    comm = Comm(ledger=CommLedger())
    model = TinyModel()
    opt = ShardedAdamW(adamw_groups(model), comm=comm, bucket_mb=200 / 2**20, module=model, param_gather="forward")
    idx, tgt = batch(0)
    loss_fn(model, idx, tgt).backward()
    opt.step()
    gathers = [r.numel for r in comm.ledger.records if r.op == "all_gather" and r.tag.startswith("param")]
    opt.wait_for_params()
    # the sharded optimizer's private Comm: gloo reduce-scatters and all-gathers as receive-first exchanges
    # (these units' chunks are below one ring piece, so at 4 ranks too; tests/distributed/test_sharded_ring.py
    # has units on the ring)
    algos = {(r.op, r.algorithm) for r in comm.ledger.records if r.tag.startswith(("grad:", "param:"))}
    assert algos == {("reduce_scatter", "p2p+sum"), ("all_gather", "p2p")}, algos
    # each unit's first member in the module's registration order
    position = {id(p): i for i, p in enumerate(model.parameters())}
    layouts = opt.units
    params = [p for g in opt.param_groups for p in g["params"]]
    first = [min(position[id(params[m.index])] for m in lay.members) for lay in layouts]
    return {"gathers": gathers, "units": [(f, lay.numel) for f, lay in zip(first, layouts, strict=True)]}


@pytest.mark.parametrize("world", [2, 4])
def test_parameter_gathers_are_launched_in_forward_order(world: int) -> None:
    """Units are built in backward order (last layer first); step() gathers them in the module's order, so the
    next forward's first pre-hook (the embedding's) waits for the first gather, not for all of them."""
    for r in run_ranks(_gather_launch_order, world):
        units = r["units"]
        assert len(units) >= 4 and [f for f, _ in units] != sorted(f for f, _ in units)  # built for backward
        assert r["gathers"] == [numel for _f, numel in sorted(units)]
