"""Every inner strategy inside Streaming DiLoCo replicas (``diloco.inner``), through the trainer, float64,
on 4 gloo ranks = 2 replicas x 2 inner ranks (dp 2, or gtp 2):

* the global copies, outer momentum and (logical) local weights equal DiLoCo with a replicated reference
  inner running the same optimizer math (DDP + AdamW for the AdamW inners; for Muon, the sharded
  optimizer over one rank per replica, i.e. single-device Muon, on 2 ranks with twice the batch per rank);
* the exact ledger bytes of the outer all-reduce per fragment (with GTP inside: the shards' bytes, 1/gtp
  of a sharded weight's);
* a checkpoint resumes bit for bit (train 6 == train 3 + save + load + train 3, a fragment in flight);
* invalid combinations are refused with one line naming the keys.

Tolerance 1e-10 (float64): the compared runs differ only in the order of the inner gradient averaging
(two half-batch means vs one mean, a reduce-scatter vs an all-reduce, Newton-Schulz on an owner vs on
every rank: a few float64 roundings, eps 2.2e-16, per step) and the 8-step trajectories are well
conditioned (lr 1e-2, tiny model), so the states differ by ~1e-15 relative. The pseudo-gradients travel
as fp32 (``diloco.wire`` allows no fp64): a 1e-15 relative difference flips an fp32 rounding (ulp 6e-8)
with probability ~2e-8 per element, ~2e-3 over the ~1e5 elements a run syncs; a flip would show as a
~1e-8 relative miss, not as a silent pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lowband.comm.codecs import chunk_layout, get_wire
from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.config import Config, ConfigError, validate
from lowband.train.trainer import train
from tests.distributed.test_checkpoint_diloco import _run as _ckpt_run
from tests.distributed.test_checkpoint_diloco import assert_same_state, diloco_config

TOL = 1e-10
TIMEOUT = 600  # a hang guard, not a speed limit (three tests here failed at a load average of 60-90 with 180 s)


def _config(shard: str, world: int, inner: str, *, steps: int = 8, gtp: int = 0, optimizer: str = "adamw") -> Config:
    """2 replicas; global batch 8 sequences (2 per rank on 4 ranks, 4 per rank on 2)."""
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 2, 32, 2, 16
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, 8 // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.muon_lr = 1e-2, 2, 1e-2
    cfg.optim.muon_ns_dtype = "float64"  # Newton-Schulz in the model's dtype: float64 parity
    cfg.strategy.name = "diloco"
    d = cfg.diloco
    d.num_replicas, d.sync_every, d.fragments, d.delay, d.wire, d.inner = 2, 4, 2, 1, "fp32", inner
    cfg.gtp.size, cfg.gtp.optimizer = gtp, optimizer
    return cfg


def _worker(cfg: Config) -> dict:
    res = train(cfg, write_run_dir=False, log=False)
    st = res.strategy
    d = st.diloco
    with d.paused():
        state = d.state_dict()  # global copies / outer momentum in logical (whole) shapes
        if cfg.diloco.inner == "gtp":
            model = dict(st.inner.logical_state_dict()["model"])  # GTP shards gathered to whole weights
        else:
            model = {n: p.detach().clone() for n, p in st.unwrapped().named_parameters()}
    shards = d.state_layout.weights if d.state_layout is not None else {}
    frags = []
    for f in d.frags:
        frags.append([(n, list(model[n].shape), n in shards, p.numel()) for n, p in zip(f.names, f.params)])
    recs = [(r.op, r.tag, r.group, r.numel, r.wire_bytes) for r in st.env.ledger.records
            if r.tag.startswith("diloco:frag")]
    whole = {n: p.detach().clone() for n, p in st.unwrapped().named_parameters() if n not in shards}
    out = {"committed": d.committed, "model": model, "frags": frags, "records": recs, "whole": whole,
           "globals": {k: v for k, v in state.items() if k.startswith(("global.", "outer."))},
           "inner_ops": sorted({(r.op, r.group) for r in st.env.ledger.records if r.group in ("dp", "gtp")})}
    d.close()
    return out


def _assert_close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=TOL, atol=TOL, msg=f"{what}: {k}")


def _reference(shard: str, reference: str) -> tuple[list[dict], int]:
    """The reference run and its ranks per replica: ``ddp`` = DDP + AdamW (2 x dp 2); ``muon`` = the sharded
    optimizer over one rank per replica (single-device Muon; 2 ranks, twice the batch per rank)."""
    if reference == "ddp":
        return run_ranks(_worker, 4, _config(shard, 4, "ddp"), timeout=TIMEOUT), 2
    return run_ranks(_worker, 2, _config(shard, 2, "sharded-muon"), timeout=TIMEOUT), 1


INNERS = [("sharded-adamw", 0, "adamw", "ddp"), ("sharded-muon", 0, "adamw", "muon"), ("gtp", 2, "adamw", "ddp"),
          ("gtp", 2, "muon", "muon"), ("gtp", 1, "adamw", "ddp")]  # the last: gtp 1 x dp 2 inside a replica


@pytest.mark.parametrize(("name", "gtp", "opt", "reference"), INNERS,
                         ids=["sharded-adamw", "sharded-muon", "gtp2-adamw", "gtp2-muon", "gtp1-dp2-adamw"])
def test_inner_equals_replicated_reference(shard: str, name: str, gtp: int, opt: str, reference: str) -> None:
    inner = f"{name} gtp={gtp} {opt}"
    out = run_ranks(_worker, 4, _config(shard, 4, name, gtp=gtp, optimizer=opt), timeout=TIMEOUT)
    ref, ref_per = _reference(shard, reference)
    for rank, res in enumerate(out):
        want = ref[(rank // 2) * ref_per]  # a rank of the same replica in the reference run
        assert res["committed"] == want["committed"] == 4  # 8 steps, K = 2: fragments 0, 1, 0, 1
        _assert_close(res["globals"], want["globals"], f"{inner} rank {rank} global copies / outer momentum")
        _assert_close(res["model"], want["model"], f"{inner} rank {rank} local weights")
        # the same fragments (GTP inside lists a fragment's replicated parameters before its shards)
        assert [sorted(e[:2] for e in f) for f in res["frags"]] == [sorted(e[:2] for e in f) for f in want["frags"]]
    # the inner traffic went the inner strategy's way, inside the replica
    ops = out[0]["inner_ops"]
    if name.startswith("sharded"):
        assert ("reduce_scatter", "dp") in ops and ("all_gather", "dp") in ops
    elif gtp == 2:
        assert ("reduce_scatter", "gtp") in ops and ("all_gather", "gtp") in ops
        assert not any(g == "dp" for _, g in ops)  # dp = 1 inside a replica of 2 GTP ranks
    else:  # GTP over 1 rank: its gradients averaged over the replica's dp axis
        assert ("all_reduce", "dp") in ops


@pytest.mark.parametrize(("inner", "wire"), [("sharded-muon", "fp32"), ("gtp", "fp32"), ("gtp", "topk-int2")])
def test_outer_all_reduce_bytes_per_fragment(shard: str, inner: str, wire: str) -> None:
    """2 replicas, per sync and bucket: fp32 = one all-to-all and one all-gather of the encoded chunks,
    ``2 (R-1) * encoded(chunk)`` bytes per rank; topk-int2 = one all-gather of each replica's message. With
    GTP inside a fragment is the rank's shards (exactly 1/2 of every sharded weight here: even row counts,
    no padding) plus the whole replicated parameters, in two buckets (replicated first), so a block / top-k
    codec never mixes them and the replicated parameters stay bitwise equal on the replica's GTP ranks."""
    cfg = _config(shard, 4, inner, gtp=2 if inner == "gtp" else 0)
    cfg.diloco.wire = wire
    out = run_ranks(_worker, 4, cfg, timeout=TIMEOUT)
    d = cfg.diloco
    codec, replicas = get_wire(wire, d.block_size, d.topk_chunk, d.topk_k), 2
    two_phase = wire == "fp32"
    if inner == "gtp":  # the replicated parameters agree inside each replica, bitwise
        for a, b in ((out[0], out[1]), (out[2], out[3])):
            assert a["whole"].keys() == b["whole"].keys() and a["whole"]
            assert all(torch.equal(a["whole"][k], b["whole"][k]) for k in a["whole"])
    for res in out:
        numels = [sum(e[3] for e in f) for f in res["frags"]]
        logical = [sum(math.prod(e[1]) for e in f) for f in res["frags"]]
        sharded = [sum(math.prod(e[1]) for e in f if e[2]) for f in res["frags"]]
        buckets = [[b for b in (sum(e[3] for e in f if not e[2]), sum(e[3] for e in f if e[2])) if b]
                   for f in res["frags"]]
        if inner == "gtp":
            assert all(s > 0 for s in sharded) and all(len(b) == 2 for b in buckets)
            assert numels == [lg - s // 2 for lg, s in zip(logical, sharded)]
            assert all(not any(e[2] for e in f[:len(f) - sum(e[2] for e in f)]) for f in res["frags"])  # whole first
        else:
            assert numels == logical and not any(sharded) and all(len(b) == 1 for b in buckets)
        recs, at = res["records"], 0
        for i in range(4):  # fragments 0, 1, 0, 1; each sync's records before the next prepare
            f = i % 2
            n_ops = len(buckets[f]) * (2 if two_phase else 1)
            group = recs[at:at + n_ops]
            at += n_ops
            assert {(r[1], r[2]) for r in group} == {(f"diloco:frag{f}", "replica")}
            if two_phase:
                assert sorted(r[0] for r in group) == sorted(
                    ["all_to_all", "all_gather"] * len(buckets[f]))
                want = sum(2 * (replicas - 1) * codec.encoded_nbytes(chunk_layout(b, replicas, codec))
                           for b in buckets[f])
            else:
                assert [r[0] for r in group] == ["all_gather"] * len(buckets[f])
                want = sum(codec.message_nbytes(b) for b in buckets[f])
            assert sum(r[4] for r in group) == want
        assert at == len(recs)


# ------------------------------------------------------------------------------------------ checkpoints
def _ckpt_config(shard: str, inner: str, *, gtp: int = 0, optimizer: str = "adamw", **kw) -> Config:
    cfg = diloco_config(shard, 4, replicas=2, **kw)
    cfg.diloco.inner, cfg.gtp.size = inner, gtp
    cfg.optim.muon_ns_dtype = "float64"
    cfg.gtp.optimizer = optimizer
    return cfg


CKPT_INNERS = [("sharded-adamw", 0, "adamw"), ("sharded-muon", 0, "adamw"), ("gtp", 2, "adamw"), ("gtp", 2, "muon")]


@pytest.mark.parametrize(("inner", "gtp", "optimizer"), CKPT_INNERS)
def test_resume_is_bitwise_exact(shard: str, tmp_path: Path, inner: str, gtp: int, optimizer: str) -> None:
    """2 replicas x 2 inner ranks; checkpoint after step 3 (a fragment in flight), resume, 3 more steps:
    losses and the whole checkpoint state bit for bit equal to the uninterrupted 6 steps."""
    kw = dict(gtp=gtp, optimizer=optimizer)
    full = run_ranks(_ckpt_run, 4, _ckpt_config(shard, inner, **kw), timeout=TIMEOUT)
    cfg = _ckpt_config(shard, inner, ckpt_dir=str(tmp_path), every=3, **kw)
    first = run_ranks(_ckpt_run, 4, cfg, stop_after=3, timeout=TIMEOUT)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]
    assert first[0]["state"]["diloco.inflight"] is not None
    second = run_ranks(_ckpt_run, 4, cfg, timeout=TIMEOUT)
    for r in range(4):
        assert first[r]["start"] == 0 and second[r]["start"] == 3
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same_state(second[r]["state"], full[r]["state"])
    st = full[0]["state"]
    assert st["diloco.counters"] == {"committed": 3, "local_step": 0}
    # logical shapes in the checkpoint: (replicas, *whole weight) rows, whole global copies
    assert st["model.blocks.0.mlp.fc.weight"].shape[0] == 2
    assert st["diloco.global.blocks.0.mlp.fc.weight"].shape == st["model.blocks.0.mlp.fc.weight"].shape[1:]


