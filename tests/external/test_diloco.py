"""Streaming DiLoCo on an outside-style GPT (tied wte/lm_head, biases, nanoGPT names, per-rank seeds).

A user's own loop: ``seeded_model(seed, rank)`` (ranks start different), the plan from
``outside_plan`` (fragments from its ``fragment_units``; the tied weight is one parameter, synced
once), AdamW inside, inner data parallelism over ``mesh.dp`` by hand, ``topk-int4`` pseudo-gradients
with error feedback. Checked against a single-process float64 simulation bit for bit (same arithmetic
order: fragments' flat pseudo-gradients, decoded messages summed in replica order, AdamW on the
dp-averaged gradient), then save / resume / reshard through torch DCP and the public state API.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lowband.comm.codecs import get_wire, reference_wire_all_reduce, sender_roundtrip
from lowband.diloco import StreamingDiLoCo, replica_mesh, split_fragments
from lowband.diloco.state import DilocoCheckpoint
from lowband.testing import run_ranks
from tests.external.outside_gpt import outside_plan, random_batch, seeded_model

SEED = 3
DT = torch.float64
KW = dict(sync_every=6, fragments=3, delay=1, alpha=0.0, wire="topk-int4", block_size=16, topk_chunk=64, topk_k=8)
LR = 3e-3


def _outer(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _step(model, opt, step: int, rank: int, dp_comm) -> None:
    x, y = random_batch(step, rank)
    opt.zero_grad()
    model(x, y)[1].backward()
    if dp_comm is not None and dp_comm.size > 1:
        for p in model.parameters():
            dp_comm.all_reduce(p.grad, "avg", tag="grad")
    opt.step()


def _setup(replicas: int):
    mesh = replica_mesh(replicas)
    model = seeded_model(SEED, dist.get_rank(), dtype=DT)  # nanoGPT style: every rank different
    with torch.no_grad():  # a replica's dp ranks start equal, as DDP would make them
        for p in model.parameters():
            mesh.dp.broadcast(p.data, src=0, tag="user-init")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dl = StreamingDiLoCo(model, opt, comm=mesh.replica, outer_optimizer=_outer, plan=outside_plan(model), **KW)
    return mesh, model, opt, dl


def _snapshot(model, dl) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "globals": [[g.clone() for g in gs] for gs in dl.globals],
            "residuals": [r.clone() for r in dl.residuals], "committed": dl.committed,
            "frag_names": [f.names for f in dl.frags]}


def _train_worker(replicas: int, steps: int, save_at: int | None = None, ckpt: str = "") -> dict:
    mesh, model, opt, dl = _setup(replicas)
    for step in range(steps):
        _step(model, opt, step, dist.get_rank(), mesh.dp)
        if save_at is not None and step + 1 == save_at:
            ck = DilocoCheckpoint(model, opt, dl, mesh.shape.replica, mesh.shape.dp, mesh.coords.replica)
            dcp.save(ck.state_dict(), checkpoint_id=ckpt)
    out = _snapshot(model, dl)
    dl.close()
    return out


def _resume_worker(replicas: int, start: int, steps: int, ckpt: str) -> dict:
    mesh, model, opt, dl = _setup(replicas)  # fresh weights (other seeds), then the checkpoint
    ck = DilocoCheckpoint(model, opt, dl, mesh.shape.replica, mesh.shape.dp, mesh.coords.replica)
    sd = ck.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    ck.load_state_dict(sd)
    for step in range(start, steps):
        _step(model, opt, step, dist.get_rank(), mesh.dp)
    out = _snapshot(model, dl)
    dl.close()
    return out


def _simulate(replicas: int, dp0: int, steps: int, dp_after: tuple[int, int] | None = None) -> dict:
    """Every replica in one process, DiLoCo with error feedback written out plainly (float64); ``dp0``
    ranks per replica, ``dp_after = (step, dp)`` changes that from ``step`` on (a resharded resume)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [seeded_model(SEED, 0, dtype=DT) for _ in range(replicas)]  # replica 0's rank 0 weights
        opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
        frags = split_fragments(models[0], KW["fragments"], plan=outside_plan(models[0]))
        names = [f.names for f in frags]
        params = [dict(m.named_parameters()) for m in models]
        globals_ = [[params[0][n].detach().clone() for n in ns] for ns in names]
        outer = [_outer(g) for g in globals_]
        codec = get_wire(KW["wire"], KW["block_size"], KW["topk_chunk"], KW["topk_k"])
        res = [[torch.zeros(sum(params[0][n].numel() for n in ns), dtype=DT) for ns in names]
               for _ in range(replicas)]
        k, tau, nf = KW["sync_every"] // KW["fragments"], KW["delay"], KW["fragments"]
        local = committed = 0
        pending: list[torch.Tensor] = []
        for step in range(steps):
            dp = dp_after[1] if dp_after is not None and step >= dp_after[0] else dp0
            for r, (m, o) in enumerate(zip(models, opts, strict=True)):
                grads = []
                for d in range(dp):
                    m.zero_grad()
                    x, y = random_batch(step, r * dp + d)
                    m(x, y)[1].backward()
                    grads.append([p.grad.clone() for p in m.parameters()])
                for i, p in enumerate(m.parameters()):
                    acc = grads[0][i].clone()
                    for d in range(1, dp):
                        acc += grads[d][i]
                    p.grad = acc / dp if dp > 1 else acc
                o.step()
            local += 1
            f = committed % nf
            if local == k - tau:
                pending = [torch.cat([(g - params[r][n].detach()).reshape(-1) for g, n in zip(globals_[f], names[f])])
                           + res[r][f] for r in range(replicas)]
            if local == k:
                avg = reference_wire_all_reduce(pending, codec, "avg")
                for r in range(replicas):
                    res[r][f] = pending[r] - sender_roundtrip(codec, pending[r], replicas)
                off = 0
                for g in globals_[f]:
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
        return {"params": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models],
                "globals": globals_, "residuals": res, "committed": committed, "frag_names": names}
    finally:
        torch.set_num_threads(threads)


