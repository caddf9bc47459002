"""Issue 20, tensor parallelism's part: ``lowband.parallel.shard_tp`` on a conditional model, 2 and 4
gloo ranks (TP 2, TP 4, TP 2 x DP 2), against single-process ``torch.optim.AdamW``.

Model: :class:`tests.external.conditional_model.TPConditionalNet` (``ConditionalNet`` plus
column -> row pairs), per-rank seeds. The plan (:func:`~tests.external.conditional_model.tp_conditional_plan`)
splits four pairs: ``base2`` (frozen weights and biases, run every step), ``branch`` (run on even steps
by every rank: on odd steps no rank runs it and its slices keep ``.grad = None``), ``lane0`` (run by
data lane 0 only, i.e. by every rank of TP group 0 and by no rank of the others, and on every third
step by no lane: averaged over DP with zeros by :func:`lowband.parallel.gtp.reduce_grads`) and ``mlp``.
The frozen ``emb``/``base``, the adapter, ``head`` and the buffers stay replicated. Every rank of a TP
group feeds its group's lane batch (TP peers compute on one microbatch); DP averages across groups.

The rule (torch.optim + DDP(find_unused_parameters=True)): frozen parameters untouched (bitwise rank 0's
initial values, still frozen after sharding), a parameter no lane used keeps ``.grad = None`` and AdamW
skips it, buffers start as rank 0's.

TP layers are collectives: a TP layer that some ranks of its group run and others do not cannot work.
:func:`test_tp_layer_run_by_some_ranks_of_its_group_fails_on_every_rank` checks that this ends in an
error on every rank within the process-group timeout, not in a hang or a silently wrong result.

Tolerances (float64): the TP run sums the same products in other orders (the row-parallel all-reduce of
partial products, the column-parallel dX all-reduce, the DP average of per-lane gradients vs one
backward of the lanes' mean loss): relative O(k eps64) per step, k <= 10^3 (<= 2e-13); AdamW maps it
to parameter differences of lr * O(k eps) per step, far below the project's float64 bound of 1e-10
after 6 steps. A departure from the rule (an extra AdamW step with zero gradient) moves a parameter by
~lr = 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.parallel import shard_tp, unsharded_copy
from lowband.parallel.gtp import reduce_grads
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.conditional_model import (
    TP_PAIRS,
    lane_batch,
    reference_run,
    seeded_tp_net,
    tp_conditional_plan,
)

TOL = 1e-10
STEPS = 6
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
FROZEN = ("emb.weight", "base.weight", "base.bias", "base2.weight", "base2.bias", "base2_out.weight",
          "base2_out.bias")
SHORT_PG_TIMEOUT = 8  # seconds: the divergent test waits this long for the collective that never pairs


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)


def _worker(tp: int) -> dict:
    model = seeded_tp_net(dist.get_rank())
    mesh = build_mesh(tp=tp)
    layers = shard_tp(model, tp_conditional_plan(), mesh.tp, sync_comm=Comm())
    opt = _adamw(model.parameters())
    lane = mesh.lane
    grads_none = []
    for step in range(STEPS):
        model(*lane_batch(step, lane), lane).backward()
        if mesh.dp.size > 1:
            reduce_grads(mesh.dp, model.parameters(), "avg", tag="grad")
        grads_none.append(sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None))
        opt.step()
        opt.zero_grad(set_to_none=True)
    plain = unsharded_copy(model)
    return {"params": {n: p.detach().clone() for n, p in plain.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
            "kinds": {n: type(m).__name__ for n, m in layers.items()},
            "grads_none": grads_none}


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "tp2xdp2"])
def test_tp_on_conditional_model_follows_torch(world: int, tp: int) -> None:
    res = run_ranks(_worker, world, tp)
    lanes = world // tp
    ref = reference_run(lanes, STEPS, lambda m: [_adamw(m.parameters())], net=seeded_tp_net)
    init = dict(seeded_tp_net(0).named_parameters())
    for rank, r in enumerate(res):
        assert r["kinds"] == {**{n: "ColumnParallelLinear" for n in TP_PAIRS},
                              **{f"{n}_out": "RowParallelLinear" for n in TP_PAIRS}}
        for k in FROZEN:
            assert not r["requires_grad"][k], k
            assert torch.equal(r["params"][k], init[k].detach()), f"rank {rank}: frozen {k} changed"
        # after the DP average: branch has no grad on odd steps (no rank ran it), lane0 on steps 2 and 5
        # (calls % 3 == 2: no lane ran it); on the other steps lane 1's TP group got lane 0's grads / 2
        for step, names in enumerate(r["grads_none"]):
            want = (["branch.bias", "branch.weight", "branch_out.bias", "branch_out.weight"] if step % 2 else []) \
                + (["lane0.bias", "lane0.weight", "lane0_out.bias", "lane0_out.weight"] if step % 3 == 2 else [])
            assert names == sorted(want), (rank, step)
        assert r["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=f"rank {rank}: {k}")
        for k, v in ref["buffers"].items():
            assert torch.equal(r["buffers"][k], v), k
    for r in res[1:]:
        for k, v in res[0]["params"].items():
            assert torch.equal(r["params"][k], v), k


def _divergent() -> tuple[str, str]:
    """TP 2 over the world, but each rank passes its *own* lane (a user's per-rank condition): ``lane0``'s
    pair runs on rank 0 only. Its row all-reduce then pairs with the next TP collective of rank 1 (same
    shape: every TP collective here is ``[BATCH, SEQ, DIM]``)."""
    rank = dist.get_rank()
    model = seeded_tp_net(rank)
    shard_tp(model, tp_conditional_plan(), build_mesh(tp=dist.get_world_size()).tp, sync_comm=Comm())
    opt = _adamw(model.parameters())
    try:
        for step in range(3):
            model(*lane_batch(step, 0), rank).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e)
    return "none", ""


def test_tp_layer_run_by_some_ranks_of_its_group_fails_on_every_rank() -> None:
    """Every TP collective carries its layer's signature (lowband.parallel.tensor, ``SITE_BITS`` +-1
    elements): the first paired collective of two different layers fails on every rank, before any
    optimizer step, each rank naming the layer it was running."""
    res = run_ranks(_divergent, 2, timeout=60, pg_timeout=SHORT_PG_TIMEOUT)
    for kind, msg in res:
        assert kind == "TPCollectiveError", res
        assert "ran a different TP layer's" in msg and "keep it out of the plan's parallel_linears" in msg, res
    assert "'lane0" in res[0][1], res  # rank 0 was in the lane-only layer
    assert "'lane0" not in res[1][1], res  # rank 1 in the next layer of the model