def test_gtp_inner_checkpoint_loads_at_another_gtp_size(shard: str, tmp_path: Path) -> None:
    """2 replicas x gtp 2 (4 ranks) -> 2 replicas x gtp 1 (2 ranks), a fragment in flight: the state is
    logical (whole weights, whole global copies), so it loads bit for bit into the other GTP size."""
    saved = run_ranks(_ckpt_run, 4, _ckpt_config(shard, "gtp", gtp=2, ckpt_dir=str(tmp_path), every=3),
                      stop_after=3, timeout=TIMEOUT)
    cfg = diloco_config(shard, 2, replicas=2, ckpt_dir=str(tmp_path), every=3)
    cfg.diloco.inner = "gtp"
    loaded = run_ranks(_ckpt_run, 2, cfg, stop_after=3, timeout=TIMEOUT)
    assert saved[0]["state"]["diloco.inflight"] is not None
    for r in range(2):
        assert loaded[r]["start"] == 3
        assert_same_state(loaded[r]["state"], saved[0]["state"])


def test_format_names_the_inner_strategy(shard: str, tmp_path: Path) -> None:
    """A sharded-muon checkpoint does not load into a gtp inner: refused naming both formats."""
    from tests.distributed.trainer_util import resume_error

    run_ranks(_ckpt_run, 4, _ckpt_config(shard, "sharded-muon", steps=2, ckpt_dir=str(tmp_path), every=2),
              timeout=TIMEOUT)
    out = run_ranks(resume_error, 4, _ckpt_config(shard, "gtp", gtp=2, steps=4, ckpt_dir=str(tmp_path), every=2),
                    timeout=TIMEOUT)
    assert out[0] == out[3]
    assert "'diloco-r2-sharded-muon-v1'" in out[0] and "'diloco-r2-gtp-adamw-v1'" in out[0]


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("changes", "match"), [
    ({"diloco.inner": "tp"}, "diloco.inner must be one of ddp, sharded-adamw, sharded-muon, gtp; got 'tp'"),
    ({"diloco.inner": "gtp", "gtp.size": 3},
     r"gtp.size must be 0 \(the whole replica\) or a divisor of run.world_size / diloco.num_replicas = 2 ranks "
     r"per replica \(diloco.inner = gtp\); got 3"),
    ({"diloco.inner": "gtp", "gtp.size": 4}, "gtp.size must be 0 .* = 2 ranks per replica .*; got 4"),
    ({"diloco.inner": "ddp", "sparse.tables": ["bigram"], "model.bigram_rows": 64},
     r"sparse.tables = \['bigram'\] needs diloco.inner = sharded-adamw or sharded-muon .*; got diloco.inner = ddp"),
    ({"diloco.inner": "gtp", "sparse.tables": ["bigram"], "model.bigram_rows": 64},
     r"sparse.tables = \['bigram'\] needs diloco.inner = sharded-adamw or sharded-muon .*; got diloco.inner = gtp"),
    ({"diloco.inner": "sharded-muon", "sharded.param_wire_dtype": "bfloat16"},
     "sharded.param_wire_dtype = bfloat16 is not supported with diloco.inner = sharded-muon"),
    ({"diloco.inner": "sharded-adamw", "run.dtype": "bfloat16"},
     "run.dtype = bfloat16 is not supported with diloco.inner = sharded-adamw"),
    ({"diloco.inner": "sharded-muon", "sparse.tables": ["bigram"]}, r"sparse.tables = \['bigram'\] needs "
                                                                   "model.bigram_rows >= 2"),
])
def test_invalid_inner_combinations_are_refused(shard: str, changes: dict, match: str) -> None:
    cfg = _config(shard, 4, "ddp")
    for key, value in changes.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=4)


