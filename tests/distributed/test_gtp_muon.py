"""Muon on GTP-sharded weights (lowband/optim/gtp_muon.py) on 2 and 4 gloo ranks (gtp 2, gtp 4 and
dp 2 x gtp 2) against single-device ``lowband.optim.muon.Muon`` + ``torch.optim.AdamW`` on the unsharded
model and the global batch: 3 steps with global-norm clipping and a LambdaLR.

Tolerances: float64 everywhere (Newton-Schulz too: ``ns_dtype=float64``). The GTP gradient is a
reduce-scatter of per-lane wgrads, the reference's an accumulation over the global batch: the same
terms summed in another order, relative O(k eps64) with k <= 10^3 (<= 2e-13). Newton-Schulz is five
quintic iterations on a normalized matrix (entries O(1), condition of the polynomial map O(10)),
so it propagates that to O(1e-12) in ``O``; AdamW maps gradient perturbations to parameter changes of
lr * O(k eps). Three steps stay far below the project's float64 bound of 1e-10, which we use
(parameters and losses). Bitwise where the arithmetic is identical (checkpoint resume).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import default_ledger
from lowband.optim.gtp_muon import GRAD_TAG, UPDATE_TAG, GTPMuon
from lowband.optim.muon import Muon
from lowband.parallel.clip import clip_grad_norm_
from lowband.parallel.gtp import GTPRuntime, reduce_grads, shard_embeddings, shard_linears, sync_replicated_grads
from lowband.parallel.mesh import build_mesh, lane_slice
from lowband.plan import muon_split
from lowband.testing import run_ranks
from lowband.train.optimizers import adamw_param_groups

TOL = 1e-10
STEPS = 3
MUON_LR, LR, WD, MAX_NORM = 0.05, 1e-2, 0.1, 0.05


def _lam(step: int) -> float:
    return 1.0 / (1 + step)


class _Net(nn.Module):
    """Widths 11, 13, 5: no row count divisible by 2 or 4 (padded shards). ``d`` shares ``c``'s weight
    (a linear tied to another linear): GTP keeps both replicated; Muon updates it on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln, self.b = nn.Linear(6, 11), nn.LayerNorm(11), nn.Linear(11, 13)
        self.c, self.d = nn.Linear(13, 13, bias=False), nn.Linear(13, 13, bias=False)
        self.d.weight = self.c.weight
        self.e, self.out = nn.Linear(13, 13), nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.ln(self.a(x)))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.d(torch.tanh(self.c(h))))
        return self.out(torch.tanh(self.e(h)))


def _muon_names(model: nn.Module, plan=None) -> set[str]:
    muon, _ = muon_split(model, plan)
    ids = {id(p) for p in muon}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _groups(model: nn.Module, names: set[str]) -> list[dict]:
    muon = [p for n, p in model.named_parameters() if n in names]
    rest = nn.ParameterList([p for n, p in model.named_parameters() if n not in names])
    return ([{"params": muon, "algorithm": "muon", "lr": MUON_LR, "weight_decay": WD}]
            + [dict(g, algorithm="adamw") for g in adamw_param_groups(rest, WD)])


class _Reference:
    """Single-device Muon (the Muon names) + torch AdamW (the rest), each with the same LambdaLR."""

    def __init__(self, model: nn.Module, names: set[str]) -> None:
        self.muon = Muon([p for n, p in model.named_parameters() if n in names], lr=MUON_LR, weight_decay=WD,
                         ns_dtype=torch.float64)
        rest = nn.ParameterList([p for n, p in model.named_parameters() if n not in names])
        self.adamw = torch.optim.AdamW(adamw_param_groups(rest, WD), lr=LR)
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, _lam) for o in (self.muon, self.adamw)]

    def step(self) -> None:
        for o in (self.muon, self.adamw):
            o.step()
            o.zero_grad(set_to_none=True)
        for s in self.scheds:
            s.step()

    def state_bytes(self, which: str) -> int:
        o = getattr(self, which)
        return sum(t.numel() * t.element_size() for st in o.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))


