"""GTP on 1, 2 and 4 gloo ranks against a single-process model trained on the global batch.

Invariants from reference/gtp.md §5.2: T1 parity, T2 bitwise forward, T3 padding, T4 scaling and
accumulation, T5 repeated weights, T6 collective counts and bytes, T7 prefetch order, T8 identical
collective order, T9 nothing of weight shape saved, T10 live-bytes bound, T11 stable buffers,
T12 drain, T15 quantize-then-gather.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lowband.comm import default_ledger, ring_wire_bytes
from lowband.parallel.clip import clip_grad_norm_
from lowband.parallel.gtp import (
    GTPOptions,
    GTPRuntime,
    bound_live_unsharded_bytes,
    reduce_grads,
    replicated_params,
    shard_embeddings,
    shard_linears,
    sync_replicated_grads,
)
from lowband.parallel.gtp_quant import BlockSpec, quantize_dequantize
from lowband.parallel.mesh import MeshShape, build_mesh, lane_slice
from lowband.testing import DistributedTestError, run_ranks

TIMEOUT = 90


def _model(kind: str) -> nn.Module:
    """Same weights on every rank (each rank starts from manual_seed(0))."""
    torch.manual_seed(1)
    if kind == "mlp":  # 6 -> 10 -> 7 -> 3; LayerNorm and biases replicated; odd out dims get padding
        return nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(),
                             nn.Linear(7, 3))
    if kind == "tied":  # the 8x8 layer is applied twice in one forward
        mid = nn.Linear(8, 8)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), mid, nn.Tanh(), mid, nn.Tanh(), nn.Linear(8, 3))
    if kind == "fp8":  # in_features multiples of the 2x2 test block
        return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))
    raise ValueError(kind)


class _QDLinear(nn.Module):
    """Reference for lossy gathers: forward uses the weight as it arrives after the wire format,
    gradient goes straight through to the full weight (what GTP computes)."""

    def __init__(self, lin: nn.Linear, fmt: str, block: BlockSpec, n: int) -> None:
        super().__init__()
        self.lin, self.fmt, self.block, self.n = lin, fmt, block, n

    def forward(self, x):
        w = self.lin.weight
        align = (self.block.rows if self.fmt == "fp8" else 1) * self.n
        padded = -(-w.shape[0] // align) * align
        wp = torch.zeros(padded, w.shape[1], dtype=w.dtype)
        wp[: w.shape[0]] = w.detach()
        wq = quantize_dequantize(wp, self.fmt, self.block)[: w.shape[0]]
        return F.linear(x, w + (wq - w).detach(), self.lin.bias)


def _data(batch: int, din: int, dout: int):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(batch, din, generator=g, dtype=torch.float64),
            torch.randn(batch, dout, generator=g, dtype=torch.float64))


def _gather_grad(rt: GTPRuntime, gw) -> torch.Tensor:
    out = torch.empty(gw.padded_out, gw.in_features, dtype=gw.param.dtype)
    rt.comm.all_gather(out, gw.param.grad.contiguous(), tag="test")
    return out


def _train(cfg: dict) -> dict:
    """Train a GTP model and a single-process reference side by side; assert the invariants."""
    torch.set_default_dtype(torch.float64)
    gtp = cfg.get("gtp", dist.get_world_size())
    mesh = build_mesh(gtp=gtp, timeout=None)
    kind = cfg.get("model", "mlp")
    steps, micro = cfg.get("steps", 3), cfg.get("micro", 1)
    per_lane = cfg.get("per_lane", 5) * micro
    opts = GTPOptions(record_events=True, **cfg.get("opts", {}))
    if opts.grad_mode == "sum":
        opts.check_grad_edits = False  # the sum-mode normalization below is a uniform edit of the grads
    fmt = opts.gather_format
    ledger = default_ledger()
    ledger.reset()
    rt = GTPRuntime(mesh.gtp, opts)
    ref = _model(kind)
    model = copy.deepcopy(ref)
    shard_linears(model, rt)
    if fmt != "native":
        for i, m in enumerate(ref):
            if isinstance(m, nn.Linear):
                ref[i] = _QDLinear(m, fmt, opts.fp8_block, gtp)
    L = len(rt.weights)
    din, dout = 6, 3
    shape = mesh.shape
    X, Y = _data(per_lane * shape.num_lanes, din, dout)
    sl = lane_slice(X.shape[0], shape, mesh.lane)
    x_lane, y_lane = X[sl], Y[sl]
    if cfg.get("x_grad"):
        x_lane = x_lane.clone().requires_grad_(True)
    sum_mode = opts.grad_mode == "sum"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    reps = set(replicated_params(model))
    saved_shapes: list[tuple] = []
    hook_calls: list[dict] = []

    def post_drain():
        hook_calls.append({"pending": rt.pending(), "grads": all(gw.param.grad is not None
                                                                 for gw in rt.weights)})

    rt.register_post_drain_hook(post_drain)
    per_step_records = []
    per_step_events = []
    forward_equal = None
    tol = cfg.get("tol", 1e-10)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        start_rec, start_ev = len(ledger.records), len(rt.events)
        rt.cache.reset_stats()
        mb = per_lane // micro
        for m in range(micro):
            xm, ym = x_lane[m * mb:(m + 1) * mb], y_lane[m * mb:(m + 1) * mb]
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: (saved_shapes.append((tuple(t.shape), t.data_ptr())), t)[1], lambda t: t):
                out = model(xm)
            if step == 0 and m == 0:
                forward_equal = torch.equal(out, ref(xm))
            loss = F.mse_loss(out, ym, reduction="sum" if sum_mode else "mean")
            (loss if sum_mode else loss / micro).backward()
            assert rt.pending() == {"reduce_scatters": 0, "gathers": 0, "held_buffers": 0}, rt.pending()
        hw = dict(rt.cache.high_water)
        sync_replicated_grads(rt, model)
        reduce_grads(mesh.dp, model.parameters(), "sum" if sum_mode else "avg", tag="dp")
        if sum_mode:
            for p in model.parameters():
                p.grad.div_(X.shape[0] * dout)
        ref_loss = F.mse_loss(ref(X), Y)
        ref_loss.backward()
        # gradient parity (before the update)
        ref_lin = [m.lin if isinstance(m, _QDLinear) else m for m in ref if isinstance(m, (nn.Linear,
                                                                                             _QDLinear))]
        seen = []
        for m in ref_lin:
            if m not in seen:
                seen.append(m)
        for gw, rm in zip(rt.weights, seen):
            g = _gather_grad(rt, gw)
            torch.testing.assert_close(g[: gw.out_features], rm.weight.grad, rtol=0, atol=tol)
            assert torch.all(g[gw.out_features:] == 0), "pad rows of the grad must be exactly zero"
        ref_named = {n.replace(".lin.", "."): p for n, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            if p in reps:
                torch.testing.assert_close(p.grad, ref_named[name].grad, rtol=0, atol=tol)
        opt.step()
        ref_opt.step()
        per_step_records.append([(r.op, r.tag, r.group, r.numel, r.wire_bytes, r.async_op)
                                 for r in ledger.records[start_rec:]])
        per_step_events.append(list(rt.events[start_ev:]))
        # bound on live unsharded bytes (T10)
        bound = bound_live_unsharded_bytes(rt)
        assert 0 < hw["fwd"] <= bound["fwd"], (hw, bound)
        assert 0 < hw["bwd"] <= bound["bwd"], (hw, bound)

    # T1 / T3: weights after k steps, pad rows of weight and optimizer state exactly zero
    max_diff = 0.0
    for gw, rm in zip(rt.weights, seen):
        full = rt.full_weight(gw)
        max_diff = max(max_diff, (full - rm.weight).abs().max().item())
        first_pad = max(0, gw.out_features - rt.rank * gw.shard_rows)  # local row where padding starts
        if first_pad < gw.shard_rows:
            st = opt.state[gw.param]
            for t in (gw.param, gw.param.grad, st["exp_avg"], st["exp_avg_sq"]):
                assert torch.all(t[first_pad:] == 0)
    assert max_diff <= tol, max_diff
    # T9: nothing of weight shape saved for backward
    weight_shapes = {(gw.out_features, gw.in_features) for gw in rt.weights}
    weight_shapes |= {(gw.padded_out, gw.in_features) for gw in rt.weights}
    shard_ptrs = {gw.param.data_ptr() for gw in rt.weights}  # at N=1 a shard has the full shape
    bad = {s for s, ptr in saved_shapes if s in weight_shapes and ptr not in shard_ptrs}
    assert not bad, (weight_shapes, bad)
    # T12: post-drain hook once per backward, after all grads are in, nothing pending
    assert len(hook_calls) == steps * micro
    assert all(h["grads"] and h["pending"]["reduce_scatters"] == 0 for h in hook_calls)
    # T11: stable addresses from step 2 on; buffers = keys; neighbours never share a buffer
    cache = rt.cache
    return {"max_diff": max_diff, "forward_equal": forward_equal, "records": per_step_records,
            "events": per_step_events, "L": L, "order": [gw.uid for gw in rt.order],
            "ptr_history": {str(k): v for k, v in cache.ptr_history.items()},
            "num_buffers": {d: cache.num_buffers(d) for d in ("fwd", "bwd", "fwd|bwd", "wgrad", "rs")},
            "num_keys": {d: sum(1 for k in cache.buffers if k[2] == d) for d in ("fwd", "bwd", "fwd|bwd")},
            "shapes": [(gw.out_features, gw.in_features, gw.padded_out) for gw in rt.weights],
            "lanes": shape.num_lanes, "gtp": rt.size, "micro": micro}


def _check_common(res: list[dict], cfg: dict) -> None:
    r0 = res[0]
    L, micro, n = r0["L"], r0["micro"], r0["gtp"]
    extra = cfg.get("extra", 0)
    consumes = L + extra
    for r in res:
        assert r["forward_equal"] is True  # T2: bitwise equal forward on the lane input
    # T8: identical collective sequence on every rank of a GTP group (and every step after the first)
    for r in res:
        assert [(op, tag, numel) for op, tag, _, numel, _, _ in r["records"][-1]] == \
            [(op, tag, numel) for op, tag, _, numel, _, _ in r0["records"][-1]]
    opts = cfg.get("opts", {})
    fmt = opts.get("gather_format", "native")
    for step, recs in enumerate(r0["records"]):
        ag_f = [x for x in recs if x[1] == "gtp:ag:fwd"]
        ag_b = [x for x in recs if x[1] == "gtp:ag:bwd"]
        rs = [x for x in recs if x[1] == "gtp:rs"]
        bwd_per_mb = consumes if cfg.get("x_grad") else consumes - 1
        # T6: exact counts per microbatch and exact sizes/bytes
        assert len(ag_f) == consumes * micro, (step, len(ag_f))
        assert len(ag_b) == bwd_per_mb * micro, (step, len(ag_b))
        assert len(rs) == consumes * micro
        assert all(x[2] == "gtp" for x in ag_f + ag_b + rs)
        if fmt == "native":
            padded = {p * i for _, i, p in r0["shapes"]}
            assert {x[3] for x in ag_f} <= padded and {x[3] for x in rs} <= padded
            for x in ag_f + ag_b + rs:
                assert x[4] == ring_wire_bytes(x[0], n, x[3] * 8)
        # the replicated grads are averaged at the end of every backward, as DDP does without no_sync
        assert sum(1 for x in recs if x[1] == "gtp:replicated") == micro
        assert sum(1 for x in recs if x[1] == "dp") == 1
        assert not [x for x in recs if x[1] == "gtp:replicated" and x[0] != "all_reduce"]
        # T7: the first pass (chain build) all synchronous; later passes one sync gather per
        # direction (chain head) plus the extra consumes, the rest async
        if not opts.get("prefetch", True):
            assert not any(x[5] for x in ag_f + ag_b)
        else:
            pp = micro - 1 if step == 0 else micro  # prefetched passes in this step
            assert sum(not x[5] for x in ag_f) == (1 + extra) * pp + consumes * (micro - pp)
            assert sum(x[5] for x in ag_f) == (L - 1) * pp
            assert sum(not x[5] for x in ag_b) == (1 + extra) * pp + bwd_per_mb * (micro - pp)
    if opts.get("prefetch", True) and extra == 0:
        ev = r0["events"][-1]
        idx: dict[tuple, int] = {}
        for k, e in enumerate(ev):
            idx.setdefault(e[:3], k)
        for i in range(L - 1):  # forward: issue AG(w_{i+1}) before GEMM(w_i) is done
            assert idx[("ag_issue", "fwd", i + 1)] < idx[("gemm_done", "fwd", i)]
        first_with_dgrad = 0 if cfg.get("x_grad") else 1
        for i in range(first_with_dgrad + 1, L):  # backward: issue AG(w_{i-1}) before dgrad(w_i) is done
            assert idx[("ag_issue", "bwd", i - 1)] < idx[("dgrad_done", "bwd", i)]
    # T11
    for r in res:
        for ticket, ptrs in r["ptr_history"].items():
            later = ptrs[micro:] if "'eval'" not in ticket else ptrs
            assert len(set(later)) <= 1, (ticket, ptrs)
        if extra == 0:
            for d in ("fwd", "bwd", "fwd|bwd"):  # one buffer per key, not one per layer
                assert r["num_buffers"][d] == r["num_keys"][d]
        order = r["order"]
        last = {t: v[-1] for t, v in r["ptr_history"].items()}
        for a, b in itertools.pairwise(order):
            for d in ("fwd", "bwd"):
                ka, kb = str((a, d, "main")), str((b, d, "main"))
                if ka in last and kb in last:
                    assert last[ka] != last[kb]


CASES = [
    pytest.param(1, {}, id="w1"),
    pytest.param(2, {}, id="w2"),
    pytest.param(4, {}, id="w4"),
    pytest.param(2, {"micro": 2, "x_grad": True}, id="w2-accum-xgrad"),
    pytest.param(2, {"opts": {"async_reduction": False, "prefetch": False}}, id="w2-sync-noprefetch"),
    pytest.param(4, {"opts": {"finalize_depth": 0}}, id="w4-depth0"),
    pytest.param(4, {"gtp": 2}, id="w4-gtp2-dp2"),
    pytest.param(2, {"model": "tied", "extra": 1}, id="w2-tied"),
    pytest.param(4, {"model": "tied", "extra": 1, "micro": 2}, id="w4-tied-accum"),
    pytest.param(2, {"opts": {"grad_mode": "sum"}, "steps": 2}, id="w2-sum"),
]


@pytest.mark.parametrize(("world", "cfg"), CASES)
def test_gtp_parity_and_invariants(world, cfg):
    res = run_ranks(_train, world, cfg, timeout=TIMEOUT)
    assert res[0]["max_diff"] <= 1e-10
    _check_common(res, cfg)


@pytest.mark.parametrize(("world", "fmt", "cache"), [(2, "bf16", False), (2, "fp8", True), (4, "fp8", False)])
def test_gtp_quantized_gather_parity(world, fmt, cache):
    """Quantize-then-gather equals the reference that quantizes the padded full weight (T15)."""
    cfg = {"model": "fp8", "opts": {"gather_format": fmt, "fp8_block": BlockSpec(2, 2), "cache_wire_shard": cache},
           "tol": 1e-10, "steps": 2}
    res = run_ranks(_train, world, cfg, timeout=TIMEOUT)
    assert res[0]["max_diff"] <= 1e-10


def _quant_gather_exact(fmt: str) -> dict:
    from lowband.comm import Comm

    torch.set_default_dtype(torch.float32)
    n = dist.get_world_size()
    block = BlockSpec(4, 8)
    rt = GTPRuntime(Comm(name="gtp"), gather_format=fmt, fp8_block=block)
    torch.manual_seed(3)
    full = torch.randn(13, 16) * torch.logspace(-3, 2, 16)  # blocks with very different ranges
    gw = rt.register(full, "w")
    g = rt._issue_gather(gw, "fwd", "main", async_op=False)
    w, release = rt._complete(g)
    got = w.clone()
    release()
    align = (block.rows if fmt == "fp8" else 1) * n
    padded = torch.zeros(-(-13 // align) * align, 16)
    padded[:13] = full
    expect = quantize_dequantize(padded, fmt, block)[:13]
    assert torch.equal(got, expect)
    rec = [r for r in default_ledger().records if r.tag == "gtp:ag:fwd"][-1]
    return {"wire_bytes": rec.wire_bytes, "padded_rows": padded.shape[0]}


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_gather_equals_full_quantization(world):
    for fmt in ("bf16", "fp8"):
        res = run_ranks(_quant_gather_exact, world, fmt, timeout=TIMEOUT)
        rows = res[0]["padded_rows"]
        per_el = 2 if fmt == "bf16" else 1 + 4 / 32
        assert res[0]["wire_bytes"] == ring_wire_bytes("all_gather", world, int(rows * 16 * per_el))


def _wire_ratio(_: int) -> dict:
    torch.set_default_dtype(torch.float32)
    out = {}
    for fmt in ("native", "bf16", "fp8"):
        ledger = default_ledger()
        ledger.reset()
        mesh = build_mesh(gtp=dist.get_world_size())
        rt = GTPRuntime(mesh.gtp, gather_format=fmt, fp8_block=BlockSpec(16, 16))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        shard_linears(model, rt)
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
        out[fmt] = (ledger.wire_bytes(tag="gtp:ag"), ledger.wire_bytes(tag="gtp:rs"))
    return out


def test_quantized_gather_wire_ratios():
    res = run_ranks(_wire_ratio, 2, 0, timeout=TIMEOUT)[0]
    (ag32, rs32), (ag16, rs16), (ag8, rs8) = res["native"], res["bf16"], res["fp8"]
    assert ag16 <= 0.5 * ag32 and ag8 <= 0.27 * ag32
    assert rs32 == rs16 == rs8  # gradients stay fp32


# --------------------------------------------------------------------------------- bad input
def _bad_mesh(gtp: int) -> str:
    try:
        build_mesh(gtp=gtp)
    except ValueError as e:
        assert not default_ledger().records  # failed before any collective
        return str(e)
    return "no error"


@pytest.mark.parametrize(("world", "gtp"), [(2, 3), (4, 3)])
def test_gtp_degree_must_divide_world(world, gtp):
    msgs = run_ranks(_bad_mesh, world, gtp, timeout=TIMEOUT)
    assert len(set(msgs)) == 1 and "divide the world size" in msgs[0]


def _bad_block(_: int) -> str:
    mesh = build_mesh(gtp=dist.get_world_size())
    rt = GTPRuntime(mesh.gtp, gather_format="fp8", fp8_block=BlockSpec(4, 8))
    n_before = len(default_ledger().records)
    try:
        shard_linears(nn.Sequential(nn.Linear(12, 8)), rt)
    except ValueError as e:
        assert len(default_ledger().records) == n_before
        return str(e)
    return "no error"


def test_fp8_block_rule_error():
    msgs = run_ranks(_bad_block, 2, 0, timeout=TIMEOUT)
    assert len(set(msgs)) == 1 and "in_features 12" in msgs[0] and "block width 8" in msgs[0]


def test_bad_options():
    with pytest.raises(ValueError, match="gather_format"):
        GTPOptions(gather_format="int4")
    with pytest.raises(ValueError, match="finalize_depth"):
        GTPOptions(finalize_depth=-1)
    with pytest.raises(ValueError, match="grad_mode"):
        GTPOptions(grad_mode="token")
    with pytest.raises(ValueError, match="gtp"):
        MeshShape.resolve(4, gtp=3)


def test_distributed_error_is_clear():
    with pytest.raises(DistributedTestError):
        run_ranks(_bad_mesh_raise, 2, timeout=TIMEOUT)


def _bad_mesh_raise() -> None:
    build_mesh(gtp=4, dp=1)


# --------------------------------------------------------------------------------- mesh groups
def _mesh_groups(sizes: dict) -> dict:
    mesh = build_mesh(**sizes)
    out = {}
    for axis in ("replica", "dp", "gtp", "tp"):
        c = mesh.comm(axis)
        out[axis] = tuple(c.global_rank(i) for i in range(c.size))
        t = torch.tensor([float(dist.get_rank())])
        c.all_reduce(t)
        out[axis + "_sum"] = t.item()
    dm = mesh.device_mesh("cpu")
    out["dm_gtp"] = tuple(dist.get_process_group_ranks(dm.get_group("gtp")))
    return out


@pytest.mark.parametrize(("world", "sizes"), [(2, {"gtp": 2}), (4, {"gtp": 2}), (4, {"gtp": 2, "tp": 2}),
                                              (4, {"replica": 2, "gtp": 2})])
def test_mesh_groups_match_layout(world, sizes):
    res = run_ranks(_mesh_groups, world, sizes, timeout=TIMEOUT)
    shape = MeshShape.resolve(world, **sizes)
    for rank, r in enumerate(res):
        for axis in ("replica", "dp", "gtp", "tp"):
            (grp,) = [g for g in shape.group_ranks(axis) if rank in g]
            assert r[axis] == grp
            assert r[axis + "_sum"] == float(sum(grp))
        assert r["dm_gtp"] == r["gtp"]


# --------------------------------------------------------------------------------- trainer strategy
def _strategy_vs_reference(gtp_size: int, gather: str, accum: int) -> dict:
    """The ``gtp`` trainer strategy against one process training the same GPT on the global batch."""
    from lowband.train.config import Config, validate
    from lowband.train.env import init_distributed
    from lowband.train.optimizers import adamw_param_groups
    from lowband.train.strategies import get_strategy_class
    from lowband.train.trainer import build_model

    env = init_distributed("cpu")
    n = env.world_size
    cfg = Config()
    cfg.run.world_size, cfg.run.dtype = n, "float64"
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 2, 8
    cfg.model.vocab_size = 259  # >= the byte tokenizer's 258 ids; lm_head rows pad to a multiple of gtp
    cfg.data.batch_size, cfg.data.grad_accum = 2 * accum, accum
    cfg.optim.weight_decay, cfg.optim.grad_clip = 0.1, 0.05  # small clip: clipping is active
    cfg.strategy.name = "gtp"
    cfg.gtp.size, cfg.gtp.gather, cfg.gtp.fp8_block = gtp_size, gather, 8
    validate(cfg, n)
    strat = get_strategy_class("gtp")(cfg, env)
    strat.setup(build_model(cfg, env.device))
    ref = build_model(cfg, env.device)
    o = cfg.optim
    ref_opt = torch.optim.AdamW(adamw_param_groups(ref, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                eps=o.eps)
    b, mb = cfg.data.batch_size, cfg.data.batch_size // accum
    norms, ref_norms, losses, ref_losses = [], [], [], []
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        tok = torch.randint(0, 37, (b * n, cfg.model.seq_len + 1), generator=g)
        mine = tok[env.rank * b:(env.rank + 1) * b]
        start = len(default_ledger().records)
        for m in range(accum):
            with strat.microbatch(last=m == accum - 1):
                loss = strat.model(mine[m * mb:(m + 1) * mb, :-1], mine[m * mb:(m + 1) * mb, 1:])
                (loss / accum).backward()
            # the reference's microbatch m: every rank's microbatch m
            glob = torch.cat([tok[r * b + m * mb:r * b + (m + 1) * mb] for r in range(n)])
            ref_loss = ref(glob[:, :-1], glob[:, 1:])
            (ref_loss / accum).backward()
        recs = default_ledger().records[start:]
        nw = len(strat.runtime.weights)  # token embedding + 4 per block + lm_head
        assert nw == 2 + 4 * cfg.model.n_layer
        assert sum(r.tag == "gtp:ag:fwd" for r in recs) == nw * accum
        assert sum(r.tag == "gtp:ag:bwd" for r in recs) == (nw - 1) * accum  # no backward gather for tok_emb
        assert sum(r.tag == "gtp:rs" for r in recs) == nw * accum
        assert sum(r.tag == "gtp:replicated" for r in recs) == 1  # non-last microbatches under no_sync, as DDP
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(float(lt) / n)
        ref_losses.append(float(ref_loss))
        norms.append(strat.clip_grad_norm(o.grad_clip))
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), o.grad_clip)))
        strat.optimizer_step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    rt = strat.runtime
    # T11 on a real model: one gather buffer per (shape, dtype, direction, parity) key, fewer than weights
    gkeys = [k for k in rt.cache.buffers if k[2] in ("fwd", "bwd", "fwd|bwd")]
    assert sum(len(rt.cache.buffers[k]) for k in gkeys) == len(gkeys)
    if gather != "fp8":
        assert len(gkeys) < len(rt.weights)
    diff = 0.0
    ref_params = dict(ref.named_parameters())
    for pname, p in strat.unwrapped().named_parameters():
        full = rt.full_weight(p.gtp) if getattr(p, "gtp", None) is not None else p.detach()
        diff = max(diff, (full - ref_params[pname]).abs().max().item())
    tol = 1e-10 if gather == "native" else 5e-2
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) <= tol * max(ref_norms), (norms, ref_norms)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= tol * max(ref_losses), (losses, ref_losses)
    assert diff <= tol, diff
    ref_state = sum(t.numel() * t.element_size() for st in ref_opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor))
    return {"diff": diff, "ref_state": ref_state, "gtp_state": strat.optimizer_state_bytes()}


@pytest.mark.parametrize(("world", "gtp_size", "gather", "accum"),
                         [(2, 0, "native", 1), (4, 2, "native", 2), (2, 0, "fp8", 1)])
def test_gtp_strategy_matches_single_process(world, gtp_size, gather, accum):
    res = run_ranks(_strategy_vs_reference, world, gtp_size, gather, accum, timeout=TIMEOUT)
    assert res[0]["gtp_state"] < res[0]["ref_state"]


def test_gtp_strategy_config_errors():
    from lowband.train.config import Config, ConfigError, validate

    cfg = Config()
    cfg.strategy.name = "gtp"
    cfg.gtp.size = 3
    with pytest.raises(ConfigError, match=r"gtp.size must be 0 \(whole world\) or a divisor"):
        validate(cfg, 4)
    cfg.gtp.size, cfg.gtp.gather, cfg.gtp.fp8_block = 2, "fp8", 48
    with pytest.raises(ConfigError, match=r"divisible by gtp\.fp8_block"):
        validate(cfg, 4)
    cfg.gtp.gather = "int4"
    with pytest.raises(ConfigError, match=r"gtp\.gather must be one of"):
        validate(cfg, 4)


# --------------------------------------------------------------------------------- sharded optimizer
def _with_sharded_adamw(gtp: int) -> float:
    """GTP shards (+ replicated params) optimized by ShardedAdamW over the DP group: the DP axis
    reduce-scatters every grad after the GTP drain and the replicated-grad all-reduce."""
    from lowband.optim.sharded import ShardedAdamW

    torch.set_default_dtype(torch.float64)
    mesh = build_mesh(gtp=gtp)
    rt = GTPRuntime(mesh.gtp)
    ref = _model("mlp")
    model = copy.deepcopy(ref)
    shard_linears(model, rt)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, comm=mesh.dp, bucket_mb=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    X, Y = _data(5 * mesh.shape.num_lanes, 6, 3)
    sl = lane_slice(X.shape[0], mesh.shape, mesh.lane)
    for _ in range(3):
        with opt.no_sync():  # the DP reduction starts in step(), after GTP has finished every grad
            F.mse_loss(model(X[sl]), Y[sl]).backward()
        assert rt.pending()["reduce_scatters"] == 0
        sync_replicated_grads(rt, model)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(X), Y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = 0.0
    lin = [m for m in ref if isinstance(m, nn.Linear)]
    for gw, rm in zip(rt.weights, lin):
        diff = max(diff, (rt.full_weight(gw) - rm.weight).abs().max().item())
        first_pad = max(0, gw.out_features - rt.rank * gw.shard_rows)
        assert torch.all(gw.param[first_pad:] == 0)
    assert diff <= 1e-10, diff
    assert default_ledger().count(group="dp", op="reduce_scatter") > 0 or mesh.dp.size == 1
    return diff


@pytest.mark.parametrize(("world", "gtp"), [(2, 2), (4, 2)])
def test_gtp_composes_with_sharded_adamw(world, gtp):
    run_ranks(_with_sharded_adamw, world, gtp, timeout=TIMEOUT)


def _cached_wire_shard(_: int) -> dict:
    """cache_wire_shard=True against False (bf16 gathers): the same losses and weights, bit for bit, under
    an optimizer that writes the parameters without bumping their version (ShardedAdamW updates a flat
    buffer the parameters view) and after writes through ``.data`` (an EMA swap)."""
    from lowband.optim.sharded import ShardedAdamW

    torch.set_default_dtype(torch.float64)
    mesh = build_mesh(gtp=dist.get_world_size())
    X, Y = _data(6, 6, 3)
    runs, cached_fwd, cached_after = {}, [], []
    for cache in (False, True):
        model = _model("mlp")
        rt = GTPRuntime(mesh.gtp, GTPOptions(gather_format="bf16", cache_wire_shard=cache))
        shard_linears(model, rt)
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, comm=mesh.dp, bucket_mb=1e-3)
        losses = []
        for _ in range(3):
            loss = F.mse_loss(model(X), Y)
            if cache:
                cached_fwd.append(all(gw._wire_src is not None for gw in rt.weights))
            with opt.no_sync():  # the DP reduction starts in step(), after GTP has finished every grad
                loss.backward()
            if cache:
                cached_after.append(any(gw._wire_src is not None for gw in rt.weights))
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        for p in model.parameters():  # an EMA-style swap through .data: no version bump
            p.data.copy_(p.data * 0.5 + 0.1)
        with torch.no_grad():
            losses.append(F.mse_loss(model(X), Y))
        losses.append(F.mse_loss(model(X), Y).detach())  # grad-enabled forward, no backward
        runs[cache] = torch.stack(losses), [rt.full_weight(gw) for gw in rt.weights]
    assert torch.equal(runs[True][0], runs[False][0]), (runs[True][0], runs[False][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))
    assert cached_fwd == [True] * 3 and cached_after == [False] * 3, (cached_fwd, cached_after)
    return {"losses": runs[True][0].tolist()}


def test_cached_wire_shard_sees_every_write():
    """Regression: the quantized copy was keyed on the parameter's version counter, so ShardedAdamW's updates
    (and any ``p.data`` write) went unseen and later steps gathered step 0's weights."""
    res = run_ranks(_cached_wire_shard, 2, 0, timeout=TIMEOUT)
    assert res[0]["losses"] == res[1]["losses"]


