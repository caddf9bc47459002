"""Streaming DiLoCo on a model with frozen, adapter, conditionally used and replica-only parameters and
buffers (issue 20, DiLoCo's part), per-rank seeded, against a single-process simulation.

Model: :class:`tests.external.conditional_model.ConditionalNet` (frozen embedding and frozen linear,
LoRA-style adapter, a branch used on even steps only, ``lane0`` used by replica 0 only and not on
every third step, a per-rank random buffer ``mix`` and a forward counter ``calls``). Every rank trains
on its own data lane ``rank``. The inner strategies: one replica per rank with torch AdamW over
``model.parameters()`` (frozen ones included: torch skips ``.grad is None``); 2 replicas x 2 ranks with
ShardedAdamW over the replica's dp ranks; 2 replicas x 2 ranks with GTP inside the replica. The wire
codecs: lossless fp64, and the lossy int8 and top-k with error feedback.

The semantics under test (docs/diloco.md, "Frozen, unused and conditional parameters"):

* ``init_sync`` makes every parameter, frozen ones too, and every buffer equal to replica 0's;
  ``"verify"`` names the first parameter or buffer that differs;
* frozen parameters are in no fragment and never change (bitwise replica 0's initial values);
* a fragment parameter that a replica did not use contributes a zero pseudo-gradient from that
  replica (averaged with the others'); the outer optimizer steps every fragment parameter (torchft:
  ``p.grad = pseudo-gradient`` for all of them), so outer momentum moves even one that no replica
  touched since the last sync;
* buffers are never synced after ``init_sync``.

The simulation runs every replica in one process with the same arithmetic in the same order (AdamW per
replica on the mean of its lanes' gradients, flat fp64 pseudo-gradients plus the error-feedback residual
averaged by :func:`reference_wire_all_reduce`, the residual kept by :func:`sender_roundtrip`, torch SGD
per fragment on the global copies): the distributed run must equal it bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.comm.codecs import MESSAGE_CODECS, get_wire, reference_wire_all_reduce, sender_roundtrip
from lowband.diloco import StreamingDiLoCo, replica_mesh, split_fragments
from lowband.diloco.state import GTPShardLayout
from lowband.optim import ShardedAdamW
from lowband.parallel.gtp import GTPRuntime, shard_linears
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.conditional_model import lane_batch, seeded_net

H, NFRAG, TAU = 4, 2, 1
LR = 1e-2
FROZEN = ["emb.weight", "base.weight", "base.bias"]


def _inner(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _outer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _state(model) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}}


ADAMW_ONLY = {"replicas": None, "dp": 1, "inner": "adamw", "wire": "fp64", "ef": None}
"""The base case: one replica per rank, torch AdamW inner, lossless fp64 wire."""
BLOCK, TOPK_CHUNK, TOPK_K = 8, 8, 2  # codec settings (block scale per 8 values; top-2 of every 8)


def _worker(steps: int, cfg: dict | None = None) -> dict:
    """One rank: replica ``rank // dp``, data lane ``rank`` (``lane0`` runs on rank 0 only)."""
    cfg = {**ADAMW_ONLY, **(cfg or {})}
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = cfg["dp"]
    model = seeded_net(rank)  # nanoGPT style: every replica different, frozen weights and buffers too
    before = _state(model)
    layout = None
    fragments: int | list = NFRAG
    breaks = None
    if cfg["inner"] == "adamw":
        assert dp == 1
        cross = Comm(name="replica")
        opt = _inner(model.parameters())
    elif cfg["inner"] == "sharded":  # ZeRO-style AdamW over the replica's dp ranks (inits its replica alike)
        mesh = replica_mesh(world // dp)
        cross = mesh.replica
        opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=0.1, comm=mesh.dp, module=model,
                           bucket_mb=1e-3)
    else:  # GTP over the replica's ranks (dp 1 inside); lane0 runs on one rank only: kept replicated
        frag_names = [f.names for f in split_fragments(model, NFRAG)]  # cut from the unsharded model
        mesh = build_mesh(replica=world // dp, gtp=dp)
        cross = mesh.replica
        shard_linears(model, GTPRuntime(mesh.gtp), include=lambda name, _m: name != "lane0")
        layout = GTPShardLayout(model)
        params = dict(model.named_parameters())
        fragments, breaks = [], []  # as the trainer does: whole parameters, a bucket break, then shards
        for names in frag_names:
            whole = [n for n in names if n not in layout.weights]
            fragments.append([params[n] for n in whole + [n for n in names if n in layout.weights]])
            breaks.append([sum(params[n].numel() for n in whole)])
        opt = _inner(model.parameters())
    dl = StreamingDiLoCo(model, opt, comm=cross, sync_every=H, fragments=fragments, delay=TAU,
                         outer_optimizer=_outer, wire=cfg["wire"], block_size=BLOCK, topk_chunk=TOPK_CHUNK,
                         topk_k=TOPK_K, error_feedback=cfg["ef"], bucket_breaks=breaks)
    synced = _logical(model, layout)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(*lane_batch(step, rank), rank).backward()
        opt.step()
    dl.close()
    names = dict((id(p), n) for n, p in model.named_parameters())
    frag_names = [[names[id(p)] for p in f.params] for f in dl.frags]
    globals_ = {n: (g if layout is None else layout.to_logical(n, g)).clone()
                for ns, gs in zip(frag_names, dl.globals, strict=True) for n, g in zip(ns, gs, strict=True)}
    return {"before": before, "synced": synced, "after": _logical(model, layout), "committed": dl.committed,
            "globals": globals_, "frag_names": frag_names, "error_feedback": dl.error_feedback,
            "residuals": [None if r is None else r.clone() for r in dl.residuals]}


def _logical(model, layout) -> dict:
    """Parameters in logical (whole) shapes (GTP shards gathered: collective over the GTP group) and buffers."""
    st = _state(model)
    if layout is not None:
        st["params"] = {n: layout.to_logical(n, p) for n, p in st["params"].items()}
    return st


def _lane_grads(model, step: int, lanes: list[int]) -> None:
    """Set ``model``'s grads to the mean over ``lanes`` of each lane's gradient, the way data parallelism
    averages (a lane without a grad contributes zeros; no lane with one: ``.grad`` stays ``None``)."""
    grads = []
    for lane in lanes:
        model.zero_grad(set_to_none=True)
        model.calls.fill_(step)  # each rank's model has seen ``step`` forwards
        model(*lane_batch(step, lane), lane).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    model.calls.fill_(step + 1)
    for n, p in model.named_parameters():
        gs = [g[n] for g in grads]
        if all(g is None for g in gs):
            p.grad = None
            continue
        acc = (gs[0] if gs[0] is not None else torch.zeros_like(p)).clone()
        for g in gs[1:]:
            acc += g if g is not None else torch.zeros_like(p)
        p.grad = acc / len(lanes)


def _simulate(replicas: int, steps: int, cfg: dict | None = None) -> dict:
    """Every replica in one process, DiLoCo written out plainly; replica 0's initial weights and buffers.
    With ``dp`` lanes per replica the inner gradient is the lanes' average (:func:`_lane_grads`); with
    error feedback each replica adds its fragment's residual before encoding and keeps what its own
    message dropped (``pending - sender_roundtrip(pending)``), as lowband.diloco does."""
    cfg = {**ADAMW_ONLY, **(cfg or {})}
    dp = cfg["dp"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [seeded_net(0) for _ in range(replicas)]
        opts = [_inner(m.parameters()) for m in models]
        names = [f.names for f in split_fragments(models[0], NFRAG)]
        params = [dict(m.named_parameters()) for m in models]
        globals_ = [[params[0][n].detach().clone() for n in ns] for ns in names]
        outer = [_outer(g) for g in globals_]
        codec = get_wire(cfg["wire"], BLOCK, TOPK_CHUNK, TOPK_K)
        ef = cfg["wire"] in MESSAGE_CODECS if cfg["ef"] is None else cfg["ef"]
        residuals = [[torch.zeros(sum(params[0][n].numel() for n in ns), dtype=torch.float64) if ef else None
                      for ns in names] for _ in range(replicas)]
        k = H // NFRAG
        local = committed = 0
        pending: list[torch.Tensor] = []
        for step in range(steps):
            for r, (m, o) in enumerate(zip(models, opts, strict=True)):
                o.zero_grad(set_to_none=True)
                if dp == 1:
                    m(*lane_batch(step, r), r).backward()
                else:
                    _lane_grads(m, step, [r * dp + d for d in range(dp)])
                o.step()
            local += 1
            f = committed % NFRAG
            if local == k - TAU:
                pending = [torch.cat([(g - params[r][n].detach()).reshape(-1) for g, n in zip(globals_[f], names[f])])
                           for r in range(replicas)]
                if ef:
                    pending = [pg + residuals[r][f] for r, pg in enumerate(pending)]
            if local == k:
                avg = reference_wire_all_reduce(pending, codec, "avg")
                if ef:
                    for r in range(replicas):
                        residuals[r][f] = pending[r] - sender_roundtrip(codec, pending[r], replicas)
                off = 0
                for g in globals_[f]:  # every fragment parameter gets a grad, zero or not (torchft)
                    g.grad = avg[off:off + g.numel()].view(g.shape).clone()
                    off += g.numel()
                outer[f].step()
                outer[f].zero_grad(set_to_none=True)
                with torch.no_grad():
                    for r in range(replicas):
                        for g, n in zip(globals_[f], names[f]):
                            params[r][n].copy_(g)
                committed += 1
                local = 0
        return {"after": [_state(m) for m in models], "committed": committed, "frag_names": names,
                "globals": {n: g for ns, gs in zip(names, globals_) for n, g in zip(ns, gs)},
                "globals_list": globals_, "residuals": residuals, "error_feedback": ef}
    finally:
        torch.set_num_threads(threads)


def _check(out: list[dict], sim: dict, dp: int, steps: int) -> None:
    """Every rank against the simulation: init sync (frozen parameters and buffers are replica 0's),
    frozen parameters never change, local weights, buffers, global copies and residuals equal the
    simulation bitwise."""
    init = _state(seeded_net(0))
    assert not torch.equal(out[0]["before"]["params"]["emb.weight"], out[-1]["before"]["params"]["emb.weight"])
    assert not torch.equal(out[0]["before"]["buffers"]["mix"], out[-1]["before"]["buffers"]["mix"])

    for rank, o in enumerate(out):
        replica = rank // dp
        for kind in ("params", "buffers"):  # init_sync: every parameter (frozen too) and buffer is replica 0's
            for n, v in init[kind].items():
                assert torch.equal(o["synced"][kind][n], v), f"rank {rank}: {kind} {n} after init_sync"
        assert sorted(map(sorted, o["frag_names"])) == sorted(map(sorted, sim["frag_names"]))
        assert not set(FROZEN) & {n for ns in o["frag_names"] for n in ns}
        assert o["committed"] == sim["committed"] == (steps // (H // NFRAG))
        assert o["error_feedback"] == sim["error_feedback"]
        for n in FROZEN:
            assert torch.equal(o["after"]["params"][n], init["params"][n]), f"rank {rank}: frozen {n} changed"
        for n, v in sim["after"][replica]["params"].items():
            assert torch.equal(o["after"]["params"][n], v), f"rank {rank}: param {n}"
        for n, v in sim["after"][replica]["buffers"].items():
            assert torch.equal(o["after"]["buffers"][n], v), f"rank {rank}: buffer {n}"
        assert o["globals"].keys() == sim["globals"].keys()
        for n, v in sim["globals"].items():
            assert torch.equal(o["globals"][n], v), f"rank {rank}: global copy of {n}"
        if sim["error_feedback"]:  # fragments in the simulation's order (no reordering without GTP)
            assert o["frag_names"] == sim["frag_names"]
            for f, (a, b) in enumerate(zip(o["residuals"], sim["residuals"][replica], strict=True)):
                assert torch.equal(a, b), f"rank {rank}: residual of fragment {f}"
                assert b.abs().max() > 0  # the codec really dropped something, and EF kept it


@pytest.mark.parametrize("world", [2, 4])
def test_frozen_params_and_buffers_synced_at_start_and_training_equals_simulation(world: int) -> None:
    steps = 11  # 5 syncs over 2 fragments (lane0 skipped on calls % 3 == 2, branch on odd calls)
    out = run_ranks(_worker, world, steps, timeout=120)
    sim = _simulate(world, steps)
    _check(out, sim, 1, steps)
    for o in out:
        assert o["frag_names"] == sim["frag_names"]
    # lane0 is used by replica 0 only: on the other replicas the inner optimizer never touches it, so it
    # is exactly the global copy its fragment's last sync wrote (a zero pseudo-gradient from them)
    g = sim["globals"]["lane0.weight"]
    assert not torch.equal(out[0]["after"]["params"]["lane0.weight"], g)
    for o in out[1:]:
        assert torch.equal(o["after"]["params"]["lane0.weight"], g)
    assert all(int(o["after"]["buffers"]["calls"]) == steps for o in out)  # buffers: per replica, not synced


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("wire", "ef"), [("int8", True), ("topk", None)], ids=["int8-ef", "topk-ef"])
def test_lossy_codecs_with_error_feedback_equal_simulation(world: int, wire: str, ef: bool | None) -> None:
    """int8 (block scales, error feedback asked for) and top-k (2 of every 8 values kept, error feedback
    on by default) on the pseudo-gradients: the averaged pseudo-gradient, global copies, local weights
    and every replica's residual equal the simulation's :func:`reference_wire_all_reduce` and
    ``sender_roundtrip`` bitwise (the same encode / decode / average arithmetic in the same order)."""
    steps = 11
    cfg = {"wire": wire, "ef": ef}
    out = run_ranks(_worker, world, steps, cfg, timeout=120)
    sim = _simulate(world, steps, cfg)
    assert sim["error_feedback"]
    _check(out, sim, 1, steps)


@pytest.mark.parametrize(("inner", "wire"), [("sharded", "fp64"), ("sharded", "topk"), ("gtp", "fp64")])
def test_inner_strategies_equal_simulation(inner: str, wire: str) -> None:
    """4 ranks = 2 replicas x 2 ranks, each replica training with ``inner`` over its 2 ranks (data lanes
    ``rank``: lane0 runs on rank 0 only, so inside replica 0 it is averaged with zeros and replica 1 never
    uses it): ``sharded`` = ShardedAdamW over the replica's dp ranks (its own init sync inside the replica,
    DiLoCo's across replicas), ``gtp`` = GTP over the replica's ranks (every linear but lane0 sharded; the
    fragments list whole parameters, a bucket break, then row shards, as the trainer builds them) with
    torch AdamW. The simulation is torch AdamW on the mean of the replica's lanes' gradients.

    Bitwise, both: the arithmetic is the simulation's. Each lane's gradient is the same matmuls (GTP
    gathers the whole weight and runs the lane's forward and backward on it; its weight gradient is the
    lane's ``dY^T X``); the average of two lanes, by reduce-scatter or all-reduce, is ``(a + b) / 2`` in
    either order (two terms commute, halving is exact); ShardedAdamW's update is torch AdamW's arithmetic
    and torch AdamW on a row shard is elementwise; the fp64 wire is lossless and top-k encodes the same
    whole-parameter buckets as the simulation.
    """
    steps = 11
    cfg = {"inner": inner, "dp": 2, "wire": wire}
    out = run_ranks(_worker, 4, steps, cfg, timeout=120)
    sim = _simulate(2, steps, cfg)
    _check(out, sim, 2, steps)
    for a, b in ((out[0], out[1]), (out[2], out[3])):  # the ranks of one replica hold the same model
        for n, v in a["after"]["params"].items():
            assert torch.equal(b["after"]["params"][n], v), n


def _verify_worker(case: str) -> str:
    rank = dist.get_rank()
    model = seeded_net(rank if case == "seeds" else 0)
    if case == "buffer" and rank == 1:
        model.mix.add_(1.0)
    try:
        dl = StreamingDiLoCo(model, _inner(model.parameters()), comm=Comm(name="replica"), sync_every=H,
                             fragments=NFRAG, init_sync="verify")
    except ValueError as e:
        return str(e)
    dl.close()
    return "ok"


def test_verify_covers_frozen_parameters_and_buffers() -> None:
    """Per-rank seeds: the first tensor that differs is the frozen embedding (before any fragment's);
    equal weights but one buffer apart: the buffer is named. On every rank alike."""
    seeds = run_ranks(_verify_worker, 2, "seeds", timeout=60)
    assert all("init_sync='verify': parameter 'emb.weight' differs between replicas (replica 0 vs [1])" in m
               for m in seeds), seeds
    buffer = run_ranks(_verify_worker, 2, "buffer", timeout=60)
    assert all("init_sync='verify': buffer 'mix' differs between replicas (replica 0 vs [1])" in m
               for m in buffer), buffer
    assert run_ranks(_verify_worker, 2, "same", timeout=60) == ["ok", "ok"]


def _late_trainable_worker(variant: str) -> str:
    """2 replicas: a parameter starts training after StreamingDiLoCo was built; returns the refusal."""
    from torch import nn

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(False)  # frozen at build time: in no fragment
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = StreamingDiLoCo(model, inner, comm=Comm(name="replica"), sync_every=2, fragments=1)
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(6):
            if step == 1:
                if variant == "unfreeze":
                    model[0].weight.requires_grad_(True)
                else:  # an adapter injected after DiLoCo was built
                    model.add_module("extra", nn.Linear(2, 2).double())
                    inner.add_param_group({"params": list(model.extra.parameters())})
            x = torch.randn(3, 4, generator=g, dtype=torch.float64)
            inner.zero_grad()
            out = model[2](model[1](model[0](x)))
            if variant == "adapter" and step >= 1:
                out = out + model.extra(out)
            out.square().sum().backward()
            inner.step()
    except ValueError as e:
        return f"step {step}: {e}"
    finally:
        diloco.close()
    return "no error"


@pytest.mark.parametrize(("variant", "names"), [("unfreeze", "['0.weight'] is trained"),
                                                ("adapter", "['extra.weight', 'extra.bias'] are trained")])
def test_a_parameter_trained_after_diloco_was_built_is_refused_by_name(variant: str, names: str) -> None:
    """Unfreezing a parameter, or adding an adapter, after StreamingDiLoCo was built: nothing synced it, each
    replica trained its own copy for the rest of the run (0.09-0.5 apart after 4 syncs). Refused at the next
    fragment's prepare (step 2 here), on every replica, naming it."""
    out = run_ranks(_late_trainable_worker, 2, variant, timeout=60)
    assert out[0] == out[1], out
    assert out[0].startswith(f"step 1: diloco: {names} but in no fragment"), out[0]
