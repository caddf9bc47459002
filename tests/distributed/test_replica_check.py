"""Issue 27 item 6: ranks that drift apart never go unnoticed (:mod:`lowband.consistency`).

Library: equal replicas pass with one all-gather of exact size; a 1e-12 drift of one element on one rank
is named on every rank; GTP shards differ legitimately and pass, a desynced replicated bias or shard is
named; DiLoCo-style replica ids keep replicas apart. Trainer: ``run.check_replicas_every`` is on by
default, runs for every strategy without a false alarm, and ends a drifting run with the error.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowband.consistency as consistency
from lowband.comm import Comm, CommLedger
from lowband.consistency import ReplicaDivergenceError, check_replicas, replica_check_bytes, tensor_checksum
from lowband.testing import run_ranks

# ------------------------------------------------------------------------------------- single process


def test_checksum_is_exact_and_order_sensitive() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    y = x.clone()
    y[517] += 1e-12
    assert not torch.equal(tensor_checksum(x), tensor_checksum(y))
    z = x.clone()
    z[[3, 900]] = z[[900, 3]]  # a permutation keeps the plain sum, not the weighted one
    cz, cx = tensor_checksum(z), tensor_checksum(x)
    assert cz[0] == cx[0] and cz[1] != cx[1]
    assert torch.equal(tensor_checksum(x), tensor_checksum(x.clone()))
    for t in (torch.randn(7).bfloat16(), torch.randint(0, 5, (9,), dtype=torch.int8), torch.ones(4, dtype=torch.bool),
              torch.randn(3, dtype=torch.complex128), torch.randn(4, 6).t()):  # the last one is not contiguous
        assert tensor_checksum(t).shape == (2,)


def test_checksum_sees_structured_float64_changes() -> None:
    """The plain sum of 64-bit words mod 2**64 missed these: two sign flips add 2 * 2**63, and doubling every
    element of 8192 float64 values adds 8192 * 2**52 = 2**65 (both wrap to the same sum)."""
    x = torch.randn(8192, dtype=torch.float64)
    for changed in (x * 2, x * 0.5, torch.cat([-x[:2], x[2:]]), -x):
        assert not torch.equal(tensor_checksum(changed), tensor_checksum(x))
    y = torch.randn(16, dtype=torch.float64)
    z = y.clone()
    z[[0, 2]] = -z[[0, 2]]
    assert not torch.equal(tensor_checksum(z), tensor_checksum(y))


def test_checksum_does_not_depend_on_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1001, dtype=torch.float32)
    whole = tensor_checksum(x)
    monkeypatch.setattr(consistency, "_CHUNK", 64)
    assert torch.equal(tensor_checksum(x), whole)


def test_one_rank_communicates_nothing() -> None:
    ledger = CommLedger()
    check_replicas(nn.Linear(3, 3), Comm(name="world", ledger=ledger))
    assert ledger.count() == 0 and replica_check_bytes(5, 1) == 0


# ----------------------------------------------------------------------------------------- workers


def _model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8)).to(dtype)
    m.extra = nn.Linear(8, 8, bias=False).bfloat16()  # mixed dtypes
    m.tied = m[0]  # a module under two names: its tensors are checked once
    return m


def _ntensors(m: nn.Module, buffers: bool = True) -> int:
    ids = {id(p) for p in m.parameters()} | ({id(b) for b in m.buffers()} if buffers else set())
    return len(ids)


def _catch(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ReplicaDivergenceError as e:
        return str(e)
    return None


def _equal_worker() -> dict:
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger)
    model = _model()
    check_replicas(model, comm)
    check_replicas(model, comm, buffers=False)
    return {"records": [(r.op, r.group, r.tag, r.wire_dtype, r.numel, r.wire_bytes) for r in ledger.records],
            "n": _ntensors(model), "n_params": _ntensors(model, buffers=False)}


@pytest.mark.parametrize("world", [2, 4])
def test_equal_replicas_pass_with_one_all_gather_of_exact_size(world: int) -> None:
    for out in run_ranks(_equal_worker, world, timeout=60):
        n, p = out["n"], out["n_params"]
        assert n == 10 and p == 7  # 2 linears + BN (2 params, 3 buffers) + extra; the tied alias once
        assert out["records"] == [
            ("all_gather", "world", "replica_check", "int64", world * (2 + 4 * n), replica_check_bytes(n, world)),
            ("all_gather", "world", "replica_check", "int64", world * (2 + 4 * p), replica_check_bytes(p, world))]
        assert replica_check_bytes(n, world) == (world - 1) * 8 * (2 + 4 * n)


def _desync_worker(what: str) -> dict:
    comm = Comm(name="world")
    model = _model()
    last = dist.get_world_size() - 1
    if dist.get_rank() == last:
        with torch.no_grad():
            if what == "param":
                model[2].bias[3] += 1e-12
            elif what == "buffer":
                model[1].running_var[0] += 1e-12
            elif what == "shape":
                model[2] = nn.Linear(16, 9).double()
    return {"all": _catch(check_replicas, model, comm), "params": _catch(check_replicas, model, comm, buffers=False),
            "ctx": _catch(check_replicas, model, comm, context="after step 7")}


@pytest.mark.parametrize("world", [2, 4])
def test_a_drift_of_1e_12_on_one_rank_is_named_on_every_rank(world: int) -> None:
    out = run_ranks(_desync_worker, world, "param", timeout=60)
    msgs = {o["all"] for o in out}
    assert len(msgs) == 1 and {o["params"] for o in out} == msgs  # the same one line everywhere
    (msg,) = msgs
    others = "rank 0" if world == 2 else "ranks 0, 1, 2"
    assert msg == (f"replica check: replicated parameter '2.bias' differs: rank {world - 1} of group 'world' holds "
                   f"other values than {others} (the ranks train different models from here on)")
    assert all(o["ctx"].startswith("replica check after step 7: replicated parameter '2.bias'") for o in out)


def test_buffers_are_checked_unless_excluded_and_layouts_are_compared() -> None:
    out = run_ranks(_desync_worker, 2, "buffer", timeout=60)
    assert all("replicated buffer '1.running_var' differs: rank 1" in o["all"] and o["params"] is None for o in out)
    out = run_ranks(_desync_worker, 2, "shape", timeout=60)
    assert all("parameter '2.weight': rank 1 of group 'world' holds it with another name, shape, dtype or shard "
               "layout than rank 0" in o["all"] for o in out)


def _replica_worker(drift_ranks: list[int]) -> str | None:
    comm = Comm(name="world")
    model = _model()
    if dist.get_rank() in drift_ranks:
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
    return _catch(check_replicas, model, comm, replica=dist.get_rank() // 2)


def test_replica_ids_keep_replicas_apart() -> None:
    """Two replicas of two ranks (DiLoCo between syncs): replica 1 may differ from replica 0, not within."""
    assert run_ranks(_replica_worker, 4, [2, 3], timeout=60) == [None] * 4
    out = run_ranks(_replica_worker, 4, [3], timeout=60)
    assert len(set(out)) == 1 and "parameter '0.weight' differs: rank 3 of group 'world' holds other values " \
        "than rank 2" in out[0]


def _gtp_worker(gtp: int, what: str) -> dict:
    from lowband.parallel.gtp import GTPRuntime, shard_linears
    from lowband.parallel.mesh import build_mesh

    mesh = build_mesh(gtp=gtp)
    ledger = CommLedger()
    world = Comm(name="world", ledger=ledger)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8), nn.LayerNorm(8)).double()
    shard_linears(model, GTPRuntime(mesh.gtp))
    sharded = [n for n, p in model.named_parameters() if getattr(p, "gtp", None) is not None]
    rank = dist.get_rank()
    with torch.no_grad():
        if what == "bias" and rank == 1:
            model[0].bias[5] += 1e-12
        if what == "shard" and rank == dist.get_world_size() - 1:
            model[2].weight[0, 0] += 1e-12
    return {"sharded": sharded, "world": _catch(check_replicas, model, world),
            "dp": _catch(check_replicas, model, mesh.dp), "gtp": _catch(check_replicas, model, mesh.gtp),
            "bytes": ledger.wire_bytes(tag="replica_check"), "n": _ntensors(model)}


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_shards_differ_legitimately_and_a_desynced_bias_is_named(world: int) -> None:
    out = run_ranks(_gtp_worker, world, world, "none", timeout=60)
    for o in out:
        assert o["sharded"] == ["0.weight", "2.weight"]
        assert o["world"] is None and o["dp"] is None and o["gtp"] is None
        assert o["bytes"] == replica_check_bytes(o["n"], world)
    out = run_ranks(_gtp_worker, world, world, "bias", timeout=60)
    assert len({o["world"] for o in out}) == 1
    assert "replicated parameter '0.bias' differs: rank 1 of group 'world' holds other values" in out[0]["world"]
    assert all(o["gtp"] == o["world"].replace("'world'", "'gtp'") for o in out)


def test_gtp_shard_drift_is_named_among_the_ranks_holding_that_shard() -> None:
    """4 ranks, gtp = 2 (dp = 2): ranks 1 and 3 hold shard 1; rank 3's drifts."""
    out = run_ranks(_gtp_worker, 4, 2, "shard", timeout=60)
    msg = out[0]["world"]
    assert {o["world"] for o in out} == {msg}
    assert msg == ("replica check: shard 1 of 2 of parameter '2.weight' differs: rank 3 of group 'world' holds "
                   "other values than rank 1 of the same shard (its data-parallel replicas train different models "
                   "from here on)")
    assert [o["gtp"] for o in out] == [None] * 4  # each GTP group holds one copy of each shard: nothing to compare
    assert out[1]["dp"] is not None and out[3]["dp"] is not None and out[0]["dp"] is None


