"""Streaming DiLoCo on a model with frozen, adapter, conditionally used and replica-only parameters and
buffers (issue 20, DiLoCo's part), per-rank seeded, against a single-process simulation.

Model: :class:`tests.external.conditional_model.ConditionalNet` (frozen embedding and frozen linear,
LoRA-style adapter, a branch used on even steps only, ``lane0`` used by replica 0 only and not on
every third step, a per-rank random buffer ``mix`` and a forward counter ``calls``). One replica per
rank, each training on its own lane with torch AdamW over ``model.parameters()`` (frozen ones
included: torch skips ``.grad is None``).

The semantics under test (docs/diloco.md, "Frozen, unused and conditional parameters"):

* ``init_sync`` makes every parameter, frozen ones too, and every buffer equal to replica 0's;
  ``"verify"`` names the first parameter or buffer that differs;
* frozen parameters are in no fragment and never change (bitwise replica 0's initial values);
* a fragment parameter that a replica did not use contributes a zero pseudo-gradient from that
  replica (averaged with the others'); the outer optimizer steps every fragment parameter (torchft:
  ``p.grad = pseudo-gradient`` for all of them), so outer momentum moves even one that no replica
  touched since the last sync;
* buffers are never synced after ``init_sync``.

The simulation runs every replica in one process with the same arithmetic in the same order (AdamW per
replica, flat fp64 pseudo-gradients averaged by :func:`reference_wire_all_reduce`, torch SGD per
fragment on the global copies): the distributed run must equal it bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.comm.codecs import get_wire, reference_wire_all_reduce
from lowband.diloco import StreamingDiLoCo, split_fragments
from lowband.testing import run_ranks
from tests.external.conditional_model import lane_batch, seeded_net

H, NFRAG, TAU = 4, 2, 1
LR = 1e-2
FROZEN = ["emb.weight", "base.weight", "base.bias"]


def _inner(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _outer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _state(model) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}}


def _worker(steps: int) -> dict:
    rank = dist.get_rank()
    model = seeded_net(rank)  # nanoGPT style: every replica different, frozen weights and buffers too
    before = _state(model)
    opt = _inner(model.parameters())
    dl = StreamingDiLoCo(model, opt, comm=Comm(name="replica"), sync_every=H, fragments=NFRAG, delay=TAU,
                         outer_optimizer=_outer, wire="fp64")
    synced = _state(model)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(*lane_batch(step, rank), rank).backward()
        opt.step()
    dl.close()
    return {"before": before, "synced": synced, "after": _state(model), "committed": dl.committed,
            "globals": [[g.clone() for g in gs] for gs in dl.globals], "frag_names": [f.names for f in dl.frags]}


def _simulate(replicas: int, steps: int) -> dict:
    """Every replica in one process, DiLoCo written out plainly; replica 0's initial weights and buffers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [seeded_net(0) for _ in range(replicas)]
        opts = [_inner(m.parameters()) for m in models]
        names = [f.names for f in split_fragments(models[0], NFRAG)]
        params = [dict(m.named_parameters()) for m in models]
        globals_ = [[params[0][n].detach().clone() for n in ns] for ns in names]
        outer = [_outer(g) for g in globals_]
        codec = get_wire("fp64")
        k = H // NFRAG
        local = committed = 0
        pending: list[torch.Tensor] = []
        for step in range(steps):
            for r, (m, o) in enumerate(zip(models, opts, strict=True)):
                o.zero_grad(set_to_none=True)
                m(*lane_batch(step, r), r).backward()
                o.step()
            local += 1
            f = committed % NFRAG
            if local == k - TAU:
                pending = [torch.cat([(g - params[r][n].detach()).reshape(-1) for g, n in zip(globals_[f], names[f])])
                           for r in range(replicas)]
            if local == k:
                avg = reference_wire_all_reduce(pending, codec, "avg")
                off = 0
                for g in globals_[f]:  # every fragment parameter gets a grad, zero or not (torchft)
                    g.grad = avg[off:off + g.numel()].view(g.shape).clone()
                    off += g.numel()
                outer[f].step()
                outer[f].zero_grad(set_to_none=True)
                with torch.no_grad():
                    for r in range(replicas):
                        for g, n in zip(globals_[f], names[f]):
                            params[r][n].copy_(g)
                committed += 1
                local = 0
        return {"after": [_state(m) for m in models], "globals": globals_, "committed": committed,
                "frag_names": names}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 4])
