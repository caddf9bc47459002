"""Issue 20, GTP-Muon's part: :class:`lowband.optim.gtp_muon.GTPMuon` on GTP-sharded
:class:`tests.external.conditional_model.ConditionalNet` (per-rank seeds, frozen embedding and frozen
linear, LoRA adapter, ``branch`` used on even steps only, ``lane0`` used by lane 0 only and not on every
third step, buffers ``mix`` and ``calls``), on 2 and 4 gloo ranks (one GTP group over the world, one
data lane per rank), against single-process lowband :class:`~lowband.optim.muon.Muon` (``MUON_NAMES``)
plus ``torch.optim.AdamW`` (the rest) over ``model.parameters()`` on the lanes' mean loss.

The reference is plain: a parameter that no lane used this step keeps ``.grad = None`` and both
optimizers skip it (no momentum decay, no weight decay). GTP shards every linear except ``lane0`` (a
GTP layer is a collective: a layer only lane 0 runs must stay replicated, as in
tests/external/test_conditional.py), so the Muon matrices are routed shards (lora_a, lora_b, branch,
mlp: whole matrices on an owner rank, all-to-all) and one replicated matrix (lane0: updated locally on
every rank from its DDP-averaged gradient, or left alone when no lane used it).

Tolerances (float64, Newton-Schulz in float64): the distributed gradient is a reduce-scatter of
per-lane gradients, the reference's one backward of the lanes' mean: the same terms summed in another
order, relative O(k eps64) with k <= 10^3 (<= 2e-13). Newton-Schulz (five quintic iterations on a
normalized matrix, entries O(1)) propagates that to O(1e-12) in the update direction, scaled by the
Muon lr 0.02; AdamW maps it to lr * O(k eps). Six steps stay far below the project's float64 bound of
1e-10. A departure from the rule is not rounding: one extra Muon step with a decayed momentum moves a
matrix by ~lr = 2e-2, an extra AdamW step by ~1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.optim.gtp_muon import GTPMuon
from lowband.optim.muon import Muon
from lowband.parallel.gtp import GTPRuntime, shard_linears, sync_replicated_grads
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks
from tests.external.conditional_model import MUON_NAMES, lane_batch, muon_split, reference_run, seeded_net

TOL = 1e-10
STEPS = 6
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
MUON_LR, MUON_MOMENTUM = 0.02, 0.95
FROZEN = ("emb.weight", "base.weight", "base.bias")


def _ref_opts(model) -> list[torch.optim.Optimizer]:
    muon, adam = muon_split(model)
    return [Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64),
            torch.optim.AdamW(adam, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]


def _worker() -> dict:
    rank = dist.get_rank()
    model = seeded_net(rank)  # per-rank seeds: shard_linears' init sync makes rank 0's model everyone's
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    shard_linears(model, rt, include=lambda name, _m: name != "lane0")
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in MUON_NAMES], "algorithm": "muon", "lr": MUON_LR},
              {"params": [p for n, p in named.items() if n not in MUON_NAMES], "algorithm": "adamw"}]
    opt = GTPMuon(groups, rt.comm, lr=LR, betas=BETAS, weight_decay=WD, momentum=MUON_MOMENTUM,
                  ns_dtype=torch.float64)
    grads_none = []
    for step in range(STEPS):
        model(*lane_batch(step, rank), rank).backward()
        sync_replicated_grads(rt, model)
        grads_none.append(sorted(n for n, p in named.items() if p.requires_grad and p.grad is None))
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: (rt.full_weight(p.gtp) if hasattr(p, "gtp") else p.detach().clone()) for n, p in named.items()}
    return {"params": params, "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "requires_grad": {n: p.requires_grad for n, p in named.items()},
            "gtp_muon": sorted(n for n in MUON_NAMES if opt.is_gtp_muon(named[n])),
            "grads_none": grads_none}


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_muon_on_conditional_model_follows_torch(world: int) -> None:
    res = run_ranks(_worker, world)
    ref = reference_run(world, STEPS, _ref_opts)
    for rank, r in enumerate(res):
        assert r["gtp_muon"] == ["branch.weight", "lora_a.weight", "lora_b.weight", "mlp.weight"]
        for k in FROZEN:
            assert not r["requires_grad"][k], k
        # no lane used branch on odd steps, nor lane0 on steps 2 and 5 (calls % 3 == 2): .grad stays None
        for step, names in enumerate(r["grads_none"]):
            want = (["branch.bias", "branch.weight"] if step % 2 else []) + \
                (["lane0.bias", "lane0.weight"] if step % 3 == 2 else [])
            assert names == sorted(want), (rank, step)
        assert r["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=f"rank {rank}: {k}")
        for k, v in ref["buffers"].items():
            assert torch.equal(r["buffers"][k], v), k
        init = dict(seeded_net(0).named_parameters())
        for k in FROZEN:  # frozen: rank 0's initial values, bitwise
            assert torch.equal(r["params"][k], init[k].detach()), k
    for r in res[1:]:  # every rank holds the same logical model, bitwise
        for k, v in res[0]["params"].items():
            assert torch.equal(r["params"][k], v), k
