"""Streaming DiLoCo on 1-4 gloo ranks (one replica per rank, or a 2 replicas x 2 dp mesh) against a
single-process simulation of the same replicas: global weights and outer-optimizer state after every
sync, bit for bit, for every wire codec; exact collective counts and bytes per fragment."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.comm.codecs import Codec, chunk_layout, get_wire, reference_wire_all_reduce, sender_roundtrip
from lowband.comm.compress import MESSAGE_CODECS
from lowband.diloco import ScheduleConfig, StreamingDiLoCo, plan, replica_mesh
from lowband.optim import ShardedAdamW
from lowband.testing import run_ranks
from lowband.train.config import Config


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16, dtype=dtype)
        self.blocks = nn.ModuleList(nn.Linear(16, 16, dtype=dtype) for _ in range(3))
        self.out = nn.Linear(16, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.out(x)


def _batch(replica: int, dp_rank: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * replica + 100 * dp_rank + step)
    return torch.randn(4, 6, generator=g, dtype=dtype), torch.randn(4, 3, generator=g, dtype=dtype)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _outer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups for p in g["params"]
            if "momentum_buffer" in opt.state[p]]


def _replica_worker(cfg: dict) -> dict:
    """One rank: replica ``rank // dp`` of ``world // dp``; inner data parallelism over dp ranks."""
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    dp = cfg.get("dp", 1)
    ledger = CommLedger()
    if dp > 1:
        mesh = replica_mesh(dist.get_world_size() // dp, ledger=ledger)
        cross, dp_comm, replica, dp_rank = mesh.replica, mesh.dp, mesh.coords.replica, mesh.coords.dp
    else:
        cross, dp_comm, replica, dp_rank = Comm(name="replica", ledger=ledger), None, dist.get_rank(), 0
    if cfg.get("perturb_init"):  # replicas start different; init_sync makes them equal
        with torch.no_grad():
            for p in Net(dtype).parameters():
                p.add_(dist.get_rank())
    model = Net(dtype)
    if cfg.get("perturb_init"):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * dist.get_rank())
    sharded_inner = cfg.get("inner") == "sharded"
    if sharded_inner:  # ZeRO-style sharded AdamW over the replica's dp ranks (reduce-scatter + all-gather)
        opt = ShardedAdamW(model.parameters(), lr=cfg["lr"], comm=dp_comm, bucket_mb=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    snaps: list[dict] = []
    diloco = StreamingDiLoCo(model, opt, comm=cross, sync_every=cfg["H"], fragments=cfg["n"],
                             delay=cfg["tau"], alpha=cfg["alpha"], wire=cfg["wire"],
                             block_size=cfg.get("block", 16), bucket_cap_mb=cfg.get("bucket_cap_mb"),
                             topk_chunk=cfg.get("chunk", 8), topk_k=cfg.get("k", 2),
                             error_feedback=cfg.get("ef"), ef_decay=cfg.get("ef_decay", 1.0))

    def on_sync(d: StreamingDiLoCo, i: int) -> None:
        snaps.append({"committed": d.committed, "fragment": i,
                      "globals": [[g.clone() for g in gs] for gs in d.globals],
                      "outer": [_outer_state(o) for o in d.outer],
                      "residuals": [None if r is None else r.clone() for r in d.residuals]})

    diloco.add_sync_callback(on_sync)
    for step in range(cfg["steps"]):
        x, y = _batch(replica, dp_rank, step, dtype)
        opt.zero_grad()
        _loss(model, x, y).backward()
        if dp_comm is not None and not sharded_inner:
            for p in model.parameters():
                dp_comm.all_reduce(p.grad, "avg", tag="grad")
        opt.step()
    diloco.close()
    recs = [(r.op, r.tag, r.numel, r.wire_bytes, r.wire_dtype, r.group) for r in ledger.records
            if r.tag.startswith("diloco")]
    inner_ops = sorted({(r.op, r.group) for r in ledger.records if r.tag.startswith("grad:")})
    return {"snaps": snaps, "params": [p.detach().clone() for p in model.parameters()], "records": recs,
            "inner_ops": inner_ops,
            "frag_numels": [f.numel for f in diloco.frags]}


def _simulate(cfg: dict, replicas: int) -> dict:
    """Single-process reference: ``replicas`` models trained in turn, DiLoCo written out plainly."""
    dtype = getattr(torch, cfg["dtype"])
    dp = cfg.get("dp", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        if cfg.get("perturb_init"):
            Net(dtype)
        models = [Net(dtype)]
        for _ in range(1, replicas):
            m = Net(dtype)
            m.load_state_dict(models[0].state_dict())
            models.append(m)
        opts = [torch.optim.AdamW(m.parameters(), lr=cfg["lr"]) for m in models]
        n, h, tau, alpha = cfg["n"], cfg["H"], cfg["tau"], cfg["alpha"]
        k = h // n
        codec = get_wire(cfg["wire"], cfg.get("block", 16), cfg.get("chunk", 8), cfg.get("k", 2))
        ef = cfg.get("ef")
        ef = cfg["wire"] in MESSAGE_CODECS if ef is None else ef
        # fragments: the default consecutive split, computed on the first model (names are enough)
        from lowband.diloco import split_fragments
        frag_names = [f.names for f in split_fragments(models[0], n)]
        params = [dict(m.named_parameters()) for m in models]
        globals_ = [[params[0][nm].detach().clone() for nm in names] for names in frag_names]
        buf_dt = torch.float64 if dtype == torch.float64 else torch.float32
        residuals = [[torch.zeros(sum(params[0][nm].numel() for nm in names), dtype=buf_dt) if ef else None
                      for names in frag_names] for _ in range(replicas)]
        outer = [torch.optim.SGD(g, lr=0.7, momentum=0.9, nesterov=True) for g in globals_]
        buf_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        cap = cfg.get("bucket_cap_mb")
        snaps, local, committed, pending = [], 0, 0, None
        for step in range(cfg["steps"]):
            for r, (m, o) in enumerate(zip(models, opts)):
                o.zero_grad()
                if dp == 1:
                    _loss(m, *_batch(r, 0, step, dtype)).backward()
                else:
                    grads = []
                    for d in range(dp):
                        m.zero_grad()
                        _loss(m, *_batch(r, d, step, dtype)).backward()
                        grads.append([p.grad.clone() for p in m.parameters()])
                    for i, p in enumerate(m.parameters()):
                        acc = grads[0][i].clone()
                        for d in range(1, dp):
                            acc += grads[d][i]
                        p.grad = acc / dp
                o.step()
            local += 1
            f = committed % n
            if local == k - tau:  # prepare: every replica's pseudo-gradient, flat
                pending = []
                for r in range(replicas):
                    pg = torch.cat([(g.to(buf_dtype) - params[r][nm].detach().to(buf_dtype))
                                    .reshape(-1) for g, nm in zip(globals_[f], frag_names[f])])
                    beta = cfg.get("ef_decay", 1.0)  # SparseLoCo's decay: the product, then the sum
                    pending.append(pg + (residuals[r][f] if beta == 1.0 else residuals[r][f] * beta) if ef else pg)
            if local == k:  # sync
                numel = pending[0].numel()
                esize = 8 if buf_dtype == torch.float64 else 4
                cap_elems = None if cap is None else max(1, int(cap * 2**20) // esize)
                bounds = [(0, numel)] if cap_elems is None or cap_elems >= numel else \
                    [(s, min(s + cap_elems, numel)) for s in range(0, numel, cap_elems)]
                avg = torch.cat([reference_wire_all_reduce([pg[s:e] for pg in pending], codec, "avg")
                                 for s, e in bounds])
                if ef:  # each replica keeps what its own message dropped, bucket by bucket
                    for r in range(replicas):
                        residuals[r][f] = torch.cat([pending[r][s:e] - sender_roundtrip(codec, pending[r][s:e],
                                                                                         replicas)
                                                     for s, e in bounds])
                off = 0
                for g in globals_[f]:
                    g.grad = avg[off:off + g.numel()].view(g.shape).to(g.dtype).clone()
                    off += g.numel()
                outer[f].step()
                outer[f].zero_grad(set_to_none=True)
                with torch.no_grad():
                    for r in range(replicas):
                        for g, nm in zip(globals_[f], frag_names[f]):
                            p = params[r][nm]
                            saved = p.detach().clone()
                            p.copy_(g)
                            if alpha != 0.0:
                                p.lerp_(saved, alpha)
                committed += 1
                local = 0
                snaps.append({"committed": committed, "fragment": f,
                              "globals": [[g.clone() for g in gs] for gs in globals_],
                              "outer": [_outer_state(o) for o in outer],
                              "residuals": [[None if x is None else x.clone() for x in rs] for rs in residuals]})
        return {"snaps": snaps, "models": [[p.detach().clone() for p in m.parameters()] for m in models]}
    finally:
        torch.set_num_threads(threads)


def _assert_snaps_equal(a: list[dict], b: list[dict], what: str, replica: int = 0) -> None:
    assert len(a) == len(b), what
    for sa, sb in zip(a, b):
        for ra, rb in zip(sa["residuals"], sb["residuals"][replica]):  # this replica's own residuals
            assert (ra is None and rb is None) or torch.equal(ra, rb), f"{what}: residual differs"
        assert sa["committed"] == sb["committed"] and sa["fragment"] == sb["fragment"], what
        for ga, gb in zip(sa["globals"], sb["globals"]):
            for x, y in zip(ga, gb):
                assert torch.equal(x, y), f"{what}: global copy differs at commit {sa['committed']}"
        for oa, ob in zip(sa["outer"], sb["outer"]):
            assert len(oa) == len(ob)
            for x, y in zip(oa, ob):
                assert torch.equal(x, y), f"{what}: outer state differs at commit {sa['committed']}"


def _check(cfg: dict, world: int) -> list[dict]:
    dp = cfg.get("dp", 1)
    replicas = world // dp
    out = run_ranks(_replica_worker, world, cfg, timeout=90)
    sim = _simulate(cfg, replicas)
    k = cfg["H"] // cfg["n"]
    n_syncs = cfg["steps"] // k
    assert len(sim["snaps"]) == n_syncs and [s["fragment"] for s in sim["snaps"]] == \
        [i % cfg["n"] for i in range(n_syncs)]
    for rank, res in enumerate(out):
        _assert_snaps_equal(res["snaps"], sim["snaps"], f"rank {rank} vs simulation", rank // dp)
        for x, y in zip(res["params"], sim["models"][rank // dp]):
            assert torch.equal(x, y), f"rank {rank}: local weights differ from the simulation"
    # ledger: per sync and bucket one all-to-all and one all-gather, exact encoded bytes
    codec = get_wire(cfg["wire"], cfg.get("block", 16), cfg.get("chunk", 8), cfg.get("k", 2))
    numels = out[0]["frag_numels"]
    for res in out:
        recs = [r for r in res["records"] if r[1] != "diloco:init"]
        expect = []
        prepares = [f for _, a, f in plan(cfg["steps"], ScheduleConfig(cfg["n"], cfg["H"], cfg["tau"]))
                    if a == "prepare"]  # the last one may still be in flight at close()
        for f in prepares:
            numel = numels[f]
            esize = 8 if cfg["dtype"] == "float64" else 4
            cap = cfg.get("bucket_cap_mb")
            ce = None if cap is None else max(1, int(cap * 2**20) // esize)
            sizes = [numel] if ce is None or ce >= numel else \
                [min(ce, numel - s) for s in range(0, numel, ce)]
            if not isinstance(codec, Codec):  # message codec: one all-gather of the messages per bucket
                for sz in sizes:
                    mb = codec.message_nbytes(sz)
                    expect.append(("all_gather", f"diloco:frag{f}", replicas * mb, (replicas - 1) * mb, "uint8",
                                   "replica"))
                continue
            for sz in sizes:
                eb = codec.encoded_nbytes(chunk_layout(sz, replicas, codec))
                expect.append(("all_to_all", f"diloco:frag{f}", replicas * eb, (replicas - 1) * eb, "uint8",
                               "replica"))
            for sz in sizes:
                eb = codec.encoded_nbytes(chunk_layout(sz, replicas, codec))
                expect.append(("all_gather", f"diloco:frag{f}", replicas * eb, (replicas - 1) * eb, "uint8",
                               "replica"))
        # all-to-alls of a sync are issued at prepare, all-gathers by poll/wait: compare per sync
        assert sorted(recs) == sorted(expect)
        init = [r for r in res["records"] if r[1] == "diloco:init"]
        assert len(init) == (len(res["params"]) if replicas > 1 else 0)
    return out


BASE = {"dtype": "float32", "n": 2, "H": 4, "tau": 1, "alpha": 0.5, "wire": "fp32", "lr": 0.05, "steps": 9}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_replicas_match_simulation_fp32(world: int) -> None:
    _check(BASE, world)


@pytest.mark.parametrize("wire", ["bf16", "fp8", "int8"])
def test_replicas_match_simulation_quantized(wire: str) -> None:
    _check({**BASE, "wire": wire}, 3)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("wire", ["int4", "int2", "topk", "topk-int4", "topk-int2", "topk-rice-int2"])
def test_message_codecs_with_error_feedback_match_simulation(wire: str, world: int) -> None:
    """Every replica's global copies, outer state and own residuals after every sync, bit for bit
    against the single-process simulation (residuals kept per replica, decoded messages summed in
    rank order), with exact all-gather bytes (float32; chunk 8, k 2, block 4)."""
    _check({**BASE, "wire": wire, "block": 4}, world)


def test_error_feedback_float64_matches_simulation() -> None:
    """float64 model and buffers: error feedback (int2 and int8 with EF forced on) equals the
    plain float64 simulation bit for bit, with buckets so residuals straddle bucket boundaries."""
    _check({**BASE, "dtype": "float64", "wire": "topk-int2", "block": 4, "tau": 0, "alpha": 0.0,
            "bucket_cap_mb": 400 / 2**20}, 2)
    _check({**BASE, "dtype": "float64", "wire": "int8", "ef": True, "block": 8}, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_decay_matches_simulation(world: int) -> None:
    """``ef_decay = 0.5``: every replica's residuals, global copies and outer state after every sync equal the
    simulation that sends ``g + 0.5 e``, bit for bit; and the decay really acts (the residuals differ from
    those of plain error feedback)."""
    cfg = {**BASE, "wire": "topk-int2", "block": 4, "ef_decay": 0.5}
    out = _check(cfg, world)
    plain = _simulate({**cfg, "ef_decay": 1.0}, world)
    assert any(not torch.equal(a, b) for a, b in zip(out[0]["snaps"][-1]["residuals"],
                                                     plain["snaps"][-1]["residuals"][0]))


def test_error_feedback_decay_is_refused_without_error_feedback() -> None:
    model = Net(torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"diloco ef_decay must be in \(0, 1\] \(1 = plain error feedback\); got 0"):
        StreamingDiLoCo(model, opt, sync_every=2, ef_decay=0, wire="topk-int2", init_sync=False)
    with pytest.raises(ValueError, match=r"diloco ef_decay=0\.9 decays the error-feedback residual, but error "
                                         r"feedback is off"):
        StreamingDiLoCo(model, opt, sync_every=2, ef_decay=0.9, wire="int8", init_sync=False)


def test_topk_keeping_everything_equals_dense_fp32() -> None:
    """k = chunk keeps every value in fp32: the reduction, and so the whole run, equals the dense
    fp32 path bit for bit (same rank-order sum, same division)."""
    dense = run_ranks(_replica_worker, 3, {**BASE, "wire": "fp32"}, timeout=90)
    topk = run_ranks(_replica_worker, 3, {**BASE, "wire": "topk", "chunk": 8, "k": 8}, timeout=90)
    for a, b in zip(dense, topk):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)
        for sa, sb in zip(a["snaps"], b["snaps"]):
            assert all(torch.equal(x, y) for ga, gb in zip(sa["globals"], sb["globals"]) for x, y in zip(ga, gb))
            assert all(r is not None and not bool(r.any()) for r in sb["residuals"])  # nothing dropped


def _nonfinite_worker(cfg: dict) -> str:
    torch.manual_seed(0)
    model = Net(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = Comm(name="replica", ledger=CommLedger())
    dl = StreamingDiLoCo(model, opt, comm=comm, sync_every=2, wire=cfg["wire"], block_size=4, topk_chunk=8,
                         topk_k=2)
    try:
        for step in range(2):
            x, y = _batch(dist.get_rank(), 0, step, torch.float32)
            opt.zero_grad()
            _loss(model, x, y).backward()
            if step == 1 and dist.get_rank() == cfg["bad"]:
                with torch.no_grad():
                    model.out.bias.grad[0] = float("nan")
            opt.step()
    except FloatingPointError as e:
        assert dl.committed == 0 and dl.in_flight is None
        return str(e)
    return "no error"


@pytest.mark.parametrize("wire", ["fp32", "int8", "int2", "topk-int2"])
def test_nonfinite_pseudo_gradient_is_an_error_on_every_replica(wire: str) -> None:
    out = run_ranks(_nonfinite_worker, 3, {"wire": wire, "bad": 1}, timeout=90)
    for rank, msg in enumerate(out):
        assert "averaged pseudo-gradient of fragment 0" in msg and "non-finite" in msg, (rank, msg)
        assert ("NOT finite" in msg) == (rank == 1)


def test_float64_tau0_alpha0_three_fragments() -> None:
    _check({**BASE, "dtype": "float64", "wire": "fp64", "n": 3, "H": 6, "tau": 0, "alpha": 0.0,
            "steps": 8}, 2)


def test_bucketing_and_init_sync() -> None:
    # 100 bytes per bucket -> 25-element buckets; replicas start from different weights
    _check({**BASE, "bucket_cap_mb": 100 / 2**20, "perturb_init": True, "wire": "int8", "block": 8}, 2)


def test_replica_x_dp_mesh() -> None:
    out = _check({**BASE, "dp": 2, "steps": 6, "tau": 0, "H": 2}, 4)
    assert all(r[5] == "replica" for res in out for r in res["records"])


def test_replica_x_dp_with_sharded_optimizer_inside() -> None:
    """2 replicas x 2 dp ranks, each replica training with ShardedAdamW (several small buckets) inside:
    bit-equal to the simulation with plain AdamW on the replica's averaged gradient."""
    out = _check({**BASE, "dp": 2, "steps": 6, "tau": 1, "H": 4, "inner": "sharded"}, 4)
    assert all(r[5] == "replica" for res in out for r in res["records"])
    assert all(res["inner_ops"] == [("reduce_scatter", "dp")] for res in out)  # grads went the sharded way


# ------------------------------------------------------------------------------------ the trainer
def _tiny_trainer_config(shard: str, world: int, **diloco) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, 8, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, 2
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-2, 2
    cfg.strategy.name = "diloco"
    for k, v in diloco.items():
        setattr(cfg.diloco, k, v)
    return cfg


def _trainer_worker(cfg: Config) -> dict:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False)
    d = res.strategy.diloco
    recs = [(r.op, r.tag, r.group, r.wire_bytes) for r in res.strategy.env.ledger.records]
    out = {"globals": [[g.clone() for g in gs] for gs in d.globals], "committed": d.committed,
           "params": [p.detach().clone() for p in res.strategy.unwrapped().parameters()], "records": recs,
           "outer": [_outer_state(o) for o in d.outer], "numels": [f.numel for f in d.frags],
           "residuals": [None if r is None else r.clone() for r in d.residuals]}
    d.close()
    return out


def _single_worker(cfg: Config) -> list[torch.Tensor]:
    from lowband.train.trainer import train

    res = train(cfg, write_run_dir=False, log=False)
    return [p.detach().clone() for p in res.strategy.unwrapped().parameters()]


@pytest.mark.parametrize(("world", "replicas"), [(2, 0), (4, 2)])
def test_trainer_strategy_replicas_agree(shard: str, world: int, replicas: int) -> None:
    """``strategy.name = "diloco"``: every rank ends with the same global copies and outer state;
    the dp ranks of one replica hold the same local weights; the outer traffic is on the replica
    group with tags per fragment."""
    cfg = _tiny_trainer_config(shard, world, num_replicas=replicas, sync_every=4, fragments=2, delay=1,
                               wire="int8", block_size=16)
    out = run_ranks(_trainer_worker, world, cfg, timeout=120)
    n_rep = replicas or world
    dp = world // n_rep
    for res in out:
        assert res["committed"] == 4  # 8 steps, K = 2
        for ga, gb in zip(res["globals"], out[0]["globals"]):
            assert all(torch.equal(x, y) for x, y in zip(ga, gb))
        for oa, ob in zip(res["outer"], out[0]["outer"]):
            assert all(torch.equal(x, y) for x, y in zip(oa, ob))
        diloco_recs = [r for r in res["records"] if r[1].startswith("diloco:frag")]
        assert {r[2] for r in diloco_recs} == {"replica"}
        assert [r[1] for r in diloco_recs if r[0] == "all_to_all"] == \
            ["diloco:frag0", "diloco:frag1", "diloco:frag0", "diloco:frag1"]
        codec = get_wire("int8", 16)
        expect = sum(2 * (n_rep - 1) * codec.encoded_nbytes(chunk_layout(res["numels"][i % 2], n_rep, codec))
                     for i in range(4))
        assert sum(r[3] for r in diloco_recs) == expect
        if dp > 1:
            assert any(r[1] == "grad" and r[2] == "dp" for r in res["records"])
    for r in range(n_rep):
        for d in range(1, dp):
            a, b = out[r * dp]["params"], out[r * dp + d]["params"]
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    if dp == 1:  # different data per replica: local weights differ, global copies agree
        assert not all(torch.equal(x, y) for x, y in zip(out[0]["params"], out[1]["params"]))


def test_trainer_message_codec_with_error_feedback(shard: str) -> None:
    """``diloco.wire = "topk-int2"`` through the trainer (2 replicas): identical global copies on both,
    residuals on (auto) and different per replica, one all-gather per sync with the exact message bytes."""
    cfg = _tiny_trainer_config(shard, 2, sync_every=4, fragments=2, delay=1, wire="topk-int2", block_size=16,
                               topk_chunk=64, topk_k=4)
    out = run_ranks(_trainer_worker, 2, cfg, timeout=120)
    codec = get_wire("topk-int2", 16, 64, 4)
    for res in out:
        assert res["committed"] == 4
        for ga, gb in zip(res["globals"], out[0]["globals"]):
            assert all(torch.equal(x, y) for x, y in zip(ga, gb))
        recs = [r for r in res["records"] if r[1].startswith("diloco:frag")]
        assert [r[0] for r in recs] == ["all_gather"] * 4
        assert [r[3] for r in recs] == [codec.message_nbytes(res["numels"][i % 2]) for i in range(4)]
    assert all(r is not None for r in out[0]["residuals"])
    assert not all(torch.equal(a, b) for a, b in zip(out[0]["residuals"], out[1]["residuals"]))


def test_trainer_sharded_inner_equals_ddp_inner(shard: str) -> None:
    """``diloco.inner = "sharded-adamw"`` (2 replicas x 2 dp ranks, float64): the same global copies and
    local weights as DDP + AdamW inside each replica (1e-10), with the inner gradients reduce-scattered."""
    base = dict(num_replicas=2, sync_every=4, fragments=2, delay=1, wire="fp32")
    ddp = run_ranks(_trainer_worker, 4, _tiny_trainer_config(shard, 4, **base), timeout=120)
    sharded = run_ranks(_trainer_worker, 4, _tiny_trainer_config(shard, 4, inner="sharded-adamw", **base),
                        timeout=120)
    for a, b in zip(ddp, sharded):
        assert a["committed"] == b["committed"] == 4
        for ga, gb in zip(a["globals"], b["globals"]):
            for x, y in zip(ga, gb):
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
        for x, y in zip(a["params"], b["params"]):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
        assert any(r[0] == "reduce_scatter" and r[2] == "dp" for r in b["records"])
        assert not any(r[0] == "reduce_scatter" for r in a["records"])


def test_trainer_one_replica_alpha1_equals_single(shard: str) -> None:
    """alpha 1 keeps the local weights, so one DiLoCo replica trains exactly like ``single``."""
    cfg = _tiny_trainer_config(shard, 1, sync_every=4, fragments=2, delay=1, alpha=1.0, wire="fp32")
    single = _tiny_trainer_config(shard, 1)
    single.strategy.name = "single"
    a = run_ranks(_trainer_worker, 1, cfg, timeout=120)[0]["params"]
    b = run_ranks(_single_worker, 1, single, timeout=120)[0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("key", "value", "match"), [
    ("sync_every", 3, r"diloco.sync_every must be a positive multiple of diloco.fragments \(2\); got 3"),
    ("sync_every", 1, r"diloco.sync_every must be a positive multiple of diloco.fragments \(2\); got 1"),
    ("delay", 2, r"diloco.delay must be in \[0, diloco.sync_every / diloco.fragments\) = \[0, 2\); got 2"),
    ("delay", -1, r"diloco.delay must be in"),
    ("fragments", 0, r"diloco.fragments must be >= 1; got 0"),
    ("alpha", 1.5, r"diloco.alpha must be in \[0, 1\]"),
    ("wire", "fp4", "diloco.wire must be one of fp32, bf16, fp8, int8, int4, int2, topk, topk-int4, topk-int2, "
             "topk-rice, topk-rice-int4, topk-rice-int2"),
    ("topk_chunk", 100, r"diloco.topk_chunk must be a power of two in \[2, 65536\]; got 100"),
    ("topk_k", 0, r"diloco.topk_k must be in \[1, diloco.topk_chunk = 256\]; got 0"),
    ("error_feedback", "yes", "diloco.error_feedback must be one of auto, on, off; got 'yes'"),
    ("num_replicas", 3, "diloco.num_replicas must be 0"),
    ("block_size", 10, r"^diloco.block_size must be a positive multiple of 4; got 10$"),
    ("outer_lr", 0.0, r"^diloco.outer_lr must be > 0; got 0.0$"),
    ("outer_momentum", -0.5, r"^diloco.outer_momentum must be >= 0; got -0.5$"),
    ("bucket_mb", -1.0, r"^diloco.bucket_mb must be >= 0; got -1.0$"),
    ("ef_decay", 1.5, r"^diloco.ef_decay must be in \(0, 1\] \(1 = plain error feedback\); got 1.5$"),
    ("ef_decay", 0.9, r"^diloco.ef_decay = 0.9 decays the error-feedback residual, but error feedback is off "
                      r"\(diloco.wire = 'fp32', diloco.error_feedback = 'auto'\)"),
])
def test_trainer_config_errors(shard: str, key: str, value: object, match: str) -> None:
    from lowband.train.config import ConfigError, validate

    cfg = _tiny_trainer_config(shard, 2, **{"sync_every": 4, key: value})
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=2)


def _outer_lr_worker() -> str:
    from functools import partial

    rank = dist.get_rank()
    model = Net(torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    outer = partial(torch.optim.SGD, lr=0.7 if rank == 0 else 0.5, momentum=0.9, nesterov=True)
    try:
        StreamingDiLoCo(model, opt, comm=Comm(), sync_every=2, outer_optimizer=outer)
    except ValueError as e:
        return str(e)
    return "no error"


def test_replicas_with_another_outer_lr_are_refused() -> None:
    """Replicas stepping the same averaged pseudo-gradient with another outer lr drift apart with every sync and no
    error: the outer optimizers' class and hyperparameters are agreed at construction, on every replica alike."""
    res = run_ranks(_outer_lr_worker, 2)
    assert res[0] == res[1]
    assert res[0].startswith("diloco outer optimizer (type and hyperparameters) differs between ranks"), res[0]
    assert "'lr': 0.7" in res[0] and "'lr': 0.5" in res[0]
