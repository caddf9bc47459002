"""Issue 27 for Streaming DiLoCo with a sharded inner optimizer: DDP-script habits inside a replica, on
the outside-style GPT (tests/external/outside_gpt.py), float64, 4 gloo ranks = 2 replicas x 2 dp ranks,
``ShardedAdamW`` over each replica's dp ranks, ``StreamingDiLoCo`` across the replicas.

* ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` after backward: refused at the inner
  ``step()`` on every rank, nothing stepped, no sync ran;
* ``GradScaler`` (``scale(loss).backward(); unscale_(opt); opt.clip_grad_norm; step(opt); update()``) with an
  overflow on one rank of replica 0: replica 0 skips on both its ranks (one scale there), replica 1 steps;
  DiLoCo still counts the step on every rank, so the replicas' syncs stay paired and every rank commits
  the same outer steps.

That every rank of a replica steps exactly like DDP + torch with the same scaler calls is what
tests/external/test_habits_sharded.py checks for the sharded optimizer alone; here the point is the
composition: the skip stays inside its replica and the DiLoCo schedule does not drift (a skipped step
that DiLoCo did not count would leave replica 0 one inner step behind and its last sync without a
partner).

A torch inner optimizer is stepped by ``GradScaler.step`` only when no inf was found, so DiLoCo (which
counts inner steps in the optimizer's step hooks) never sees a skipped step and that replica falls one
step behind (its last sync has no partner: the run hangs until the process-group timeout). A fused
torch optimizer (``fused=True``) takes the found-inf flag into its own step and is stepped every
iteration: the last test shows that way, the one docs/diloco.md names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowband.diloco import StreamingDiLoCo, replica_mesh
from lowband.optim import ShardedAdamW
from lowband.testing import run_ranks
from tests.external.outside_gpt import OutsideConfig, outside_plan, random_batch, seeded_model

SEED = 5
LR, WD = 1e-2, 0.1
BATCH = 2
MAX_NORM = 0.05
STEPS, INF_AT = 4, 1
REPLICAS = 2


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _diloco_run(habit: str, inner: str = "sharded") -> dict:
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    mesh = replica_mesh(REPLICAS)
    if inner == "sharded":
        opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=WD, comm=mesh.dp, module=model)
    else:  # one rank per replica, torch's fused AdamW
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    dl = StreamingDiLoCo(model, opt, comm=mesh.replica, plan=outside_plan(model), sync_every=2, fragments=2,
                         delay=0, wire="fp32", outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu")
    out: dict = {"replica": rank // mesh.dp.size}
    try:
        for step in range(STEPS):
            loss = model(*random_batch(step, rank, BATCH, cfg))[1]
            if habit == "scaler_inf" and step == INF_AT and rank == 1:  # replica 0, its dp rank 1
                loss = loss * float("inf")
            if habit == "torch_clip":
                loss.backward()
                before = _params(model)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # this rank's local gradients
                try:
                    opt.step()
                except ValueError as e:
                    out["error"] = str(e)
                    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
                    out["committed"] = dl.committed
                return out
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if inner == "sharded":
                opt.clip_grad_norm(MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # local: a replica is one rank
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out["stepped"] = int(opt.state[next(iter(model.parameters()))]["step"]) if inner == "fused" else None
        out.update(params=_params(model), scale=float(scaler.get_scale()), committed=dl.committed)
        return out
    finally:
        dl.close()


def test_torch_clip_grad_norm_is_refused_on_every_rank() -> None:
    res = run_ranks(_diloco_run, 4, "torch_clip")
    msgs = {r.get("error") for r in res}
    assert len(msgs) == 1 and None not in msgs
    msg = msgs.pop()
    assert "\n" not in msg and "was changed after lowband reduced it" in msg and "opt.clip_grad_norm(max_norm)" in msg
    assert all(r["unchanged"] and r["committed"] == 0 for r in res)


def test_grad_scaler_overflow_stays_inside_its_replica_and_the_syncs_stay_paired() -> None:
    res = run_ranks(_diloco_run, 4, "scaler_inf")
    assert [r["replica"] for r in res] == [0, 0, 1, 1]
    assert [r["scale"] for r in res] == [2.0**15, 2.0**15, 2.0**16, 2.0**16]  # replica 0 backed off once
    committed = {r["committed"] for r in res}
    assert len(committed) == 1 and committed.pop() > 0  # the same outer syncs committed on every rank
    for a, b in ((0, 1), (2, 3)):  # the dp ranks of a replica hold the same model
        for k, v in res[a]["params"].items():
            assert torch.equal(v, res[b]["params"][k]), (a, b, k)


def test_grad_scaler_with_a_fused_torch_inner_keeps_the_syncs_paired() -> None:
    """2 ranks = 2 replicas, torch AdamW(fused=True): rank 1's overflow is skipped inside the fused step
    (its step count stays one behind), yet DiLoCo counts the iteration and both replicas commit alike."""
    res = run_ranks(_diloco_run, 2, "scaler_inf", "fused")
    assert [r["scale"] for r in res] == [2.0**16, 2.0**15]
    assert [r["stepped"] for r in res] == [STEPS, STEPS - 1]
    committed = {r["committed"] for r in res}
    assert len(committed) == 1 and committed.pop() > 0


def _gather_mode_run(param_gather: str) -> dict:
    """The sharded inner with ``param_gather`` (``"forward"``: step() returns with the updated slices' all-gathers in
    flight), 6 plain steps, DiLoCo syncing a fragment every step (H 2, 2 fragments)."""
    rank = dist.get_rank()
    cfg = OutsideConfig()
    model = seeded_model(SEED, rank, cfg, torch.float64)
    mesh = replica_mesh(REPLICAS)
    opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=WD, comm=mesh.dp, module=model,
                       param_gather=param_gather)
    dl = StreamingDiLoCo(model, opt, comm=mesh.replica, plan=outside_plan(model), sync_every=2, fragments=2,
                         delay=0, wire="fp32", outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9))
    try:
        for step in range(6):
            model(*random_batch(step, rank, BATCH, cfg))[1].backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_params()
        return {"params": _params(model), "committed": dl.committed}
    finally:
        dl.close()


def test_param_gather_forward_inner_equals_the_step_mode() -> None:
    """DiLoCo's step hook read the weights (pseudo-gradient) and wrote them (merge) while the sharded optimizer's
    all-gathers of ``param_gather="forward"`` were still in flight: 0.24-0.28 off the ``"step"`` mode after 9 steps,
    no error. The hook now waits for them on a step that syncs; the two modes are bitwise equal."""
    want = run_ranks(_gather_mode_run, 4, "step")
    got = run_ranks(_gather_mode_run, 4, "forward")
    for r in range(4):
        assert got[r]["committed"] == want[r]["committed"] == 6
        for k, v in want[r]["params"].items():
            assert torch.equal(got[r]["params"][k], v), (r, k)