def _expected_bytes(opt: GTPMuon, rank: int) -> tuple[int, int]:
    """Bytes rank ``rank`` sends in the two all-to-alls of one step, from the shapes and the owners."""
    n = opt.comm.size
    grad = upd = 0
    for p in opt._gtp_params:
        gw = p.gtp
        shard = gw.shard_rows * gw.in_features * 8
        assert gw.shard_rows == -(-gw.out_features // n)
        if opt.owner(p) == rank:
            upd += (n - 1) * shard
        else:
            grad += shard
    return grad, upd


def _library(gtp: int) -> dict:
    """GTPMuon driven by hand on _Net: GTP shards, a replicated tied Muon matrix, LayerNorm and biases."""
    torch.set_default_dtype(torch.float64)
    mesh = build_mesh(gtp=gtp)
    ledger = default_ledger()
    torch.manual_seed(5)
    ref = _Net()
    model = copy.deepcopy(ref)
    names = _muon_names(ref)
    rt = GTPRuntime(mesh.gtp)
    shard_linears(model, rt)  # every rank built the same weights (seed 5)
    assert not hasattr(model.c.weight, "gtp") and model.c.weight is model.d.weight  # tied: replicated
    opt = GTPMuon(_groups(model, names), mesh.gtp, lr=LR, ns_dtype=torch.float64, bucket_mb=400 * 8 / 2**20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lam)
    reference = _Reference(ref, names)
    g = torch.Generator().manual_seed(11)
    counts, sent = [], []
    for _ in range(STEPS):
        x = torch.randn(4 * mesh.shape.num_lanes, 6, generator=g)
        y = torch.randn(x.shape[0], 5, generator=g)
        sl = lane_slice(x.shape[0], mesh.shape, mesh.lane)
        (model(x[sl]) - y[sl]).square().mean().backward()
        sync_replicated_grads(rt, model)
        if mesh.dp.size > 1:
            reduce_grads(mesh.dp, model.parameters(), "avg", tag="grad")
        norm = float(clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM))
        start = len(ledger.records)
        opt.step()
        recs = ledger.records[start:]
        opt.zero_grad(set_to_none=True)
        sched.step()
        counts.append((sum(r.tag == GRAD_TAG for r in recs), sum(r.tag == UPDATE_TAG for r in recs), len(recs)))
        sent.append((sum(r.wire_bytes for r in recs if r.tag == GRAD_TAG),
                     sum(r.wire_bytes for r in recs if r.tag == UPDATE_TAG)))
        (ref(x) - y).square().mean().backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        assert norm > MAX_NORM and norm == pytest.approx(ref_norm, rel=1e-12, abs=0)  # clipping active
        reference.step()
    ref_p = dict(ref.named_parameters())
    diff = 0.0
    for n, p in model.named_parameters():
        full = rt.full_weight(p.gtp) if hasattr(p, "gtp") else p.detach()
        diff = max(diff, (full - ref_p[n].detach()).abs().max().item())
    own_muon = sum(opt.state[p]["momentum_buffer"].numel() * 8 for p in opt._gtp_params
                   if opt.owner(p) == mesh.gtp.rank)
    replicated_muon = 13 * 13 * 8
    adam_bytes = sum(t.numel() * t.element_size() for g_ in opt.param_groups if g_["algorithm"] == "adamw"
                     for p in g_["params"] for t in opt.state[p].values())
    return {"diff": diff, "counts": counts, "sent": sent, "expected": _expected_bytes(opt, mesh.gtp.rank),
            "buckets": len(opt.buckets), "owners": [(b.members, b.owners) for b in opt.buckets],
            "state": opt.state_bytes(), "own_muon": own_muon, "adam_bytes": adam_bytes,
            "replicated_muon": replicated_muon, "ref_muon": reference.state_bytes("muon"),
            "n_gtp": len(opt._gtp_params), "gtp_rank": mesh.gtp.rank}


