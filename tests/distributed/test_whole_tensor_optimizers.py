"""Optimizers that update a parameter from statistics of the whole tensor (an orthogonalization, factored second
moments, Kronecker factors, line-search dot products) on one rank's part of a sharded weight. torch's ``Muon`` on GTP
row shards orthogonalized each shard (0.05 off the single-device run after 3 steps on 2 ranks) and ``Adafactor``
took its column statistics and step size from the shard (0.023 off), with no error. The TP/GTP step pre-hook now
refuses them on every rank before anything steps (lowband.sharding.refuse_sharded_whole_tensor_updates); the
optimizers made for the parts (GTPMuon, TpRekls) and elementwise ones step as before."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm
from lowband.optim import REKLS, ShardedMuon, TpRekls
from lowband.optim.gtp_muon import GTPMuon
from lowband.optim.muon import Muon
from lowband.plan import ModelPlan, ParallelLinear
from lowband.sharding import whole_tensor_params
from lowband.testing import run_ranks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6, dtype=torch.float64), nn.Tanh(), nn.Linear(6, 4, dtype=torch.float64))


def _one_step(model: nn.Module, opt: torch.optim.Optimizer) -> str | None:
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model(x).square().mean().backward()
    try:
        opt.step()
    except ValueError as e:
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # nothing stepped
        return str(e)
    return None


def _gtp_worker(kind: str) -> str | None:
    from lowband.parallel import build_mesh
    from lowband.parallel.gtp import GTPRuntime, is_gtp_param, shard_linears

    model = _mlp()
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    shard_linears(model, rt)
    mats = [p for p in model.parameters() if is_gtp_param(p)]
    rest = [p for p in model.parameters() if not is_gtp_param(p)]
    opt = {"torch-muon": lambda: torch.optim.Muon(mats, lr=0.02),
           "adafactor": lambda: torch.optim.Adafactor(model.parameters(), lr=0.02),
           "lbfgs": lambda: torch.optim.LBFGS(model.parameters()),
           "lowband-muon": lambda: Muon(mats, lr=0.02),
           "rekls": lambda: REKLS(model.parameters(), lr=0.02),
           "sharded-muon": lambda: ShardedMuon(mats, rest),
           "gtp-muon": lambda: GTPMuon([{"params": mats, "algorithm": "muon"},
                                        {"params": rest, "algorithm": "adamw"}], rt.comm, lr=0.02),
           "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=0.02)}[kind]()
    if kind == "lbfgs":
        try:
            opt.step(lambda: model(torch.ones(2, 4, dtype=torch.float64)).sum())
        except ValueError as e:
            return str(e)
        return None
    return _one_step(model, opt)


@pytest.mark.parametrize("kind", ["torch-muon", "adafactor", "lbfgs", "lowband-muon", "rekls", "sharded-muon"])
def test_whole_tensor_optimizers_on_gtp_shards_are_refused_on_every_rank(kind: str) -> None:
    res = run_ranks(_gtp_worker, 2, kind)
    assert res[0] == res[1] and res[0] is not None, res
    assert "updates each parameter from statistics of the whole tensor it holds, but ['0', '2'] (2 parameters) " \
           "hold one rank's part of a sharded weight (gtp over 2 ranks)" in res[0], res[0]
    assert "lowband.optim.gtp_muon.GTPMuon for GTP weights" in res[0]


@pytest.mark.parametrize("kind", ["gtp-muon", "adamw"])
def test_optimizers_made_for_the_parts_step(kind: str) -> None:
    assert run_ranks(_gtp_worker, 2, kind) == [None, None]


def _tp_worker(kind: str) -> str | None:
    from lowband.parallel import shard_tp

    model = _mlp()
    shard_tp(model, ModelPlan(parallel_linears=(ParallelLinear("0", "column"), ParallelLinear("2", "row"))),
             Comm(name="tp"))
    mats = [p for p in model.parameters() if p.dim() == 2]
    opt = {"torch-muon": lambda: torch.optim.Muon(mats, lr=0.02),
           "rekls": lambda: REKLS(model.parameters(), lr=0.02),
           "tp-rekls": lambda: TpRekls(model.parameters(), lr=0.02)}[kind]()
    return _one_step(model, opt)


def test_tensor_parallel_slices_refuse_muon_and_plain_rekls_but_not_tp_rekls() -> None:
    for kind in ("torch-muon", "rekls"):
        res = run_ranks(_tp_worker, 2, kind)
        assert res[0] == res[1] and res[0] is not None and "(tp over 2 ranks)" in res[0], (kind, res)
        assert "lowband.optim.TpRekls for tensor-parallel slices" in res[0]
    assert run_ranks(_tp_worker, 2, "tp-rekls") == [None, None]


def test_which_parameters_each_optimizer_needs_whole() -> None:
    model = _mlp()
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    ids = lambda ps: [id(p) for p in ps]
    assert ids(whole_tensor_params(torch.optim.Muon(mats))) == ids(mats)
    assert ids(whole_tensor_params(torch.optim.Adafactor(model.parameters()))) == ids(model.parameters())
    assert whole_tensor_params(torch.optim.AdamW(model.parameters())) == []
    assert ids(whole_tensor_params(REKLS(model.parameters(), lr=0.1))) == ids(mats)
    assert ids(whole_tensor_params(Muon(mats))) == ids(mats)
    assert ids(whole_tensor_params(ShardedMuon(mats, rest))) == ids(mats)
    big = REKLS([{"params": mats[:1]}, {"params": mats[1:], "max_precond_dim": 1}], lr=0.1)
    assert ids(whole_tensor_params(big)) == ids(mats[:1])  # the second matrix gets elementwise AdamW
