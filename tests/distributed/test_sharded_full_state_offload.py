"""``ShardedOptimizer.full_state_dict(cpu_offload=..., rank0_only=...)``: the gathered torch-format state
in host memory, kept on the optimizer group's rank 0 only (torch's ``get_optimizer_state_dict`` with
``StateDictOptions(full_state_dict=True, cpu_offload=True)``), and ``load_full_state_dict(sd, from_rank0=True)``
where only rank 0 holds it (torch's ``broadcast_from_rank0``).

Reference: the plain ``full_state_dict()`` of the same optimizer (checked against torch AdamW / Muon by
the other sharded-optimizer tests). Every form must hold the same bits, issue the same collectives with
the same bytes, own its tensors (writing into the result leaves the optimizer alone), and load back with
``load_full_state_dict`` into a run that continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import default_ledger
from lowband.optim import ShardedAdamW, ShardedMuon, split_params_for_muon
from lowband.testing import run_ranks
from tests.distributed.test_sharded_adamw import BATCH, TinyModel, batch, loss_fn


def _build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = TinyModel()
    if kind == "muon":
        muon, adam = split_params_for_muon(model)
        return model, ShardedMuon(muon, adam, lr=0.03, momentum=0.9, adamw_lr=1e-2)
    # bf16 parameter gathers: the units keep fp32 masters, which are state too
    return model, ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, param_wire_dtype=torch.bfloat16)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = BATCH // n
    for step in steps:
        idx, tgt = batch(step)
        loss_fn(model, idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()


def _flat(sd: dict) -> dict:
    return {(i, k): v for i, st in sd.get("state", {}).items() for k, v in st.items()}


def _forms(kind: str) -> dict:
    model, opt = _build(kind)
    led = default_ledger()
    _steps(model, opt, range(2))
    calls = {}
    for name, kw in {"plain": {}, "offload": {"cpu_offload": True},
                     "rank0": {"cpu_offload": True, "rank0_only": True}}.items():
        start = len(led.records)
        sd = opt.full_state_dict(**kw)
        calls[name] = (sd, [(r.op, r.tag, r.numel, r.wire_bytes) for r in led.records[start:]])
    plain, offload, rank0 = (calls[k][0] for k in ("plain", "offload", "rank0"))
    out = {"records_equal": calls["plain"][1] == calls["offload"][1] == calls["rank0"][1] and bool(calls["plain"][1]),
           "rank0_empty": rank0 == {}, "n_entries": len(_flat(plain))}
    if dist.get_rank() == 0:
        out["equal"] = all(_flat(plain)[k].equal(v) and _flat(plain)[k].dtype == v.dtype
                           for f in (offload, rank0) for k, v in _flat(f).items()) \
            and _flat(plain).keys() == _flat(offload).keys() == _flat(rank0).keys() \
            and plain["param_groups"] == rank0["param_groups"]
        out["on_cpu"] = all(v.device.type == "cpu" for v in _flat(rank0).values())
    before = opt.full_state_dict()
    scratch = opt.full_state_dict(cpu_offload=True, rank0_only=True)
    for v in _flat(scratch).values():
        v.add_(1.0)  # the result owns its tensors
    after = opt.full_state_dict()
    if dist.get_rank() == 0:
        out["untouched"] = all(after["state"][i][k].equal(v) for (i, k), v in _flat(before).items())
    saved = calls["offload"][0]  # every rank holds it: resume from it and continue
    weights_after_two = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _steps(model, opt, range(2, 4))
    straight = [p.detach().clone() for p in model.parameters()]
    model2, opt2 = _build(kind)
    model2.load_state_dict(weights_after_two)
    opt2.load_full_state_dict(saved)
    _steps(model2, opt2, range(2, 4))
    out["resume_exact"] = all(a.equal(b) for a, b in zip(straight, model2.parameters(), strict=True))
    # rank 0's file only: every other rank passes None and receives its slices
    model3, opt3 = _build(kind)
    model3.load_state_dict(weights_after_two)
    start = len(led.records)
    opt3.load_full_state_dict(rank0 if dist.get_rank() == 0 else None, from_rank0=True)
    recs = led.records[start:]
    out["broadcast_numel"] = sum(r.numel for r in recs if r.op == "broadcast")
    out["entry_numel"] = sum(v.numel() for (_, k), v in _flat(plain).items() if k != "step")
    out["ops"] = sorted({(r.op, r.tag) for r in recs})
    _steps(model3, opt3, range(2, 4))
    out["from_rank0_exact"] = all(a.equal(b) for a, b in zip(straight, model3.parameters(), strict=True))
    return out


def _refused(kind: str) -> str:
    model, opt = _build(kind)
    _steps(model, opt, range(1))
    sd = opt.full_state_dict(rank0_only=True)
    if dist.get_rank() == 0:
        sd["param_groups"] = sd["param_groups"][:1] + sd["param_groups"]  # one group too many
    try:
        opt.load_full_state_dict(sd or None, from_rank0=True)
    except ValueError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize(("kind", "world"), [("adamw", 2), ("adamw", 4), ("muon", 2)])
def test_offloaded_and_rank0_only_full_state(kind: str, world: int) -> None:
    res = run_ranks(_forms, world, kind)
    for r, o in enumerate(res):
        assert o["records_equal"] and o["n_entries"] > 0
        assert o["rank0_empty"] == (r != 0)
        assert o["resume_exact"]
    assert res[0]["equal"] and res[0]["on_cpu"] and res[0]["untouched"]
    for o in res:  # the structure once, then every state tensor from rank 0: exactly the entries' elements
        assert o["from_rank0_exact"]
        assert o["ops"] == [("all_gather_object", "state"), ("broadcast", "state")]
        assert o["broadcast_numel"] == res[0]["entry_numel"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_a_state_dict_rank0_cannot_load_is_refused_on_every_rank(world: int) -> None:
    msgs = run_ranks(_refused, world, "adamw")
    assert len(set(msgs)) == 1 and "rank 0 could not load" in msgs[0] and "param_groups" in msgs[0]