@pytest.mark.parametrize(("world", "gtp"), [(2, 2), (4, 4), (4, 2)])
def test_gtp_muon_equals_single_device_muon(world: int, gtp: int) -> None:
    res = run_ranks(_library, world, gtp)
    for r in range(world):
        got = res[r]
        assert got["diff"] <= TOL, got["diff"]
        assert got["n_gtp"] == 4  # a, b, e, out (c/d tied: replicated)
        assert got["owners"] == res[0]["owners"]  # the same plan on every rank
        nb = got["buckets"]
        assert nb >= 2  # the 400-element cap cuts the 4 matrices into several buckets
        # one all-to-all of each kind per bucket per step, nothing else
        assert got["counts"] == [(nb, nb, 2 * nb)] * STEPS
        assert got["sent"] == [got["expected"]] * STEPS
        # state: the owned whole momenta + the replicated tied matrix's + AdamW moments and steps
        assert got["state"] == got["own_muon"] + got["replicated_muon"] + got["adam_bytes"]
    for d0 in range(world // gtp):  # the owned Muon momenta partition the GTP matrices' momenta
        group = [res[r] for r in range(d0 * gtp, (d0 + 1) * gtp)]
        assert sum(g["own_muon"] for g in group) == group[0]["ref_muon"] - group[0]["replicated_muon"]


# ------------------------------------------------------------------------------------- OutsideGPT
def _outside(tie: bool) -> dict:
    """OutsideGPT (nanoGPT names, biases, tied or untied head) with per-rank seeds, sharded as a user's
    script does; Muon takes the block linears (its plan: wte/wpe embeddings, the head tied to wte or in
    adamw_only), AdamW the rest (GTP embedding shards included)."""
    from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model
    from tests.external.parallel_ref import BATCH, SEED, lanes_of, reference_step

    cfg = OutsideConfig(tie=tie)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    names = _muon_names(model, outside_plan(model))
    ref = seeded_model(SEED, 0, cfg, torch.float64)  # what init_sync broadcasts
    assert names == _muon_names(ref, outside_plan(ref))
    mesh = build_mesh(gtp=world)
    rt = GTPRuntime(mesh.gtp)
    shard_embeddings(model, rt)
    shard_linears(model, rt)
    opt = GTPMuon(_groups(model, names), mesh.gtp, lr=LR, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lam)
    reference = _Reference(ref, names)
    ledger = default_ledger()
    losses, ref_losses, counts = [], [], []
    for step in range(1, STEPS + 1):
        x, y = random_batch(step, rank, BATCH, cfg)
        _, loss = model(x, y)
        loss.backward()
        sync_replicated_grads(rt, model)
        clip_grad_norm_(model, MAX_NORM)
        start = len(ledger.records)
        opt.step()
        counts.append(sum(r.tag in (GRAD_TAG, UPDATE_TAG) for r in ledger.records[start:]))
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(loss.detach()))
        ref_losses.append(reference_step(ref, step, lanes_of(world), cfg)[rank])
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        reference.step()
    ref_p = dict(ref.named_parameters())
    diff = 0.0
    for n, p in model.named_parameters():
        full = rt.full_weight(p.gtp) if hasattr(p, "gtp") else p.detach()
        diff = max(diff, (full - ref_p[n].detach()).abs().max().item())
    return {"diff": diff, "losses": losses, "ref_losses": ref_losses, "counts": counts,
            "buckets": len(opt.buckets), "n_muon": len(names), "n_gtp_muon": len(opt._gtp_params),
            "head_muon": "lm_head.weight" in names}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_gtp_muon_outside_gpt(world: int, tie: bool) -> None:
    from tests.external.outside_gpt import OutsideConfig

    res = run_ranks(_outside, world, tie)
    n_layer = OutsideConfig().n_layer
    for got in res:
        assert got["diff"] <= TOL, got["diff"]
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=TOL, abs=0)
        assert got["n_muon"] == got["n_gtp_muon"] == 4 * n_layer and not got["head_muon"]
        assert got["counts"] == [2 * got["buckets"]] * STEPS