# --------------------------------------------------------------------------------- TP x GTP (T13)
def _tp_gtp(_: int) -> float:
    from lowband.parallel.gtp_tp import GTPColumnParallelLinear, GTPRowParallelLinear

    torch.set_default_dtype(torch.float64)
    mesh = build_mesh(gtp=2, tp=2)
    rt = GTPRuntime(mesh.gtp)
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7))
    model = nn.Sequential(GTPColumnParallelLinear(ref[0], mesh.tp, rt, name="col"), nn.Tanh(),
                          GTPRowParallelLinear(ref[2], mesh.tp, rt, name="row"))
    col, row = rt.weights
    assert (col.out_features, col.in_features, col.padded_out) == (5, 6, 6)  # TP and GTP both cut out
    assert (row.out_features, row.in_features, row.padded_out) == (7, 5, 8)  # TP cuts in, GTP cuts out
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    X, Y = _data(5 * mesh.shape.num_lanes, 6, 7)
    sl = lane_slice(X.shape[0], mesh.shape, mesh.lane)
    t = mesh.coords.tp
    for _ in range(3):
        out = model(X[sl])
        torch.testing.assert_close(out, ref(X[sl]), rtol=0, atol=1e-12)
        F.mse_loss(out, Y[sl]).backward()
        sync_replicated_grads(rt, model)
        F.mse_loss(ref(X), Y).backward()
        # global-norm clipping over GTP x TP (weights: squares summed over both groups; the column
        # bias over TP; the row bias once) equals torch's on the dense model: the same squares summed in
        # another grouping, relative k eps64 with k <= 70 elements, well inside 1e-12
        norm = clip_grad_norm_(model, 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert ref_norm > 0.05 and abs(float(norm) - float(ref_norm)) <= 1e-12 * float(ref_norm)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        recs = default_ledger().step_records()
        assert sum(r.tag == "tp:col_dx" for r in recs) == 0  # x of the first layer needs no grad
        assert sum(r.tag == "tp:row_y" for r in recs) == 1
        assert sum(r.tag == "gtp:norm" for r in recs) == 1 and sum(r.tag == "tp:norm" for r in recs) == 1
        default_ledger().mark_step()
    diff = max((rt.full_weight(col) - ref[0].weight.chunk(2, 0)[t]).abs().max().item(),
               (rt.full_weight(row) - ref[2].weight.chunk(2, 1)[t]).abs().max().item(),
               (model[0].inner.bias - ref[0].bias.chunk(2, 0)[t]).abs().max().item(),
               (model[2].bias - ref[2].bias).abs().max().item())
    assert diff <= 1e-10, diff
    return diff


def test_tp2_x_gtp2_matches_dense():
    run_ranks(_tp_gtp, 4, 0, timeout=TIMEOUT)


# --------------------------------------------------------------------------------- checkpoints (T14)
def _ckpt_config(shard_path: str, world: int, strategy: str, batch: int, ckpt_dir: str = "", every: int = 0):
    from lowband.train.config import Config

    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, 6, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 2, 16
    cfg.model.vocab_size = 258  # rows not a multiple of 4: padding differs between GTP 2 and 4
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard_path, batch
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 2, 0.1, 0.5
    cfg.strategy.name = strategy
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _train_snapshot(cfg, stop_after=None) -> dict:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False, stop_after=stop_after)
    strat = res.strategy
    sd = getattr(strat, "logical_state_dict", strat.state_dict)()  # gathered for gtp, full for ddp: same keys, shapes
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "start": res.start_step,
            "model": {k: v.detach().clone() for k, v in sd["model"].items()},
            "optim": {k: v.detach().clone() for k, v in sd["optim"].items() if isinstance(v, torch.Tensor)}}


