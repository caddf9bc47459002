"""Issue 27, item 5: every component under ``torch.compile`` of the whole model and of each block
(torchtitan's way: every transformer block compiled on its own), on the outside-style GPT
(tests/external/outside_gpt.py), float64, gloo ranks, against the same script run eagerly.

How lowband compiles: every ``Comm`` collective, the forward of each GTP layer and each TP collective are
opaque to dynamo (``torch.compiler.disable``: a graph break that runs eagerly); dynamo compiles the
regions between them. The GTP runtime's Python state (chain, buffer cache, ledger) is never traced, so
nothing of it is guarded on and nothing recompiles per step.

Bound: the tests compile with ``aot_eager`` (dynamo + AOT autograd, torch's own kernels): the compiled
forward and the AOT backward run the same float64 kernels, possibly with other reduction orders and
decompositions. Each op then differs by O(eps64) relative, k <= 10^3 ops per step and 3 AdamW steps
(whose update is at most ``lr`` per element and depends smoothly on the gradient whose magnitude is far
above ``eps``) keep the parameters within O(k eps64) ~ 1e-13 of eager: the project's float64 bound 1e-10
holds with a wide margin (measured: bitwise equal). The inductor test (GTP, 2 ranks) generates its own
kernels, also for OutsideGPT's float32 cross-entropy: gradients then differ by O(eps32) ~ 1e-7 relative;
three AdamW steps at lr 1e-2 move a parameter by <= 3e-2 and a relative gradient error delta changes an
Adam update by <= ~2 delta lr, so 1e-6 (absolute, on parameters of size ~1e-1) bounds it with margin.
Ranks are bitwise equal in every case (same kernels on every rank).

Compile count: ``torch._dynamo.testing.CompileCounterWithBackend`` counts compiled frames; after the first
step no frame may compile again (no recompile per step), and the total is bounded by a small constant
(the regions between the graph breaks of one block's code, shared by all blocks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.diloco import StreamingDiLoCo, replica_mesh
from lowband.optim import ShardedAdamW, ShardedMuon
from lowband.optim.gtp_muon import GTPMuon
from lowband.optim.sparse_rows import sparse_tables_from_plan
from lowband.parallel import (
    GTPOptions,
    GTPRuntime,
    TPInputGather,
    shard_embeddings,
    shard_linears,
    shard_tp,
    unsharded_copy,
)
from lowband.parallel.gtp import is_gtp_param, reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.plan import muon_split
from lowband.testing import run_ranks
from lowband.train.config import Config
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model
from tests.external.parallel_ref import BATCH, LR, SEED, WD

TOL = 1e-10
TOL_INDUCTOR = 1e-6
STEPS = 3
MAX_FRAMES = 16  # compiled frames in all: a few regions per block's code plus the model's own forward
TIMEOUT = 240


def _build(component: str, cfg: OutsideConfig):
    """(model, optimizer, forward module, after-backward hook) as a user's script sets them up."""
    rank = dist.get_rank()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    after = None
    fwd = model
    if component == "sharded_adamw":
        with torch.no_grad():  # ranks start equal, as DDP would make them
            for p in model.parameters():
                Comm().broadcast(p.data, src=0, tag="user-init")
        opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=WD, comm=Comm(), module=model)
    elif component in ("sharded_muon", "sparse"):  # init_sync: rank 0's weights
        if component == "sparse":  # wte's gradient row-sparse to the rows' owners (untied head)
            tables = sparse_tables_from_plan(model, ["wte"], plan=outside_plan(model))
            opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=WD, comm=Comm(), module=model,
                               sparse_tables=tables, sparse_mode="sparse")
            fwd = _ObserveTokens(model, opt)
        else:
            muon, adam = muon_split(model, outside_plan(model))
            opt = ShardedMuon(muon, adam, lr=0.02, momentum=0.95, weight_decay=WD, ns_dtype=torch.float64,
                              adamw_lr=LR, adamw_weight_decay=WD, comm=Comm(), module=model)
    elif component in ("gtp", "gtp_muon"):
        rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp, GTPOptions())
        shard_embeddings(model, rt)
        shard_linears(model, rt)
        if component == "gtp":
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        else:
            muon = [p for n, p in model.named_parameters() if is_gtp_param(p) and ".h." in n]
            ids = {id(p) for p in muon}
            rest = [p for p in model.parameters() if id(p) not in ids]
            opt = GTPMuon([{"params": muon, "algorithm": "muon", "lr": 0.05},
                           {"params": rest, "algorithm": "adamw"}], rt.comm, lr=LR, weight_decay=WD,
                          ns_dtype=torch.float64)
    elif component == "tp":
        mesh = build_mesh(tp=2)
        shard_tp(model, outside_plan(model), mesh.tp, sync_comm=Comm())
        fwd = TPInputGather(model, mesh.tp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        if mesh.dp.size > 1:
            def after() -> None:
                reduce_grads(mesh.dp, model.parameters(), "avg", tag="grad")
    elif component == "diloco":
        mesh = replica_mesh(dist.get_world_size())
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        opt.diloco = StreamingDiLoCo(model, opt, comm=mesh.replica, plan=outside_plan(model), sync_every=2,
                                     fragments=2, delay=0, wire="fp32",
                                     outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9))
    else:
        raise AssertionError(component)
    return model, opt, fwd, after