# ------------------------------------------------------------------------------------- strategy gtp
def _gpt_config(n: int, gtp_size: int, accum: int):
    from lowband.train.config import Config, validate

    cfg = Config()
    cfg.run.world_size, cfg.run.dtype = n, "float64"
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 24, 2, 8
    cfg.model.vocab_size = 259  # lm_head / tok_emb rows pad to a multiple of gtp
    cfg.data.batch_size, cfg.data.grad_accum = 2 * accum, accum
    cfg.optim.weight_decay, cfg.optim.grad_clip = WD, MAX_NORM  # small clip: clipping is active
    cfg.optim.muon_lr, cfg.optim.muon_ns_dtype = MUON_LR, "float64"
    cfg.strategy.name, cfg.gtp.muon_bucket_mb = "gtp", 0.01  # 0.01 MB: several buckets
    cfg.gtp.size, cfg.gtp.optimizer = gtp_size, "muon"
    validate(cfg, n)
    return cfg


def _strategy(gtp_size: int, accum: int) -> dict:
    """Strategy ``gtp`` with ``gtp.optimizer = "muon"`` on lowband's GPT against one process training the
    same GPT on the global batch with Muon (its plan's muon_split) + AdamW."""
    from lowband.train.env import init_distributed
    from lowband.train.strategies import get_strategy_class
    from lowband.train.trainer import build_model

    env = init_distributed("cpu")
    n = env.world_size
    cfg = _gpt_config(n, gtp_size, accum)
    strat = get_strategy_class("gtp")(cfg, env)
    strat.setup(build_model(cfg, env.device))
    assert isinstance(strat.optimizer, GTPMuon) and strat.checkpoint_format() == "gtp-muon-v1"
    ref = build_model(cfg, env.device)
    names = _muon_names(ref, ref.lowband_plan())
    o = cfg.optim
    muon = Muon([p for nm, p in ref.named_parameters() if nm in names], lr=o.muon_lr, momentum=o.muon_momentum,
                weight_decay=o.weight_decay, ns_dtype=torch.float64)
    adamw = torch.optim.AdamW(adamw_param_groups(nn.ParameterList(
        [p for nm, p in ref.named_parameters() if nm not in names]), o.weight_decay), lr=o.lr,
        betas=(o.beta1, o.beta2), eps=o.eps)
    scheds = [torch.optim.lr_scheduler.LambdaLR(x, _lam) for x in (strat.optimizer, muon, adamw)]
    ledger = default_ledger()
    b, mb = cfg.data.batch_size, cfg.data.batch_size // accum
    losses, ref_losses, counts, sent = [], [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        tok = torch.randint(0, 37, (b * n, cfg.model.seq_len + 1), generator=g)
        mine = tok[env.rank * b:(env.rank + 1) * b]
        for m in range(accum):
            with strat.microbatch(last=m == accum - 1):
                loss = strat.model(mine[m * mb:(m + 1) * mb, :-1], mine[m * mb:(m + 1) * mb, 1:])
                (loss / accum).backward()
            glob = torch.cat([tok[r * b + m * mb:r * b + (m + 1) * mb] for r in range(n)])
            ref_loss = ref(glob[:, :-1], glob[:, 1:])
            (ref_loss / accum).backward()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(float(lt) / n)
        ref_losses.append(float(ref_loss))
        strat.clip_grad_norm(o.grad_clip)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), o.grad_clip)
        start = len(ledger.records)
        strat.optimizer_step()
        recs = ledger.records[start:]
        counts.append((sum(r.tag == GRAD_TAG for r in recs), sum(r.tag == UPDATE_TAG for r in recs), len(recs)))
        sent.append((sum(r.wire_bytes for r in recs if r.tag == GRAD_TAG),
                     sum(r.wire_bytes for r in recs if r.tag == UPDATE_TAG)))
        for x in (muon, adamw):
            x.step()
            x.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
    rt = strat.runtime
    ref_p = dict(ref.named_parameters())
    diff = 0.0
    for nm, p in strat.unwrapped().named_parameters():
        full = rt.full_weight(p.gtp) if getattr(p, "gtp", None) is not None else p.detach()
        diff = max(diff, (full - ref_p[nm].detach()).abs().max().item())
    opt = strat.optimizer
    gtp_names = {nm for nm, p in strat.model.named_parameters() if opt.is_gtp_muon(p)}
    ref_muon = sum(t.numel() * 8 for st in muon.state.values() for t in st.values())
    ref_adam = sum(t.numel() * t.element_size() for st in adamw.state.values() for t in st.values())
    return {"diff": diff, "losses": losses, "ref_losses": ref_losses, "counts": counts, "sent": sent,
            "expected": _expected_bytes(opt, strat.mesh.gtp.rank), "buckets": len(opt.buckets),
            "names": names, "gtp_names": gtp_names, "state": strat.optimizer_state_bytes(),
            "own_muon": sum(opt.state[p]["momentum_buffer"].numel() * 8 for p in opt._gtp_params
                            if opt.owner(p) == strat.mesh.gtp.rank),
            "ref_muon": ref_muon, "ref_adam": ref_adam, "gtp": strat.mesh.gtp.size,
            # AdamW on what this rank holds (padded shards of tok_emb / lm_head, whole replicated
            # params): exp_avg + exp_avg_sq in float64 and a float32 step per parameter
            "adam_expected": sum(2 * p.numel() * 8 + 4 for g_ in opt.param_groups if g_["algorithm"] == "adamw"
                                 for p in g_["params"]),
            "largest_muon": max(p.gtp.out_features * p.gtp.in_features * 8 for p in opt._gtp_params)}