# ------------------------------------------------------------------------------------------ composition
ROOT = Path(__file__).resolve().parents[2]


def _compose_config(shard: str, ckpt_dir: str, **overrides: object) -> Config:
    from lowband.train.config import load_config

    args = {"run.steps": 8, "run.dtype": "float64", "run.val_every": 0, "run.val_batches": 1, "run.log_every": 1,
            "run.threads": 1, "model.n_layer": 1, "model.n_embd": 16, "model.n_head": 2, "model.seq_len": 8,
            "data.source": "bin", "data.train_bin": shard, "data.batch_size": 1, "checkpoint.dir": ckpt_dir,
            "checkpoint.every": 3, **overrides}
    return load_config(ROOT / "configs" / "compose.toml", [f"--{k}={v}" for k, v in args.items()])


def test_compose_config_trains_and_resumes(shard: str, tmp_path: Path) -> None:
    """configs/compose.toml (DiLoCo 2 replicas, topk-int2 + error feedback; GTP 2 with Muon inside) through
    the trainer on 4 ranks: finite losses, 2 outer syncs in 8 steps, and a checkpoint taken after step 3
    (a fragment in flight, error-feedback residuals per replica, GTP-sharded state) resumes bit for bit."""
    cfg = _compose_config(shard, str(tmp_path / "full"), **{"checkpoint.every": 0})
    assert (cfg.diloco.inner, cfg.gtp.optimizer, cfg.diloco.wire) == ("gtp", "muon", "topk-int2")
    full = run_ranks(_ckpt_run, 4, cfg, timeout=TIMEOUT)
    cfg = _compose_config(shard, str(tmp_path / "ckpt"))
    first = run_ranks(_ckpt_run, 4, cfg, stop_after=3, timeout=TIMEOUT)
    assert first[0]["state"]["diloco.inflight"] is not None
    second = run_ranks(_ckpt_run, 4, cfg, timeout=TIMEOUT)
    for r in range(4):
        losses = full[r]["losses"]
        assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
        assert second[r]["start"] == 3
        assert {**first[r]["losses"], **second[r]["losses"]} == losses  # exact
        assert_same_state(second[r]["state"], full[r]["state"])
    st = full[0]["state"]
    assert st["diloco.counters"] == {"committed": 2, "local_step": 0}
    res = st["diloco.residual.blocks.0.mlp.fc.weight"]  # per replica, whole weight shape
    assert res.shape == (2, 64, 16) and not torch.equal(res[0], res[1])