def _assert_matches(out: list[dict], sim: dict, dp: int) -> None:
    for rank, o in enumerate(out):
        r = rank // dp
        assert o["frag_names"] == sim["frag_names"] and o["committed"] == sim["committed"]
        for a, b in zip(o["globals"], sim["globals"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {rank}: global copy"
        for a, b in zip(o["residuals"], sim["residuals"][r], strict=True):
            assert torch.equal(a, b), f"rank {rank}: residual"
        for n, p in o["params"].items():
            assert torch.equal(p, sim["params"][r][n]), f"rank {rank}: {n}"


def test_fragments_come_from_the_plan_and_the_tied_weight_is_synced_once() -> None:
    model = seeded_model(SEED, 0, dtype=DT)
    frags = split_fragments(model, 3, plan=outside_plan(model))
    flat = [n for f in frags for n in f.names]
    assert flat == [n for n, _ in model.named_parameters()]  # every parameter once, in order
    assert "lm_head.weight" not in flat and "transformer.wte.weight" in frags[0].names  # tied: one name
    assert [f.names[0] for f in frags] == ["transformer.wte.weight", "transformer.h.0.ln_1.weight",
                                           "transformer.h.1.ln_1.weight"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    split = [[model.transformer.wte.weight, model.transformer.wpe.weight], [*model.transformer.h.parameters(),
             *model.transformer.ln_f.parameters()], [model.lm_head.weight]]
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight' \(tied: \['transformer\.wte\.weight', "
                                         r"'lm_head\.weight'\].* is in fragments 0 and 2"):
        StreamingDiLoCo(model, opt, sync_every=4, fragments=split)


@pytest.mark.parametrize(("world", "replicas"), [(2, 2), (4, 4), (4, 2)])
def test_outside_gpt_diloco_equals_simulation(world: int, replicas: int) -> None:
    steps = 13  # 6 syncs over 3 fragments, the 7th fragment prepared and in flight at the end
    out = run_ranks(_train_worker, world, replicas, steps, timeout=240)
    _assert_matches(out, _simulate(replicas, world // replicas, steps), world // replicas)


@pytest.mark.parametrize(("world_save", "world_load"), [(2, 2), (4, 2)])
def test_outside_gpt_dcp_resume_and_reshard_bitwise(tmp_path: Path, world_save: int, world_load: int) -> None:
    """Save through DCP at step 7 (fragment in flight, residuals non-zero) on ``world_save`` ranks
    (2 replicas x world/2 dp), resume on fresh weights on ``world_load`` ranks (same replicas, other
    dp size): the resumed run ends bitwise where the uninterrupted single-process simulation ends."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_train_worker, world_save, 2, 7, 7, ckpt, timeout=240)
    out = run_ranks(_resume_worker, world_load, 2, 7, 13, ckpt, timeout=240)
    # the reference: dp = world_save / 2 ranks per replica for steps 0..6, world_load / 2 after
    _assert_matches(out, _simulate(2, world_save // 2, 13, dp_after=(7, world_load // 2)), world_load // 2)


def _verify_worker(same_seed: bool) -> str:
    model = seeded_model(SEED, 0 if same_seed else dist.get_rank(), dtype=DT)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        dl = StreamingDiLoCo(model, opt, comm=replica_mesh(dist.get_world_size()).replica, init_sync="verify",
                             plan=outside_plan(model), **KW)
    except ValueError as e:
        return str(e)
    dl.close()
    return "ok"


def test_per_rank_seeds_are_caught_by_verify_on_every_rank() -> None:
    """nanoGPT's ``seed + rank`` leaves replicas different: ``init_sync="verify"`` raises on every rank,
    naming the first parameter that differs (the default, broadcast, makes them equal instead)."""
    out = run_ranks(_verify_worker, 2, False, timeout=120)
    assert all("parameter 'transformer.wte.weight' differs between replicas (replica 0 vs [1])" in m for m in out)
    assert run_ranks(_verify_worker, 2, True, timeout=120) == ["ok", "ok"]