@pytest.mark.parametrize(("world", "gtp_size", "accum"), [(2, 0, 1), (4, 2, 2), (4, 4, 1)])
def test_gtp_strategy_with_muon_matches_single_process(world: int, gtp_size: int, accum: int) -> None:
    res = run_ranks(_strategy, world, gtp_size, accum)
    for got in res:
        assert got["diff"] <= TOL, got["diff"]
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=TOL, abs=0)
        # Muon: the 4 block matrices per layer; tok_emb (embedding) and lm_head (adamw_only) are AdamW
        assert len(got["names"]) == 4 * 2 and not any("emb" in n or "lm_head" in n for n in got["names"])
        assert got["gtp_names"] == got["names"]  # every Muon matrix is a GTP shard, routed
        nb = got["buckets"]
        assert nb >= 2 and got["counts"] == [(nb, nb, 2 * nb)] * STEPS
        assert got["sent"] == [got["expected"]] * STEPS
        # state per rank, exact: owned Muon momenta + AdamW on shards and replicated params
        assert got["state"] == got["own_muon"] + got["adam_expected"]
        assert got["state"] < got["ref_muon"] + got["ref_adam"]
        # balanced: no rank owns more than its 1/gtp share plus one matrix
        assert got["own_muon"] <= got["ref_muon"] / got["gtp"] + got["largest_muon"]
    for d0 in range(world // res[0]["gtp"]):
        group = res[d0 * res[0]["gtp"]:(d0 + 1) * res[0]["gtp"]]
        assert sum(g["own_muon"] for g in group) == group[0]["ref_muon"]


# ------------------------------------------------------------------------------------- trainer
class _MuonAdamWReference(torch.optim.Optimizer):
    """Single-device reference for the trainer: ``lowband.optim.muon.Muon`` on the Muon matrices and
    ``torch.optim.AdamW`` on the rest, behind one optimizer whose ``param_groups`` are theirs (so the
    trainer's LambdaLR scales both)."""

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW) -> None:
        super().__init__([p for o in (muon, adamw) for g in o.param_groups for p in g["params"]], {})
        self.inner = (muon, adamw)
        self.param_groups = muon.param_groups + adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for o in self.inner:
            o.step()


