"""The ``gtp`` suite's naive GTP + Muon baseline computes single-device Muon (and the same update as
``gtp-muon`` when the ``gtp`` strategy has Muon), with the all-gathers the ledger says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import default_ledger, ring_wire_bytes
from lowband.testing import run_ranks

TIMEOUT = 90


def _cfg(n: int):
    from lowband.train.config import Config

    cfg = Config()
    cfg.run.world_size, cfg.run.dtype = n, "float64"
    # n_embd 30: at N = 4 the Muon matrices qkv (90 x 30) and attn proj (30 x 30) get padding rows
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 30, 1, 8
    cfg.model.vocab_size = 259  # lm_head and tok_emb rows pad to a multiple of the GTP size
    cfg.data.batch_size = 2
    cfg.optim.weight_decay, cfg.optim.grad_clip, cfg.optim.muon_ns_dtype = 0.1, 0.05, "float64"
    cfg.strategy.name = "gtp"
    return cfg


def _naive_vs_single() -> dict:
    """3 steps of gtp + NaiveGTPMuon against one process: lowband Muon (float64) + torch AdamW."""
    from lowband.bench.gtp_muon_naive import muon_names, naive_gtp_muon
    from lowband.optim.muon import Muon
    from lowband.plan import muon_split, plan_for
    from lowband.train.config import validate
    from lowband.train.env import init_distributed
    from lowband.train.optimizers import adamw_param_groups
    from lowband.train.strategies import get_strategy_class
    from lowband.train.trainer import build_model

    env = init_distributed("cpu")
    n = env.world_size
    cfg = _cfg(n)
    validate(cfg, n)
    o = cfg.optim
    model = build_model(cfg, env.device)
    names = muon_names(model)
    strat = get_strategy_class("gtp")(cfg, env)
    strat.setup(model)
    strat.optimizer = naive_gtp_muon(strat.model, names, strat.runtime.comm, o, torch.float64)
    ref = build_model(cfg, env.device)
    muon, adam = muon_split(ref, plan_for(ref))
    ids = {id(p) for p in muon}
    ref_m = Muon(muon, lr=o.muon_lr, momentum=o.muon_momentum, nesterov=True, weight_decay=o.weight_decay,
                 ns_dtype=torch.float64)
    ref_a = torch.optim.AdamW(adamw_param_groups(torch.nn.ParameterList([p for p in adam if id(p) not in ids]),
                                                 o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    b = cfg.data.batch_size
    ledger = default_ledger()
    gathers: list[tuple[int, int]] = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        tok = torch.randint(0, 37, (b * n, cfg.model.seq_len + 1), generator=g)
        mine = tok[env.rank * b:(env.rank + 1) * b]
        with strat.microbatch(last=True):
            strat.model(mine[:, :-1], mine[:, 1:]).backward()
        ref(tok[:, :-1], tok[:, 1:]).backward()
        strat.clip_grad_norm(o.grad_clip)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), o.grad_clip)
        start = len(ledger.records)
        strat.optimizer_step()
        recs = [r for r in ledger.records[start:] if r.tag == "gtp-muon-naive:ag"]
        gathers.append((len(recs), sum(r.wire_bytes for r in recs)))
        for opt in (ref_m, ref_a):
            opt.step()
            opt.zero_grad(set_to_none=True)
    rt = strat.runtime
    ref_params = dict(ref.named_parameters())
    diff = 0.0
    for pname, p in strat.unwrapped().named_parameters():
        full = rt.full_weight(p.gtp) if getattr(p, "gtp", None) is not None else p.detach()
        diff = max(diff, (full - ref_params[pname]).abs().max().item())
    gws = [p.gtp for name, p in strat.unwrapped().named_parameters() if name in names]
    want_bytes = sum(ring_wire_bytes("all_gather", n, gw.padded_out * gw.in_features * 8) for gw in gws)
    m_state = sum(t.numel() * t.element_size() for p, st in strat.optimizer.optimizers[0].state.items()
                  for t in st.values())
    full_state = sum(p.numel() * p.element_size() for p in muon)
    return {"diff": diff, "gathers": gathers, "want": (len(names), want_bytes), "m_state": m_state,
            "full_state": full_state, "rank": dist.get_rank()}


@pytest.mark.parametrize("world", [2, 4])
def test_naive_gtp_muon_equals_single_device_muon(world):
    res = run_ranks(_naive_vs_single, world, timeout=TIMEOUT)
    for r in res:
        # float64, the same arithmetic per element on the same full matrices; the differences come only
        # from the GTP forward/backward (sums in another order, ~1e-16 relative) through 3 steps
        assert r["diff"] <= 1e-10, r
        assert r["gathers"] == [r["want"]] * 3  # one all-gather per Muon matrix per step, ring bytes
        assert r["m_state"] == r["full_state"]  # a full momentum buffer per matrix on every rank
        assert r["want"][0] == 2 * 4  # qkv, proj, fc, proj of 2 blocks


def _naive_vs_gtp_muon() -> dict:
    """Naive and ``gtp.optimizer = "muon"`` side by side on the same model and batches: same weights."""
    import dataclasses

    from lowband.bench.gtp_muon_naive import muon_names, naive_gtp_muon
    from lowband.train.config import validate
    from lowband.train.env import init_distributed
    from lowband.train.strategies import get_strategy_class
    from lowband.train.trainer import build_model

    env = init_distributed("cpu")
    n = env.world_size
    cfg = _cfg(n)
    cfg_m = dataclasses.replace(cfg, gtp=dataclasses.replace(cfg.gtp, optimizer="muon"))
    validate(cfg_m, n)
    naive = get_strategy_class("gtp")(cfg, env)
    model = build_model(cfg, env.device)
    names = muon_names(model)
    naive.setup(model)
    naive.optimizer = naive_gtp_muon(naive.model, names, naive.runtime.comm, cfg.optim, torch.float64)
    fast = get_strategy_class("gtp")(cfg_m, env)
    fast.setup(build_model(cfg_m, env.device))
    b = cfg.data.batch_size
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        tok = torch.randint(0, 37, (b * n, cfg.model.seq_len + 1), generator=g)
        mine = tok[env.rank * b:(env.rank + 1) * b]
        for s in (naive, fast):
            with s.microbatch(last=True):
                s.model(mine[:, :-1], mine[:, 1:]).backward()
            s.clip_grad_norm(cfg.optim.grad_clip)
            s.optimizer_step()
    fp = dict(fast.unwrapped().named_parameters())
    diff = max((p.detach() - fp[name].detach()).abs().max().item()
               for name, p in naive.unwrapped().named_parameters())
    return {"diff": diff, "naive_state": naive.optimizer_state_bytes(), "fast_state": fast.optimizer_state_bytes()}


def _gtp_has_muon() -> bool:
    import dataclasses

    from lowband.train.strategies.gtp import GTPConfig

    return "optimizer" in {f.name for f in dataclasses.fields(GTPConfig)}


@pytest.mark.parametrize("world", [2])
def test_naive_equals_gtp_muon(world):
    if not _gtp_has_muon():
        pytest.fail("strategy gtp has no optimizer = 'muon' (GTPConfig.optimizer) in this build")
    res = run_ranks(_naive_vs_gtp_muon, world, timeout=TIMEOUT)
    for r in res:
        # float64: both orthogonalize the same full matrices; row shards hold identical arithmetic
        assert r["diff"] <= 1e-10, r
        assert r["fast_state"] < r["naive_state"]


def test_gtp_suite_muon_rows(tmp_path) -> None:
    """The gtp suite's Muon pair: the same training (loss), the naive step's bytes by the ring model,
    gtp-muon's state below the naive one's and reported against ddp-muon's."""
    import json

    from lowband.bench.__main__ import main

    out = tmp_path / "gtp.json"
    assert main(["gtp", "--world", "2", "--repeats", "1", "--warmup", "1", "--out", str(out), "--n-layer", "1",
                 "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
                 "--contenders", "gtp-muon,gtp-muon-naive,gtp"]) == 0
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["results"]}
    fast, naive = rows["gtp-muon"], rows["gtp-muon-naive"]
    # float32, the same updates computed on different ranks (owner vs everyone): identical arithmetic on
    # identical whole matrices, so bitwise up to the batching of Newton-Schulz ([k, r, c] stacks vs one
    # matrix), a few ulps of the update; 1e-5 on a loss ~5.8 is ~100 ulps, far below the AdamW/Muon gap
    assert abs(fast["final_loss"] - naive["final_loss"]) < 1e-5
    assert abs(fast["final_loss"] - rows["gtp"]["final_loss"]) > 1e-4
    d = doc["config"]["model"]["n_embd"]
    muon_elems = 12 * d * d  # qkv, attn proj, fc, mlp proj of the one block; no padding at N = 2
    assert naive["optimizer_step_bytes_per_step_per_rank"] == ring_wire_bytes("all_gather", 2, muon_elems * 4)
    assert fast["optimizer_state_bytes_max_rank"] < naive["optimizer_state_bytes_max_rank"]
    assert naive["optimizer_state_bytes_max_rank"] >= muon_elems * 4  # full momentum of every matrix
    s = doc["config"]["params"] * 4
    assert fast["ddp_muon_state_bytes_per_rank"] == muon_elems * 4 + 2 * (s - muon_elems * 4)
    assert fast["optimizer_state_ratio_vs_ddp_muon"] == (fast["optimizer_state_bytes_max_rank"]
                                                         / fast["ddp_muon_state_bytes_per_rank"])
    assert set(fast["ratio_vs"]) == {"gtp-muon-naive", "gtp"} and "memory_ratio_vs_gtp_muon_naive" in fast