def _dtensor_worker() -> list[str | None]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    m = nn.Module()
    m.sharded = nn.Parameter(distribute_tensor(torch.randn(8, 4, dtype=torch.float64), mesh, [Shard(0)]))
    m.whole = nn.Parameter(distribute_tensor(torch.randn(3, dtype=torch.float64), mesh, [Replicate()]))
    comm = Comm(name="world")
    first = _catch(check_replicas, m, comm)  # the local shards differ by design
    if dist.get_rank() == 1:
        with torch.no_grad():
            m.whole.to_local()[0] += 1e-12
    return [first, _catch(check_replicas, m, comm)]


def test_dtensor_shards_pass_and_a_replicated_dtensor_drift_is_named() -> None:
    out = run_ranks(_dtensor_worker, 2, timeout=60)
    assert all(o[0] is None for o in out) and len({o[1] for o in out}) == 1
    assert "replicated parameter 'whole' differs: rank 1 of group 'world' holds other values than rank 0" in out[0][1]


# ----------------------------------------------------------------------------------------- trainer


def test_the_trainer_checks_by_default() -> None:
    from lowband.train.config import Config

    assert Config().run.check_replicas_every == 100


def _trainer_config(shard: str, world: int, strategy: str, every: int):
    from tests.distributed.test_trainer import tiny_config

    cfg = tiny_config(shard, world, strategy, 2)
    cfg.run.check_replicas_every = every
    cfg.run.export = False
    if strategy == "gtp":
        cfg.gtp.size = 2
    if strategy == "diloco":
        cfg.diloco.num_replicas, cfg.diloco.inner, cfg.diloco.sync_every, cfg.diloco.fragments = 2, "gtp", 2, 1
    return cfg