def _register_reference_strategy() -> None:
    from lowband.train.strategies import _REGISTRY, register_strategy
    from lowband.train.strategies.base import Strategy

    if "test-muon-reference" in _REGISTRY:
        return

    @register_strategy("test-muon-reference")
    class _Ref(Strategy):
        """One process: the hand-written Muon + AdamW reference (test only)."""

        config_sections = ()
        max_world_size = 1

        def setup(self, model: nn.Module) -> None:
            o = self.cfg.optim
            self.model = model
            names = _muon_names(model, self.model_plan(model))
            muon = Muon([p for n, p in model.named_parameters() if n in names], lr=o.muon_lr,
                        momentum=o.muon_momentum, weight_decay=o.weight_decay, ns_dtype=torch.float64)
            adamw = torch.optim.AdamW(adamw_param_groups(nn.ParameterList(
                [p for n, p in model.named_parameters() if n not in names]), o.weight_decay), lr=o.lr,
                betas=(o.beta1, o.beta2), eps=o.eps)
            self.optimizer = _MuonAdamWReference(muon, adamw)


def _trainer_config(shard: str, world: int, strategy: str = "gtp", gtp_size: int = 0, ckpt_dir: str = "",
                    every: int = 0):
    from tests.distributed.test_checkpoint_gtp import gtp_config

    cfg = gtp_config(shard, world, gtp_size=gtp_size, ckpt_dir=ckpt_dir, every=every)
    cfg.strategy.name, cfg.gtp.muon_bucket_mb = strategy, 0.005
    cfg.gtp.optimizer = "muon"
    cfg.optim.muon_ns_dtype, cfg.optim.muon_lr = "float64", MUON_LR
    return cfg


def _train(cfg, stop_after: int | None = None) -> dict:
    from lowband.train.trainer import train

    _register_reference_strategy()
    res = train(cfg, write_run_dir=False, log=False, stop_after=stop_after)
    s = res.strategy
    if cfg.strategy.name == "gtp":
        sd = s.logical_state_dict()  # whole tensors (gathered), the saved keys
        state = {f"{top}.{k}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                 for top, sub in sd.items() for k, v in sub.items()}
        params = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        local = {n: p.detach().clone() for n, p in s.model.named_parameters()}
        st_bytes = s.optimizer_state_bytes()
    else:
        state, local, st_bytes = {}, {}, 0
        params = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state, "local": local,
            "params": params, "start": res.start_step, "state_bytes": st_bytes}


def test_trainer_gtp_muon_equals_hand_written_single_process(shard: str) -> None:
    """``strategy.name = "gtp"`` + ``gtp.optimizer = "muon"`` (world 2) through the trainer equals one
    process running Muon + AdamW on the same global batches with the same schedule and clipping."""
    got = run_ranks(_train, 2, _trainer_config(shard, 2))
    ref = run_ranks(_train, 1, _trainer_config(shard, 1, strategy="test-muon-reference"))[0]
    assert sorted(ref["losses"]) == [1, 2, 3, 4]
    for r in range(2):
        for s, v in ref["losses"].items():
            assert got[r]["losses"][s] == pytest.approx(v, rel=TOL, abs=0), s
        for k, v in ref["params"].items():
            torch.testing.assert_close(got[r]["params"][k], v, rtol=0, atol=TOL, msg=k)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize(("world", "gtp_size"), [(2, 0), (4, 2)])