def _sparse_worker(cfg: Config) -> dict:
    res = train(cfg, write_run_dir=False, log=False)
    d = res.strategy.diloco
    out = {"params": {n: p.detach().clone() for n, p in res.strategy.unwrapped().named_parameters()},
           "globals": [[g.clone() for g in gs] for gs in d.globals], "committed": d.committed,
           "extras": [r["extras"] for r in res.rows if "loss" in r],
           "inner_bytes": sum(r.wire_bytes for r in res.strategy.env.ledger.records if r.group == "dp")}
    d.close()
    return out


def test_sparse_bigram_table_inside_sharded_muon_replicas(shard: str) -> None:
    """diloco.inner = sharded-muon with ``sparse.tables = ["bigram"]`` (2 replicas x 2 dp ranks): the
    table's touched rows travel inside the replica and the run equals the same run without a sparse table
    (1e-10: the sparse exchange sums the same rows the dense reduce-scatter sums, in another order), with
    fewer inner bytes; DiLoCo syncs the table like any parameter."""
    def cfg(sparse: bool) -> Config:
        c = _config(shard, 4, "sharded-muon")
        c.model.bigram_rows = 2000  # a big, sparsely touched table: 2 x 16 tokens per rank and step
        if sparse:
            c.sparse.tables, c.sparse.mode = ["bigram"], "sparse"
        return c

    dense = run_ranks(_sparse_worker, 4, cfg(False), timeout=TIMEOUT)
    sparse = run_ranks(_sparse_worker, 4, cfg(True), timeout=TIMEOUT)
    for d, s in zip(dense, sparse, strict=True):
        assert s["committed"] == d["committed"] == 4
        assert "bigram.weight" in s["params"]
        _assert_close(s["params"], d["params"], "local weights")
        for gs, gd in zip(s["globals"], d["globals"], strict=True):
            for a, b in zip(gs, gd, strict=True):
                torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
        assert all(e["bigram_mode"] == "sparse" and e["bigram_density"] < 0.1 for e in s["extras"])
        assert s["inner_bytes"] < d["inner_bytes"]