class _ObserveTokens(torch.nn.Module):
    """The sparse-table script's forward: ``opt.observe_tokens(x)`` (eager), then the model."""

    def __init__(self, model: torch.nn.Module, opt: ShardedAdamW) -> None:
        super().__init__()
        self.model, self.opt = model, opt

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        self.opt.observe_tokens(x)
        return self.model(x, y)


def _train(component: str, mode: str, backend: str, tie: bool) -> dict:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # a pooled worker process: forget earlier tests' compiled code
    cfg = OutsideConfig(tie=tie)
    model, opt, fwd, after = _build(component, cfg)
    counter = CompileCounterWithBackend(backend)
    if mode == "whole":
        fwd = torch.compile(fwd, backend=counter)  # the user's habit: a compiled wrapper
    elif mode == "block":
        for block in model.transformer.h:
            block.compile(backend=counter)  # in place, torchtitan's per-block compile
    frames, losses = [], []
    for step in range(1, STEPS + 1):
        x, y = random_batch(step, dist.get_rank(), BATCH, cfg)
        _, loss = fwd(x, y)
        loss.backward()
        if after is not None:
            after()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        frames.append(counter.frame_count)
    if component in ("gtp", "gtp_muon", "tp"):
        params = {n: p.detach().clone() for n, p in unsharded_copy(model).named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if component == "diloco":
        opt.diloco.close()
    torch._dynamo.reset()
    return {"losses": losses, "params": params, "frames": frames}


def _eager_and_compiled(component: str, mode: str, backend: str, tie: bool) -> dict:
    return {"eager": _train(component, "eager", backend, tie), "compiled": _train(component, mode, backend, tie)}


def _check(res: list[dict], tol: float, ranks_equal: bool = True) -> None:
    for r, out in enumerate(res):
        eager, comp = out["eager"], out["compiled"]
        assert eager["frames"][-1] == 0
        frames = comp["frames"]
        assert 0 < frames[0] <= MAX_FRAMES, frames
        assert frames[-1] == frames[0], f"recompiled after the first step: frames per step {frames}"
        torch.testing.assert_close(torch.tensor(comp["losses"], dtype=torch.float64),
                                   torch.tensor(eager["losses"], dtype=torch.float64), rtol=0, atol=tol)
        assert set(comp["params"]) == set(eager["params"])
        for k, v in eager["params"].items():
            torch.testing.assert_close(comp["params"][k], v, rtol=0, atol=tol, msg=f"{k} rank {r}")
    if not ranks_equal:
        return
    for k in res[0]["compiled"]["params"]:  # logical (unsharded) parameters: every rank the same
        for r in range(1, len(res)):
            assert torch.equal(res[r]["compiled"]["params"][k], res[0]["compiled"]["params"][k]), (k, r)


CASES = [
    ("sharded_adamw", "whole", 2), ("sharded_adamw", "block", 2),
    ("sharded_muon", "block", 2), ("sparse", "whole", 2),
    ("gtp", "whole", 2), ("gtp", "block", 2), ("gtp", "block", 4),
    ("gtp_muon", "whole", 2), ("gtp_muon", "block", 2),
    ("tp", "whole", 2), ("tp", "block", 2),
    ("diloco", "block", 2),
]


@pytest.mark.parametrize(("component", "mode", "world"), CASES)
def test_compiled_equals_eager(component: str, mode: str, world: int):
    """aot_eager, float64: compiled equals eager to 1e-10, ranks bitwise equal, no recompile after step 1."""
    tie = component not in ("tp", "sparse")  # TP's plan takes the head untied (tied: replicated, also fine);
    # a sparse table must be untied
    res = run_ranks(_eager_and_compiled, world, component, mode, "aot_eager", tie, timeout=TIMEOUT)
    _check(res, TOL, ranks_equal=component != "diloco")  # DiLoCo replicas differ between syncs, by design


def test_gtp_inductor():
    """The inductor backend (generated C++ kernels) on GTP, per-block compile, 2 ranks: equal to eager
    within 1e-6 (see the module docstring), ranks bitwise equal."""
    _check(run_ranks(_eager_and_compiled, 2, "gtp", "block", "inductor", True, timeout=TIMEOUT), TOL_INDUCTOR)


def _trainer_run(cfg) -> dict:
    import torch._dynamo

    from tests.external.test_trainer_outside import _run

    torch._dynamo.reset()
    counter = torch._dynamo.utils.counters
    counter.clear()
    out = _run(cfg)
    out["frames"] = int(counter["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return out


def test_trainer_run_compile_gtp(shard: str):
    """``--run.compile=true`` with the ``gtp`` strategy, 2 ranks, float64 (the trainer compiles each block
    with the default inductor backend; the blocks are float64 only, OutsideGPT's float32 cross-entropy stays
    outside them): the same parameters as the eager run to 1e-10 (O(k eps64), see the module docstring) and
    the same logged losses to float32 rounding."""
    from lowband.train.compiling import find_blocks
    from lowband.train.config import load_config
    from tests.external.test_trainer_outside import LOSS_TOL, outside_config

    assert load_config(None, ["--run.compile=true"]).run.compile is True
    assert Config().run.compile is False
    eager_cfg = outside_config(shard, 2, "gtp", 2, steps=3)
    compiled_cfg = outside_config(shard, 2, "gtp", 2, steps=3)
    compiled_cfg.run.compile = True
    eager = run_ranks(_trainer_run, 2, eager_cfg, timeout=TIMEOUT)
    comp = run_ranks(_trainer_run, 2, compiled_cfg, timeout=TIMEOUT)
    assert len(find_blocks(seeded_model(SEED, 0, OutsideConfig()))) == 2
    for r in range(2):
        assert eager[r]["frames"] == 0 and 0 < comp[r]["frames"] <= MAX_FRAMES
        assert comp[r]["params"].keys() == eager[r]["params"].keys()
        for k, v in eager[r]["params"].items():
            torch.testing.assert_close(comp[r]["params"][k], v, rtol=0, atol=TOL, msg=k)
            assert torch.equal(comp[r]["params"][k], comp[0]["params"][k]), (k, r)
        torch.testing.assert_close(torch.tensor(comp[r]["losses"]), torch.tensor(eager[r]["losses"]),
                                   rtol=LOSS_TOL, atol=0)