def test_gtp_muon_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, world: int, gtp_size: int) -> None:
    full = run_ranks(_train, world, _trainer_config(shard, world, gtp_size=gtp_size))
    cfg = _trainer_config(shard, world, gtp_size=gtp_size, ckpt_dir=str(tmp_path), every=2)
    first = run_ranks(_train, world, cfg, stop_after=2)
    second = run_ranks(_train, world, cfg)
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        _assert_same(second[r]["state"], full[r]["state"])  # momenta, moments, steps, lrs, weights
        _assert_same(second[r]["local"], full[r]["local"])  # padded shards too
        assert any(k.endswith(".momentum_buffer") for k in full[r]["state"])
        assert second[r]["state_bytes"] == full[r]["state_bytes"]


def test_gtp_muon_checkpoint_reshards_2_to_4(shard: str, tmp_path: Path) -> None:
    """Saved at GTP 2 after 2 steps, resumed at GTP 4 (other owners, other padding): the logical state
    loads exactly, and steps 3-4 equal an uninterrupted GTP 4 run to 1e-10 (steps 1-2 ran at GTP 2,
    whose sums differ from GTP 4's in order only)."""
    saved = run_ranks(_train, 2, _trainer_config(shard, 2, ckpt_dir=str(tmp_path), every=2), stop_after=2)
    cfg4 = _trainer_config(shard, 4, ckpt_dir=str(tmp_path), every=2)
    loaded = run_ranks(_train, 4, cfg4, stop_after=2)
    for r in range(4):
        assert loaded[r]["start"] == 2
        _assert_same(loaded[r]["state"], saved[0]["state"])
    cont = run_ranks(_train, 4, cfg4)
    ref = run_ranks(_train, 4, _trainer_config(shard, 4))
    for r in range(4):
        for s in (3, 4):
            assert cont[r]["losses"][s] == pytest.approx(ref[r]["losses"][s], rel=TOL, abs=0)
        for k, v in ref[r]["state"].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(cont[r]["state"][k], v, rtol=0, atol=TOL, msg=k)


# ------------------------------------------------------------------------------------- update wire dtype
def _bf16_wire() -> dict:
    """fp32 weights, bf16 Newton-Schulz: the update travels in bf16 (half the bytes) and the result is
    bit for bit the one of an fp32 wire (the receiver's ``O.to(float32)`` is the conversion the owner
    would have made before sending)."""
    import lowband.optim.gtp_muon as gm

    torch.set_default_dtype(torch.float32)
    mesh = build_mesh(gtp=dist.get_world_size())
    torch.manual_seed(5)
    base = _Net()
    names = _muon_names(base)
    out = {}
    real = gm._wire_dtype
    for wire in ("bf16", "fp32"):
        gm._wire_dtype = real if wire == "bf16" else (lambda ns, p: p)
        model = copy.deepcopy(base)
        rt = GTPRuntime(mesh.gtp)
        shard_linears(model, rt)
        opt = GTPMuon(_groups(model, names), mesh.gtp, lr=LR, ns_dtype=torch.bfloat16)
        ledger = default_ledger()
        g = torch.Generator().manual_seed(11)
        upd = []
        for _ in range(STEPS):
            x = torch.randn(8, 6, generator=g)
            sl = lane_slice(8, mesh.shape, mesh.lane)
            model(x[sl]).square().mean().backward()
            sync_replicated_grads(rt, model)
            start = len(ledger.records)
            opt.step()
            upd.append([(r.wire_dtype, r.wire_bytes) for r in ledger.records[start:] if r.tag == UPDATE_TAG])
            opt.zero_grad(set_to_none=True)
        out[wire] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "upd": upd}
    gm._wire_dtype = real
    return out


def test_update_travels_in_bf16_when_narrower_and_stays_exact() -> None:
    res = run_ranks(_bf16_wire, 2)
    for got in res:
        for k, v in got["fp32"]["params"].items():
            assert torch.equal(got["bf16"]["params"][k], v), k
        for b16, f32 in zip(got["bf16"]["upd"], got["fp32"]["upd"]):
            assert [d for d, _ in b16] == ["bfloat16"] * len(b16) and [d for d, _ in f32] == ["float32"] * len(f32)
            assert [2 * nb for _, nb in b16] == [nb for _, nb in f32]


