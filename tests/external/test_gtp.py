"""GTP on an outside-style GPT (tests/external/outside_gpt.py), 2 and 4 gloo ranks, against the
single-process reference on the same global batch (tests/external/parallel_ref.py).

What a user's own script does: per-rank seeds (``seed + rank``), ``shard_embeddings`` +
``shard_linears`` with their defaults, torch AdamW, ``sync_replicated_grads`` after backward,
``lowband.parallel.clip_grad_norm_``, evaluation on rank 0 only, and checkpoints through torch DCP.

Tolerances: float64 parameters. OutsideGPT takes its cross-entropy in float32, so the reference makes
the same float32 reduction per data lane (one loss per rank, gradients averaged over ranks, as DDP
does; tests/external/parallel_ref.py); what remains are float64 sums in other orders (the GTP
reduce-scatter against the reference's accumulation; the clipping norm as per-group partial sums),
so each step's gradient differs by a relative O(k eps64), k <= 10^3 terms (<= 2e-13). AdamW maps
that to parameter changes of lr * O(k eps) per step, and the loss is Lipschitz in the parameters
with a constant O(1) for this 2-layer model: after 4 steps both stay far below the project's float64
bound of 1e-10, which we use (a float32 cross-entropy rounding the other way in one element would be
a 6e-8 jump: the tests would see it, and it is the one event this bound does not cover). The norm returned by the clip
is a sum of the same squares in another grouping: relative 1e-12 (k eps, k ~ 10^3 elements per
partial sum, plus the square root halving it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import default_ledger, ring_wire_bytes
from lowband.parallel import (
    GTPCollectiveError,
    GTPEmbedding,
    GTPLinear,
    GTPRuntime,
    GTPStateError,
    clip_grad_norm_,
    shard_embeddings,
    shard_linears,
    sync_replicated_grads,
    unsharded_copy,
)
from lowband.parallel.gtp_state import GTPStateLayout
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, random_batch, seeded_model
from tests.external.parallel_ref import BATCH, LR, SEED, WD, lanes_of, reference_run, reference_step

TOL = 1e-10
STEPS = 4
MAX_NORM = 0.05  # below the gradient norm at every step here, so clipping is active (asserted)


def _build(tie: bool, *, init_sync: bool = True, tied: str = "replicate"):
    cfg = OutsideConfig(tie=tie)
    rank = dist.get_rank()
    model = seeded_model(SEED, rank, cfg, torch.float64)  # per-rank seeds: ranks start apart
    mesh = build_mesh(gtp=dist.get_world_size())
    rt = GTPRuntime(mesh.gtp)
    shard_embeddings(model, rt, init_sync=init_sync, tied=tied)
    shard_linears(model, rt, init_sync=init_sync, tied=tied)
    return cfg, model, rt


def _train(model: nn.Module, rt: GTPRuntime, opt: torch.optim.Optimizer, cfg: OutsideConfig, steps: range,
           max_norm: float) -> tuple[dict, dict]:
    rank = dist.get_rank()
    losses, norms = {}, {}
    for step in steps:
        x, y = random_batch(step, rank, BATCH, cfg)
        _, loss = model(x, y)
        loss.backward()
        sync_replicated_grads(rt, model)
        norms[step] = float(clip_grad_norm_(model, max_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = float(loss.detach())  # this rank's (lane's) loss
    return losses, norms


def _parity(tie: bool) -> dict:
    ledger = default_ledger()
    cfg, model, rt = _build(tie)
    syncs = ledger.select(op="broadcast", tag="init_sync")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = _train(model, rt, opt, cfg, range(1, STEPS + 1), MAX_NORM)
    logical = GTPStateLayout(model, opt).logical_state_dict()["model"]
    return {"losses": losses, "norms": norms, "params": {k: v.clone() for k, v in logical.items()},
            "tied_kept": model.lm_head.weight is model.transformer.wte.weight,
            "head_kind": type(model.lm_head).__name__, "wte_kind": type(model.transformer.wte).__name__,
            "n_gtp": len(rt.weights), "syncs": [(r.numel, r.wire_dtype, r.wire_bytes) for r in syncs],
            "numel": sum(p.numel() for p in seeded_model(SEED, 0, cfg, torch.float64).parameters()),
            "norm_tags": ledger.count(op="all_reduce", tag="gtp:norm")}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_gtp_outside_gpt_equals_single_process(world: int, tie: bool) -> None:
    res = run_ranks(_parity, world, tie)
    ref = reference_run(OutsideConfig(tie=tie), lanes_of(world), STEPS, MAX_NORM)
    n_layer = OutsideConfig().n_layer
    for r in range(world):
        got = res[r]
        # tied head/embedding: left replicated and still tied; untied: both sharded
        assert got["tied_kept"] is tie
        kinds = ("Linear", "Embedding") if tie else ("GTPLinear", "GTPEmbedding")
        assert (got["head_kind"], got["wte_kind"]) == kinds
        assert got["n_gtp"] == 4 * n_layer + 1 + (0 if tie else 2)  # block linears, wpe (+ lm_head, wte)
        # init_sync: one float64 broadcast per shard walk; the first carries the whole model
        n = got["numel"]
        assert len(got["syncs"]) == 2 and got["syncs"][0] == (n, "float64", ring_wire_bytes("broadcast", world, 8 * n))
        assert got["norm_tags"] == STEPS  # one norm all-reduce over the GTP group per clip
        for s in range(1, STEPS + 1):
            assert got["norms"][s] > MAX_NORM  # clipping was active
            assert got["norms"][s] == pytest.approx(ref["norms"][s], rel=1e-12, abs=0)
            assert got["losses"][s] == pytest.approx(ref["losses"][s][r], rel=TOL, abs=0)
        # the state dict names a tied parameter under both names (as DCP's get_state_dict does)
        assert set(got["params"]) - set(ref["params"]) == ({"lm_head.weight"} if tie else set())
        for k, v in ref["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=0, atol=TOL, msg=k)


def _torch_clip_is_per_rank(_: int) -> tuple[float, float]:
    cfg, model, rt = _build(True)
    x, y = random_batch(1, dist.get_rank(), BATCH, cfg)
    model(x, y)[1].backward()
    sync_replicated_grads(rt, model)
    per_rank = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    return per_rank, float(clip_grad_norm_(model, float("inf")))


def test_torch_clip_differs_per_rank_lowband_clip_is_global() -> None:
    res = run_ranks(_torch_clip_is_per_rank, 2, 0)
    assert res[0][0] != res[1][0]  # torch: each rank's own shards
    assert res[0][1] == res[1][1]  # lowband: one global norm


def _seed_trap(_: int) -> str:
    try:
        _build(True, init_sync=False)
    except ValueError as e:
        assert not default_ledger().select(op="all_gather")  # no weight moved
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_seeds_without_init_sync_raise_on_every_rank(world: int) -> None:
    msgs = run_ranks(_seed_trap, world, 0)
    assert len(set(msgs)) == 1
    assert "initial weights differ" in msgs[0] and "'transformer.wte.weight'" in msgs[0]


def _tied_trap(_: int) -> str:
    try:
        _build(True, tied="error")
    except ValueError as e:
        assert not default_ledger().select(op="broadcast") and not default_ledger().select(op="all_gather")
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2, 4])
def test_tied_error_policy_names_the_tie_before_any_collective(world: int) -> None:
    msgs = run_ranks(_tied_trap, world, 0)
    assert len(set(msgs)) == 1
    assert "'transformer.wte'" in msgs[0] and "lm_head.weight" in msgs[0] and "tied" in msgs[0]


def _rank0_eval(_: int) -> dict:
    cfg, model, _rt = _build(True)
    x, y = random_batch(99, 0, BATCH, cfg)
    with torch.no_grad():
        together, _ = model(x, y)  # every rank: on-demand gathers
    plain = unsharded_copy(model)  # every rank, collective
    out = {"plain_types": sorted({type(m).__name__ for m in plain.modules()} & {"GTPLinear", "GTPEmbedding",
                                                                                "Linear", "Embedding"}),
           "tied": plain.lm_head.weight is plain.transformer.wte.weight,
           "orig_still_gtp": isinstance(model.transformer.h[0].mlp.c_fc, GTPLinear)
           and isinstance(model.transformer.wpe, GTPEmbedding)}
    if dist.get_rank() == 0:
        before = len(default_ledger().records)
        with torch.no_grad():
            alone, _ = plain(x, y)  # rank 0 alone: no collective
        out["bitwise"] = torch.equal(alone, together)
        out["collectives"] = len(default_ledger().records) - before
        ref = seeded_model(SEED, 0, cfg, torch.float64)
        with torch.no_grad():
            out["ref_equal"] = torch.equal(ref(x, y)[0], alone)
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_rank0_evaluation_through_unsharded_copy(world: int) -> None:
    res = run_ranks(_rank0_eval, world, 0)
    for r in range(world):
        assert res[r]["plain_types"] == ["Embedding", "Linear"] and res[r]["tied"] and res[r]["orig_still_gtp"]
    # the gathered weights are the synced rank-0 weights bit for bit, so the lone forward is bitwise
    assert res[0]["bitwise"] and res[0]["ref_equal"] and res[0]["collectives"] == 0


def _subset_forward(_: int) -> str:
    from datetime import timedelta

    cfg = OutsideConfig(tie=True)
    model = seeded_model(SEED, dist.get_rank(), cfg, torch.float64)
    mesh = build_mesh(gtp=dist.get_world_size(), timeout=timedelta(seconds=3))
    rt = GTPRuntime(mesh.gtp)
    shard_embeddings(model, rt)
    shard_linears(model, rt)
    dist.barrier()
    if dist.get_rank() != 0:
        return "peer"  # the other ranks do not take part (they finished, or skip evaluation)
    x, y = random_batch(1, 0, BATCH, cfg)
    try:
        with torch.no_grad():
            model(x, y)  # rank 0 alone
    except GTPCollectiveError as e:
        return str(e)
    return "no error"


def test_forward_on_a_subset_of_ranks_is_a_lowband_error() -> None:
    """Rank 0 evaluates alone while its GTP peers do not join: the gather fails (group timeout) and
    surfaces as a :class:`GTPCollectiveError` naming the cause and the way out (``unsharded_copy``).

    (If the peers are inside *another* collective on the same group at that moment, gloo itself
    aborts the process on the size mismatch before Python sees an error; no library can turn that
    into an exception, which is why the documented way is ``unsharded_copy``, tested above.)
    """
    res = run_ranks(_subset_forward, 2, 0)
    assert res[1] == "peer"
    assert "every forward" in res[0] and "unsharded_copy" in res[0] and "evaluation on rank 0 only" in res[0]


def _dcp_save(path: str, tie: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cfg, model, rt = _build(tie)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _train(model, rt, opt, cfg, range(1, 3), MAX_NORM)
    # torch's own get_state_dict on the sharded model is refused (it would label shards as whole weights)
    try:
        get_state_dict(model, opt)
        refused = ""
    except GTPStateError as e:
        refused = str(e)
    layout = GTPStateLayout(model, opt)
    dcp.save(layout.state_dict(), checkpoint_id=path)  # this rank's real rows of every GTP tensor
    sd = layout.logical_state_dict()  # whole tensors (gathered), the saved keys
    return {"refused": refused, "state": {part: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                 for k, v in sd[part].items()} for part in sd}}


def _dcp_load(path: str, tie: bool) -> dict:
    import torch.distributed.checkpoint as dcp

    cfg, model, rt = _build(tie)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    layout = GTPStateLayout(model, opt)
    sd = layout.state_dict()
    dcp.load(sd, checkpoint_id=path)
    layout.load_state_dict(sd)
    loaded = {part: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sub.items()}
              for part, sub in layout.logical_state_dict().items()}  # replicated entries alias the live parameters
    losses, _ = _train(model, rt, opt, cfg, range(3, 3 + 2), MAX_NORM)
    return {"loaded": loaded, "losses": losses, "params": layout.logical_state_dict()["model"]}


@pytest.mark.parametrize(("saved", "new"), [(2, 4), (4, 2)])
def test_dcp_checkpoint_saves_resumes_and_reshards(tmp_path: Path, saved: int, new: int) -> None:
    tie = True
    path = str(tmp_path / "ckpt")
    out = run_ranks(_dcp_save, saved, path, tie)
    for r in range(saved):
        assert "GTPStateLayout" in out[r]["refused"]
    back = run_ranks(_dcp_load, new, path, tie)
    ref = reference_run(OutsideConfig(tie=tie), lanes_of(saved), 2, MAX_NORM)  # steps 1-2 at the saved size
    for r in range(new):
        for part in ("model", "optim"):
            for k, v in out[0]["state"][part].items():
                got = back[r]["loaded"][part][k]
                assert (torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v), k
    for k, v in ref["params"].items():
        torch.testing.assert_close(out[0]["state"]["model"][k], v, rtol=0, atol=TOL, msg=k)
    # after the load, 2 more steps at the new size equal a single process resumed on the same batches
    cont = _reference_resume(out[0]["state"], tie, new)
    for r in range(new):
        for s in (3, 4):
            assert back[r]["losses"][s] == pytest.approx(cont["losses"][s][r], rel=TOL, abs=0)
        for k, v in cont["params"].items():
            torch.testing.assert_close(back[r]["params"][k], v, rtol=0, atol=TOL, msg=k)


def _reference_resume(state: dict, tie: bool, world: int) -> dict:
    """Single process: load the saved logical state into a plain OutsideGPT + AdamW, train steps 3-4."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    cfg = OutsideConfig(tie=tie)
    model = seeded_model(SEED, 0, cfg, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))
    losses = {}
    for step in (3, 4):
        losses[step] = reference_step(model, step, lanes_of(world), cfg)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
