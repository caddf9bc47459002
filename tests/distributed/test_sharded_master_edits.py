"""Writes to the parameters between steps reach the fp32 master (2 and 4 gloo ranks).

Where parameters travel (``param_wire_dtype="bf16"``) or are stored (bf16 models) narrower than fp32, the
sharded optimizer updates an fp32 master of its owned slice and copies it into the parameters. Code outside
the optimizer that writes the parameters in place (``model.load_state_dict`` rolling back after a loss spike,
``p.mul_`` under ``no_grad``) must be where the next step starts from, as with torch's optimizers; the master
once overwrote such writes at the next step. A step with ``lr = 0`` changes no parameter (AdamW and Muon
subtract ``lr * (...)`` and decay by ``1 - lr * wd``), so after it the parameters must equal, bit for bit,
what was written.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm
from lowband.optim import ShardedAdamW, ShardedMuon
from lowband.testing import run_ranks

TIMEOUT = 90


def _edits(algo: str, mode: str) -> dict:
    torch.set_default_dtype(torch.float32)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    if mode == "bf16-params":
        model = model.to(torch.bfloat16)
    kw = {"param_wire_dtype": torch.bfloat16} if mode == "bf16-wire" else {}
    if algo == "adamw":
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, comm=Comm(), bucket_mb=1e-4, **kw)
    else:
        mats = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        opt = ShardedMuon(mats, rest, lr=0.02, weight_decay=0.1, adamw_lr=1e-2, comm=Comm(), **kw)
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(1)

    def step(lr_scale: float) -> None:
        x, y = torch.randn(4 * n, 6, generator=gen), torch.randn(4 * n, 3, generator=gen)
        sl = slice(4 * rank, 4 * rank + 4)
        F.mse_loss(model(x[sl].to(dtype)), y[sl].to(dtype)).backward()
        for g, base in zip(opt.param_groups, bases, strict=True):
            g["lr"] = base * lr_scale
        opt.step()
        opt.zero_grad()

    bases = [g["lr"] for g in opt.param_groups]
    step(1.0)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for _ in range(3):
        step(1.0)
    model.load_state_dict(saved)  # roll back: an in-place copy into every parameter
    step(0.0)
    rollback = [torch.equal(p.detach(), saved[k]) for k, p in model.named_parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    want = {k: p.detach().clone() for k, p in model.named_parameters()}
    step(0.0)
    scaled = [torch.equal(p.detach(), want[k]) for k, p in model.named_parameters()]
    step(1.0)  # and training goes on from there on every rank alike
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    return {"rollback": rollback, "scaled": scaled, "ranks_equal": all(torch.equal(e, flat) for e in everyone),
            "moved": not torch.equal(flat, torch.cat([w.float().reshape(-1) for w in want.values()]))}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("algo", "mode"), [("adamw", "bf16-wire"), ("adamw", "bf16-params"),
                                            ("muon", "bf16-params")])
def test_writes_to_parameters_reach_the_master(world: int, algo: str, mode: str) -> None:
    for r in run_ranks(_edits, world, algo, mode, timeout=TIMEOUT):
        assert all(r["rollback"]), r
        assert all(r["scaled"]), r
        assert r["ranks_equal"] and r["moved"], r