def _train_nan(cfg, nan_step: int, nan_rank: int) -> dict:
    from tests.distributed.trainer_util import nan_loss_at

    with nan_loss_at(nan_step, nan_rank):
        return _train(cfg)


def test_gtp_muon_nonfinite_step_is_skipped_on_every_rank(shard: str) -> None:
    """A NaN loss on one rank at step 3 of 3: every rank skips the step (no all-to-all, no momentum or
    weight change), so the state equals the state after step 2 bit for bit (the LR schedule aside)."""
    cfg = _trainer_config(shard, 4, gtp_size=2)
    cfg.run.steps = 3
    at2 = run_ranks(_train, 4, cfg, stop_after=2)
    out = run_ranks(_train_nan, 4, cfg, 3, 3)
    for r in range(4):
        lr_keys = {k for k in at2[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr")}
        assert lr_keys
        assert out[r]["state"].keys() == at2[r]["state"].keys()
        for k, v in at2[r]["state"].items():
            if k not in lr_keys:
                assert (torch.equal(out[r]["state"][k], v) if isinstance(v, torch.Tensor)
                        else out[r]["state"][k] == v), k
        _assert_same(out[r]["local"], at2[r]["local"])


def _torch_state_round_trip(_: int) -> dict:
    """``opt.state_dict()`` deep-copied (a torch.save / torch.load), a fresh GTPMuon, ``load_state_dict``, go on:
    the run equals the uninterrupted one (the loaded Muon momenta were dropped: torch's load put new tensors
    into ``state``, while the step reads the stacked buffers)."""
    torch.set_default_dtype(torch.float64)
    mesh = build_mesh(gtp=dist.get_world_size())

    def run(round_trip: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Net()
        rt = GTPRuntime(mesh.gtp)
        shard_linears(model, rt)
        names = _muon_names(model)

        def make() -> GTPMuon:
            return GTPMuon(_groups(model, names), mesh.gtp, lr=LR, ns_dtype=torch.float64)

        opt = make()
        gen = torch.Generator().manual_seed(3)
        for step in range(4):
            if round_trip and step == 2:
                sd = copy.deepcopy(opt.state_dict())
                opt = make()
                opt.load_state_dict(sd)
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
            sl = lane_slice(8, mesh.shape, mesh.lane)
            (model(x[sl]) - y[sl]).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(False), run(True)
    return {"equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True))}


@pytest.mark.parametrize("world", [2, 4])
def test_torch_state_dict_round_trip_keeps_the_muon_momenta(world: int) -> None:
    assert run_ranks(_torch_state_round_trip, world, 0) == [{"equal": True}] * world


def _add_group_worker() -> list[str]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    shard_linears(model, rt)
    opt = GTPMuon([{"params": [model[0].weight], "algorithm": "muon"},
                   {"params": [model[0].bias, model[2].bias], "algorithm": "adamw"}], rt.comm, lr=1e-2,
                  ns_dtype=torch.float64)
    errors = []
    for group in ({"params": [model[2].weight], "algorithm": "muon"},
                  {"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))], "algorithm": "adamw"}):
        try:
            opt.add_param_group(group)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_add_param_group_after_construction_is_refused() -> None:
    """GTPMuon builds its Muon buckets and every state tensor at construction: a group added later (adapters) was
    accepted by torch's add_param_group and the next step() failed with a bare KeyError. Refused by name now."""
    out = run_ranks(_add_group_worker, 2, timeout=60)
    assert out[0] == out[1] and len(out[0]) == 2, out
    assert all(e.startswith("GTPMuon: param groups cannot be added after construction") for e in out[0]), out