def _drifting_factory(rank: int, call: int):
    """lowband's GPT; on ``rank``, just before forward call ``call``, ``norm.weight[0] += 1e-12``."""
    from lowband.train.models import gpt_factory

    def factory(cfg):
        model = gpt_factory(cfg)
        calls = {"n": 0}

        def pre_hook(module, args):
            calls["n"] += 1
            if calls["n"] == call and dist.get_rank() == rank:
                with torch.no_grad():
                    model.norm.weight[0] += 1e-12

        model.register_forward_pre_hook(pre_hook)
        return model

    return factory


def _trainer_worker(cfg, drift_rank: int = -1) -> dict:
    from lowband.comm import default_ledger
    from lowband.train.errors import classify
    from lowband.train.trainer import train

    ledger = default_ledger()
    count, nbytes = ledger.count(tag="replica_check"), ledger.wire_bytes(tag="replica_check")
    factory = _drifting_factory(drift_rank, 2) if drift_rank >= 0 else None
    try:
        res = train(cfg, write_run_dir=False, log=False, model_factory=factory)
    except ReplicaDivergenceError as e:
        outcome = classify(e)
        return {"error": str(e), "code": outcome.code, "kind": outcome.kind}
    return {"error": None, "checks": ledger.count(tag="replica_check") - count,
            "bytes": ledger.wire_bytes(tag="replica_check") - nbytes,
            "n": len({id(p) for p in res.strategy.unwrapped().parameters()}),
            "wire": [r["wire_bytes"] for r in res.rows if "loss" in r]}


@pytest.mark.parametrize(("strategy", "world"), [("ddp", 2), ("sharded-adamw", 2), ("gtp", 4), ("tp", 2),
                                                 ("diloco", 4)])
def test_every_strategy_passes_the_check_every_step(shard: str, strategy: str, world: int) -> None:
    """Checked after each of the 4 steps: no false alarm (GTP/TP shards, DiLoCo replicas that differ), one
    all-gather per check, ``(world - 1) x 8 x (2 + 4 x tensors)`` bytes each."""
    for o in run_ranks(_trainer_worker, world, _trainer_config(shard, world, strategy, 1), timeout=120):
        assert o["error"] is None and o["checks"] == 4
        assert o["bytes"] == 4 * replica_check_bytes(o["n"], world)


def test_the_check_is_counted_in_the_step_wire_bytes(shard: str) -> None:
    on = run_ranks(_trainer_worker, 2, _trainer_config(shard, 2, "ddp", 2), timeout=120)
    off = run_ranks(_trainer_worker, 2, _trainer_config(shard, 2, "ddp", 0), timeout=120)
    extra = replica_check_bytes(on[0]["n"], 2)
    assert off[0]["checks"] == 0 and on[0]["checks"] == 2
    assert on[0]["wire"] == [w + (extra if step % 2 == 0 else 0) for step, w in enumerate(off[0]["wire"], 1)]


@pytest.mark.parametrize("strategy", ["ddp", "gtp"])
def test_a_drifting_rank_ends_the_run_on_every_rank(shard: str, strategy: str) -> None:
    out = run_ranks(_trainer_worker, 2, _trainer_config(shard, 2, strategy, 2), 1, timeout=120)
    assert len({o["error"] for o in out}) == 1
    assert out[0]["error"] == ("replica check after step 2: replicated parameter 'norm.weight' differs: rank 1 of "
                               "group 'world' holds other values than rank 0 (the ranks train different models from "
                               "here on)")
    assert all(o["code"] == 1 and o["kind"] == "failed" for o in out)
