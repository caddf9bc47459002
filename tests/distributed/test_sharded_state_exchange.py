"""ShardedOptimizer.state_dict() / load_state_dict() move each state element once (all_to_all), never gather.

Reference: the gathered form (``logical_state_dict()``, one all-gather per unit) cut by ``torch.chunk`` rows
is what ``state_dict()`` must hold on each rank, bitwise (the exchange only moves bytes). A fresh optimizer
that loads it must hold bitwise the original's state, and step on bitwise alike. The ledger shows what moved:
only ``all_to_all`` with ``tag="state"``, and this rank sends at most the state it owns.
Models: a small MLP with a frozen layer and a never-used one (their members have no first step), AdamW with
fp64 state, Muon + AdamW, and bf16 parameters with fp32 masters; 2 and 4 ranks (units cut through members).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.optim import ShardedAdamW, ShardedMuon
from lowband.testing import run_ranks


class _Scale(nn.Module):
    """A learnable 0-d ``logit_scale`` (CLIP's): its state has no rows to shard."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.logit_scale


def _model(dtype: torch.dtype, scalar: bool = False) -> nn.Module:
    torch.manual_seed(3)
    layers = [nn.Linear(7, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 5), nn.Linear(5, 3)]
    if scalar:  # 0-d parameters first, in the middle of a unit and last
        layers = [_Scale(), *layers[:3], _Scale(), *layers[3:], _Scale()]
    m = nn.Sequential(*layers).to(dtype)
    m[3 if scalar else 2].bias.requires_grad_(False)  # frozen
    return m  # the Linear(5, 3) is never used by forward


def _forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(m[0], _Scale):
        return m[6](m[5](m[4](m[3](m[2](m[1](m[0](x))))))) * m[8].logit_scale
    return m[4](m[3](m[2](m[1](m[0](x)))))


def _optimizer(kind: str, model: nn.Module, comm: Comm):
    if kind in ("adamw", "scalar"):
        return ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm, bucket_mb=200 / 2**20)
    if kind == "muon":
        mats = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "0.weight"]
        rest = [p for n, p in model.named_parameters() if p.dim() != 2 or n == "0.weight"]
        return ShardedMuon(mats, rest, lr=0.02, ns_dtype=torch.float64, comm=comm, bucket_mb=200 / 2**20)
    return ShardedAdamW(model.parameters(), lr=1e-2, comm=comm, bucket_mb=200 / 2**20)  # bf16 + fp32 masters


def _run(kind: str) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if kind == "bf16" else torch.float64
    ledger = CommLedger()
    model = _model(dtype, kind == "scalar")
    opt = _optimizer(kind, model, Comm(ledger=ledger))
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        _forward(model, torch.randn(4, 7, generator=g).to(dtype)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    logical = opt.logical_state_dict()["state"]
    owned = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    n0 = len(ledger.records)
    sd = opt.state_dict()
    saved = [(r.op, r.tag, r.wire_bytes) for r in ledger.records[n0:]]
    mismatch = []
    for i, st in logical.items():
        for k, v in st.items():
            got = sd["state"][i][k]
            if k != "step" and v.dim():  # torch.chunk's rows of this rank (none past the last chunk); 0-d: whole
                c = -(-v.shape[0] // n)
                lo = min(v.shape[0], rank * c)
                v = v[lo:min(v.shape[0], lo + c)]
            want = v
            local = got if k == "step" or not v.dim() else got.to_local()
            if local.dtype != want.dtype or not torch.equal(local, want):
                mismatch.append((i, k))
    # a fresh optimizer loads it: bitwise the same state, and the same next step
    model2 = _model(dtype, kind == "scalar")
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    opt2 = _optimizer(kind, model2, Comm(ledger=ledger))
    n1 = len(ledger.records)
    opt2.load_state_dict(sd)
    loaded = [(r.op, r.tag) for r in ledger.records[n1:]]
    full1, full2 = opt.full_state_dict()["state"], opt2.full_state_dict()["state"]
    x = torch.randn(4, 7, generator=g).to(dtype)
    for m, o in ((model, opt), (model2, opt2)):
        _forward(m, x).square().sum().backward()
        o.step()
    same_step = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True))
    # a unit that never stepped has no state in the original, zeros (what its first step creates) once loaded,
    # as a load of the gathered form always did
    diff = sorted(set(full1) - set(full2)) + [(i, k) for i, st in full1.items() if i in full2 for k, v in st.items()
                                              if k not in full2[i] or not torch.equal(v, full2[i][k])]
    diff += [(i, k) for i in set(full2) - set(full1) for k, v in full2[i].items() if k != "step" and v.any()]
    return {"diff": diff, "mismatch": mismatch, "saved": saved, "loaded": loaded, "owned": owned,
            "same_step": same_step, "units": len(opt.units),
            "keys": sorted((i, k) for i, st in sd["state"].items() for k in st)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["adamw", "muon", "bf16", "scalar"])
def test_state_dict_is_exchanged_not_gathered(world: int, kind: str) -> None:
    """``scalar``: AdamW with three 0-d parameters, whose state is a plain 0-d tensor on every rank (it used to
    send the whole model's state through the gathered path, every rank holding all of it)."""
    res = run_ranks(_run, world, kind)
    for r in res:
        assert r["mismatch"] == []
        assert r["diff"] == []
        assert r["same_step"]
        assert r["keys"] == res[0]["keys"]
        # every trainable parameter has an entry, the frozen one none
        assert len({i for i, _k in r["keys"]}) == (10 if kind == "scalar" else 7)
        for op, tag, wire in r["saved"]:
            assert (op, tag) == ("all_to_all", "state"), r["saved"]
            assert wire <= r["owned"]  # each owned element is sent at most once
        assert len(r["saved"]) == r["units"]  # one per unit: a unit's buffers at a time
        assert {op for op, _tag in r["loaded"]} <= {"all_to_all", "all_gather_object"}, r["loaded"]
