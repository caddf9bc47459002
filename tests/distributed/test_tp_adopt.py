"""``shard_tp`` keeps the user's ``Parameter`` objects (parameter identity), so an optimizer built before
sharding (nanoGPT's order) trains every TP slice exactly as one built after: against single-process torch
AdamW on the dense model, 2 gloo ranks (TP 2), float64.

Tolerance: the TP run sums the same float64 products in other groupings (the row-parallel all-reduce, the
column-parallel ``dX`` all-reduce), relative O(k eps64) per step with k the reduction length (<= 24 here);
AdamW's normalized update keeps that relative, so 1e3 eps64 bounds three steps with a wide margin.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm
from lowband.parallel import shard_tp, unsharded_copy
from lowband.plan import ModelPlan, ParallelLinear
from lowband.testing import run_ranks

EPS = torch.finfo(torch.float64).eps
TOL = dict(rtol=1e3 * EPS, atol=1e3 * EPS)
# a fused column-parallel linear of 3 sections (rows permuted in place), a row-parallel one with a bias
PLAN = ModelPlan(parallel_linears=(ParallelLinear("qkv", "column", sections=3), ParallelLinear("proj", "row")))


class Gated(nn.Module):
    """``proj(q * sigmoid(k) + v)`` with ``[q; k; v] = qkv(x)``: each TP rank gates its own part of every
    section (as attention heads), so the row-parallel ``proj`` gets its slice of the gated features."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, dtype=torch.float64)
        self.proj = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(q * torch.sigmoid(k) + v)


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same dense model on every rank
    return Gated()


def _optimizer_before_shard(when: str) -> dict:
    model = _model()
    model.proj.bias.requires_grad_(False)  # a frozen bias stays frozen, the same object
    ref = copy.deepcopy(model)
    ids = [id(p) for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if when == "before" else None
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    shard_tp(model, PLAN, Comm(name="tp"))
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    same_objects = [id(p) for p in model.parameters()] == ids
    held = {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # TP peers share the batch
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        y = torch.randn(4, 8, generator=g, dtype=torch.float64)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    plain = unsharded_copy(model)
    return {"same_objects": same_objects, "held": held, "frozen": not model.proj.bias.requires_grad,
            "local": tuple(model.qkv.weight.shape), "got": {n: p.detach() for n, p in plain.named_parameters()},
            "want": {n: p.detach() for n, p in ref.named_parameters()}}


def test_optimizer_built_before_shard_tp_trains_every_slice() -> None:
    for when in ("before", "after"):
        for r in run_ranks(_optimizer_before_shard, 2, when):
            assert r["got"].keys() == r["want"].keys()
            for n in r["want"]:
                torch.testing.assert_close(r["got"][n], r["want"][n], **TOL, msg=f"{when}: {n}")
            assert r["same_objects"] and r["held"] and r["frozen"] and r["local"] == (12, 8)


def _stepped_before_shard() -> dict:
    from lowband.parallel.tp_grads import TPOptimizerStateError

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, dtype=torch.float64)
    model(x).square().mean().backward()
    opt.step()  # state of the dense shapes
    opt.zero_grad()
    shard_tp(model, PLAN, Comm(name="tp"))
    before = [p.detach().clone() for p in model.parameters()]
    model(x).square().mean().backward()
    try:
        opt.step()
        msg = ""
    except TPOptimizerStateError as e:
        msg = str(e)
    untouched = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.state.clear()  # the documented way out: a fresh state for the slices
    opt.step()
    stepped = not torch.equal(before[0], model.qkv.weight)
    return {"msg": msg, "untouched": untouched, "stepped": stepped, "rank": dist.get_rank()}


def test_optimizer_state_of_the_dense_shape_is_refused_on_every_rank() -> None:
    out = run_ranks(_stepped_before_shard, 2)
    for r in out:
        assert "AdamW holds state" in r["msg"] and "dense shape (24, 8)" in r["msg"], r["msg"]
        assert "'qkv.weight'" in r["msg"] and "optimizer.state.clear()" in r["msg"]
        assert r["untouched"] and r["stepped"]
    assert out[0]["msg"] == out[1]["msg"]