def test_frozen_params_and_buffers_synced_at_start_and_training_equals_simulation(world: int) -> None:
    steps = 11  # 5 syncs over 2 fragments (lane0 skipped on calls % 3 == 2, branch on odd calls)
    out = run_ranks(_worker, world, steps, timeout=120)
    sim = _simulate(world, steps)
    init = _state(seeded_net(0))
    assert not torch.equal(out[0]["before"]["params"]["emb.weight"], out[1]["before"]["params"]["emb.weight"])
    assert not torch.equal(out[0]["before"]["buffers"]["mix"], out[1]["before"]["buffers"]["mix"])
    for rank, o in enumerate(out):
        # init_sync: every parameter (frozen too) and every buffer is replica 0's
        for kind in ("params", "buffers"):
            for n, v in init[kind].items():
                assert torch.equal(o["synced"][kind][n], v), f"rank {rank}: {kind} {n} after init_sync"
        # frozen parameters are in no fragment and never change; the rest equals the simulation bitwise
        assert o["frag_names"] == sim["frag_names"]
        assert not set(FROZEN) & {n for ns in o["frag_names"] for n in ns}
        assert o["committed"] == sim["committed"] == 5
        for n in FROZEN:
            assert torch.equal(o["after"]["params"][n], init["params"][n]), f"rank {rank}: frozen {n} changed"
        for kind in ("params", "buffers"):
            for n, v in sim["after"][rank][kind].items():
                assert torch.equal(o["after"][kind][n], v), f"rank {rank}: {kind} {n}"
        for a, b in zip(o["globals"], sim["globals"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {rank}: global copy"
    # lane0 is used by replica 0 only: on the other replicas the inner optimizer never touches it, so it
    # is exactly the global copy its fragment's last sync wrote (a zero pseudo-gradient from them)
    f = next(i for i, ns in enumerate(sim["frag_names"]) if "lane0.weight" in ns)
    g = sim["globals"][f][sim["frag_names"][f].index("lane0.weight")]
    assert not torch.equal(out[0]["after"]["params"]["lane0.weight"], g)
    for o in out[1:]:
        assert torch.equal(o["after"]["params"]["lane0.weight"], g)
    assert all(int(o["after"]["buffers"]["calls"]) == steps for o in out)  # buffers: per replica, not synced


def _verify_worker(case: str) -> str:
    rank = dist.get_rank()
    model = seeded_net(rank if case == "seeds" else 0)
    if case == "buffer" and rank == 1:
        model.mix.add_(1.0)
    try:
        dl = StreamingDiLoCo(model, _inner(model.parameters()), comm=Comm(name="replica"), sync_every=H,
                             fragments=NFRAG, init_sync="verify")
    except ValueError as e:
        return str(e)
    dl.close()
    return "ok"


def test_verify_covers_frozen_parameters_and_buffers() -> None:
    """Per-rank seeds: the first tensor that differs is the frozen embedding (before any fragment's);
    equal weights but one buffer apart: the buffer is named. On every rank alike."""
    seeds = run_ranks(_verify_worker, 2, "seeds", timeout=60)
    assert all("init_sync='verify': parameter 'emb.weight' differs between replicas (replica 0 vs [1])" in m
               for m in seeds), seeds
    buffer = run_ranks(_verify_worker, 2, "buffer", timeout=60)
    assert all("init_sync='verify': buffer 'mix' differs between replicas (replica 0 vs [1])" in m
               for m in buffer), buffer
    assert run_ranks(_verify_worker, 2, "same", timeout=60) == ["ok", "ok"]