@pytest.fixture(scope="module")
def token_shard(tmp_path_factory: pytest.TempPathFactory) -> str:
    import numpy as np

    from lowband.data import write_shard

    path = tmp_path_factory.mktemp("gtpdata") / "train.bin"
    write_shard(path, np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.uint16))
    return str(path)


def test_gtp_checkpoint_reshards_2_to_4_and_into_ddp(token_shard, tmp_path):
    gb = 8
    saved = run_ranks(_train_snapshot, 2, _ckpt_config(token_shard, 2, "gtp", gb // 2, str(tmp_path), 3),
                      stop_after=3, timeout=TIMEOUT)
    # loaded at GTP 4 (stop right after loading): the logical state equals the saved one bit for bit
    loaded = run_ranks(_train_snapshot, 4, _ckpt_config(token_shard, 4, "gtp", gb // 4, str(tmp_path), 3),
                       stop_after=3, timeout=TIMEOUT)
    for r in range(4):
        assert loaded[r]["start"] == 3
        for part in ("model", "optim"):
            for k, v in saved[0][part].items():
                assert torch.equal(loaded[r][part][k], v), k
    # a GTP checkpoint loads into DDP (same checkpoint format "replicated")
    into_ddp = run_ranks(_train_snapshot, 2, _ckpt_config(token_shard, 2, "ddp", gb // 2, str(tmp_path), 3),
                         stop_after=3, timeout=TIMEOUT)
    for k, v in saved[0]["model"].items():
        assert torch.equal(into_ddp[0]["model"][k], v), k
    # continues like a GTP-4 run that never stopped, and like DDP
    cont = run_ranks(_train_snapshot, 4, _ckpt_config(token_shard, 4, "gtp", gb // 4, str(tmp_path), 3),
                     timeout=TIMEOUT)
    ref = run_ranks(_train_snapshot, 4, _ckpt_config(token_shard, 4, "gtp", gb // 4), timeout=TIMEOUT)
    ddp = run_ranks(_train_snapshot, 2, _ckpt_config(token_shard, 2, "ddp", gb // 2), timeout=TIMEOUT)
    for other in (ref[0], ddp[0]):
        for s in (4, 5, 6):
            assert abs(cont[0]["losses"][s] - other["losses"][s]) <= 1e-10 * abs(other["losses"][s])
        for k, v in other["model"].items():
            torch.testing.assert_close(cont[0]["model"][k], v, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------------- non-finite flags (GradScaler)
def _nonfinite_ledger(share: bool, bias: bool) -> dict:
    """Two steps of a 3-linear model (2 ranks); at step 1 rank 1's wgrad of the last layer gets an inf
    in row 0 (held by rank 0): per step the ledger and which shard gradients are non-finite after it."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1)
    layers = [nn.Linear(6, 10, bias=bias), nn.Tanh(), nn.Linear(10, 7, bias=bias), nn.Tanh(),
              nn.Linear(7, 3, bias=bias)]
    model = nn.Sequential(*layers)
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp, GTPOptions(share_nonfinite=share))
    shard_linears(model, rt)
    x, y = _data(4, 6, 3)
    ledger = default_ledger()
    out = {}
    for step in range(2):
        start = len(ledger.records)
        h = model[:4](x)
        z = model[4](h.detach())  # the inf below stays in the last layer (its wgrad and bias grad)
        if step == 1 and dist.get_rank() == 1:
            z.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))  # wgrad row 0
        (F.mse_loss(z, y) + h.square().mean()).backward()
        out[step] = {"records": [(r.op, r.tag, r.numel, r.wire_bytes) for r in ledger.records[start:]],
                     "nonfinite": [gw.name for gw in rt.weights
                                   if not bool(torch.isfinite(gw.param.grad).all())]}
        model.zero_grad(set_to_none=True)
    out["L"] = len(rt.weights)
    out["replicated"] = sum(p.numel() for p in replicated_params(model))
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_nonfinite_flags_cost_one_element_per_weight(bias: bool) -> None:
    """share_nonfinite adds L elements (one per GTP weight) to the replicated-gradient all-reduce and no
    collective, and shows rank 0's inf (from rank 1's data, in a row rank 0 owns) on rank 1's shard of
    the same weight only. The all-reduce also carries 2L flags that are always there (the used flags, then the
    read-outside-the-layer flags). Without replicated parameters (bias=False) the flags travel in one
    all-reduce of their own (3L float32), which share_nonfinite=False skips."""
    on = run_ranks(_nonfinite_ledger, 2, True, bias)
    off = run_ranks(_nonfinite_ledger, 2, False, bias)
    L, rep = on[0]["L"], on[0]["replicated"]
    n_rep = 3 if bias else 0  # trainable replicated parameters (the biases): one used flag each
    for step in (0, 1):
        a, b = on[0][step]["records"], off[0][step]["records"]
        assert [r for r in a if r[1] != "gtp:replicated"] == [r for r in b if r[1] != "gtp:replicated"]
        rep_on = [r for r in a if r[1] == "gtp:replicated"]
        rep_off = [r for r in b if r[1] == "gtp:replicated"]
        numel = rep + n_rep + 3 * L
        esize = 8 if bias else 4
        assert rep_on == [("all_reduce", "gtp:replicated", numel, ring_wire_bytes("all_reduce", 2, numel * esize))]
        assert rep_off == ([("all_reduce", "gtp:replicated", numel - L,
                             ring_wire_bytes("all_reduce", 2, (numel - L) * esize))] if bias else [])
        assert not [r for r in a if r[1] == "gtp:optim_state"]
    last = "4"  # shard_linears names the weights by module path
    assert [r[1]["nonfinite"] for r in on] == [[last], [last]]
    assert [r[1]["nonfinite"] for r in off] == [[last], []]  # only the owner of row 0 sees it
    assert all(r[0]["nonfinite"] == [] for r in on + off)


class _ReadsOutside(nn.Module):
    """``tok`` is called; ``wpe.weight`` is indexed and ``head.weight`` passed to ``F.linear`` (both never called)
    from step ``direct_from`` on; before that ``wpe`` and ``head`` are called as layers. The shapes fit a shard
    at 2 and 4 ranks (4 positions of 16 rows), so nothing fails by shape: only the values are wrong."""

    def __init__(self, direct_from: int) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.tok = nn.Embedding(16, 8)
        self.wpe = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.direct_from = direct_from
        self.step_no = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if self.step_no >= self.direct_from:
            return F.linear(self.tok(idx) + self.wpe.weight[:t], self.head.weight).pow(2).mean()
        return self.head(self.tok(idx) + self.wpe(torch.arange(t))).pow(2).mean()


def _direct_reads(direct_from: int, bias_free: bool) -> dict:
    from lowband.comm import Comm
    from lowband.parallel import GTPDirectReadError

    model = _ReadsOutside(direct_from)
    rt = GTPRuntime(Comm(name="gtp"), share_nonfinite=not bias_free)
    shard_embeddings(model, rt)
    shard_linears(model, rt)
    g = torch.Generator().manual_seed(dist.get_rank())
    out: dict = {"error": None, "steps": 0}
    for step in range(3):
        model.step_no = step
        try:
            model(torch.randint(0, 16, (2, 4), generator=g)).backward()
        except GTPDirectReadError as e:
            out["error"] = (step, str(e))
            break
        for p in model.parameters():
            p.grad = None
        out["steps"] += 1
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bias_free", [False, True])
def test_a_weight_read_outside_its_layer_is_refused_on_every_rank(world: int, bias_free: bool) -> None:
    """There the parameter holds this rank's rows only: backward raises GTPDirectReadError on every rank, naming
    exactly the weights read that way (the one that was called is not named). bias_free: no replicated parameter
    and share_nonfinite=False, so no flags all-reduce runs and each rank refuses on its own flags."""
    for r in run_ranks(_direct_reads, world, 1, bias_free):
        assert r["steps"] == 1  # step 0 called every layer: no refusal
        step, msg = r["error"]
        assert step == 1
        assert "['wpe', 'head']" in msg and "'tok'" not in msg and "outside their GTP layer" in msg


# ------------------------------------------------------------- sum mode: accumulation without no_sync


class _SumNet(nn.Module):
    """``head(blk(gate * inp(x)))``: ``gate`` (replicated) is used on request only; ``tail = [blk, head]`` runs
    under a reentrant ``torch.utils.checkpoint`` on request (its inner backward runs first and ends alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.tail = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor, use_gate: bool, reentrant: bool) -> torch.Tensor:
        h = self.inp(x)
        if use_gate:
            h = h * self.gate
        if reentrant:
            return torch.utils.checkpoint.checkpoint(self.tail, h, use_reentrant=True)
        return self.tail(h)


def _sum_accumulate(case: str) -> dict:
    """Two microbatches per rank, both backwards outside ``no_sync``, sum loss; the gradients against the
    single-process full-batch sum-loss gradient. ``case``: ``plain``; ``unused`` (``gate`` used in microbatch
    1 only: reduced there, then untouched); ``reentrant`` (a reentrant checkpoint: its inner backward ends first
    and reduces the tail's replicated gradients, the outer end reduces again; gate used in both);
    ``reentrant-1`` (the same with one microbatch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _SumNet().double()
    model = copy.deepcopy(ref)
    rt = GTPRuntime(build_mesh(gtp=world, timeout=None).gtp, GTPOptions(grad_mode="sum"))
    shard_linears(model, rt)
    g = torch.Generator().manual_seed(1)
    micro, per = (1 if case == "reentrant-1" else 2), 3
    X = torch.randn(world, micro, per, 5, generator=g, dtype=torch.float64)
    Y = torch.randn(world, micro, per, 3, generator=g, dtype=torch.float64)
    gate_in = [True, case != "unused"][:micro]
    reentrant = case.startswith("reentrant")
    for m in range(micro):
        out = model(X[rank, m], gate_in[m], reentrant)
        F.mse_loss(out, Y[rank, m], reduction="sum").backward()
    loss = sum(F.mse_loss(ref(X[r, m], gate_in[m], False), Y[r, m], reduction="sum")
               for r in range(world) for m in range(micro))
    loss.backward()
    got, want = {}, {}
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        gw = getattr(p, "gtp", None)
        if gw is None:
            got[n], want[n] = p.grad.clone(), q.grad.clone()
        else:  # this rank's rows of the dense gradient (pad rows zero)
            full = torch.zeros(gw.padded_out, gw.in_features, dtype=torch.float64)
            full[: gw.out_features] = q.grad
            got[n], want[n] = p.grad.clone(), full[gw.shard_slice]
    return {"got": got, "want": want}


@pytest.mark.parametrize("case", ["plain", "unused", "reentrant", "reentrant-1"])
def test_sum_mode_accumulation_without_no_sync_is_exact(case: str) -> None:
    """grad_mode="sum" with backwards outside ``no_sync``: every gradient equals the full-batch sum-loss
    gradient (a replicated gradient reduced by an earlier backward end was summed again: ``N * sum(g1) +
    sum(g2)``). Tolerance: float64 sums
    of at most 2 ranks x 2 microbatches x 3 rows x 6 features in other orders, O(k eps64) relative, k <= 10^2."""
    tol = 1e2 * torch.finfo(torch.float64).eps
    for r in run_ranks(_sum_accumulate, 2, case):
        for n, want in r["want"].items():
            torch.testing.assert_close(r["got"][n], want, rtol=tol, atol=tol * want.abs().max().item(), msg=n)


def _unfrozen_after_shard(_: int) -> dict:
    """Freeze, shard, unfreeze the last LayerNorm and a bias (no GTP weight trains, so no GTP backward queues
    the replicated all-reduce): the step is refused on every rank; after ``rt.attach(model)`` it trains like the
    single-process model."""
    from lowband.parallel.gtp import GTPStateError

    torch.set_default_dtype(torch.float64)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4))
    model.requires_grad_(False)
    ref = copy.deepcopy(model)
    rt = GTPRuntime(build_mesh(gtp=world).gtp)
    shard_linears(model, rt)
    for m in (model, ref):
        m[3].requires_grad_(True)
        m[2].bias.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    X, Y = _data(4 * world, 6, 4)
    sl = slice(4 * rank, 4 * rank + 4)
    F.mse_loss(model(X[sl]), Y[sl]).backward()
    try:
        opt.step()
        refused = "no error"
    except GTPStateError as e:
        refused = str(e)
    opt.zero_grad()
    rt.attach(model)
    for _ in range(2):
        F.mse_loss(model(X[sl]), Y[sl]).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(X), Y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in ((model[3].weight, ref[3].weight), (model[3].bias, ref[3].bias)))
    return {"refused": refused, "diff": diff}


def test_a_parameter_unfrozen_after_sharding_is_refused_until_attached():
    """Regression: it was never averaged (no hook), so the ranks silently stepped apart."""
    res = run_ranks(_unfrozen_after_shard, 2, 0, timeout=TIMEOUT)
    assert res[0]["refused"] == res[1]["refused"]
    assert res[0]["refused"].startswith("GTP: replicated parameters ['2.bias', '3.bias', '3.weight'] are trainable "
                                        "now but were not when GTP attached the model"), res
    assert all(r["diff"] <= 1e-12 for r in res), res
