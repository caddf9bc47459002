"""Issue 20: frozen, adapter, conditionally used and lane-only parameters, and buffers, under every
component, against single-process torch (tests/external/conditional_model.py), 2 and 4 gloo ranks.

The rule under test (PyTorch semantics, as torch.optim + DDP(find_unused_parameters=True)): a frozen
parameter is never touched; a parameter used on some ranks is averaged with zeros from the others; a
parameter used on no rank this step keeps ``.grad = None`` and torch's optimizer leaves it alone (no
moment decay, no weight decay, no step count); buffers start as rank 0's copy.

Tolerances: float64 throughout. The distributed runs evaluate the same sums in other orders (rank
mean of per-lane mean gradients vs one sum of the lanes' means; reduce-scatter partial sums), so each
step's gradient differs by a relative O(k eps64), k <= 10^3 terms (<= 2e-13); AdamW's and Muon's
updates map that to parameter changes of lr * O(k eps) per step: after 6 steps far below the project's
float64 bound of 1e-10. A departure from the rule is not a rounding effect: an extra moment decay or
weight-decay step moves a parameter by lr * O(1) = 1e-2 (AdamW) and shows at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowband.comm import Comm
from lowband.optim import Muon, ShardedAdamW, ShardedMuon
from lowband.optim.sparse_rows import sparse_table_for
from lowband.testing import run_ranks
from tests.external.conditional_model import (
    MUON_NAMES,
    lane_batch,
    muon_split,
    reference_run,
    seeded_net,
)

TOL = 1e-10
STEPS = 6
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
MUON_LR, MUON_MOMENTUM = 0.02, 0.95
FROZEN = ("emb.weight", "base.weight", "base.bias")


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)


def _ref_adamw(model) -> list[torch.optim.Optimizer]:
    return [_adamw(model.parameters())]


def _ref_muon(model) -> list[torch.optim.Optimizer]:
    muon, adam = muon_split(model)
    return [Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD, ns_dtype=torch.float64), _adamw(adam)]


def _snapshot(model) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()}}


def _train(model, opt, steps: range, *, sparse: bool = False, sync=None) -> None:
    rank = dist.get_rank()
    for step in steps:
        x, y = lane_batch(step, rank)
        if sparse:
            opt.observe_tokens(x)
        loss = model(x, y, rank)
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_matches(res: list[dict], ref: dict) -> None:
    for r in res:
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=TOL, atol=TOL, msg=k)
        for k, v in ref["buffers"].items():
            assert torch.equal(r["buffers"][k], v), k
        for k in FROZEN:
            assert not r["requires_grad"][k], k
    for r in res[1:]:  # every rank holds the same model, bitwise
        for k, v in res[0]["params"].items():
            assert torch.equal(r["params"][k], v), k


def _initial_frozen_differs(world: int) -> None:
    """The per-rank seeds really start ranks apart in frozen weights and buffers (else init sync of
    frozen state would be untested)."""
    a, b = seeded_net(0), seeded_net(world - 1)
    assert not torch.equal(a.emb.weight, b.emb.weight) and not torch.equal(a.base.bias, b.base.bias)
    assert not torch.equal(a.mix, b.mix)


# ------------------------------------------------------------------ sharded AdamW / Muon / sparse
def _sharded(algo: str, sparse: bool) -> dict:
    model = seeded_net(dist.get_rank())
    if algo == "adamw":
        tables = [sparse_table_for(model, "aux.weight", name="aux")] if sparse else []
        opt = ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=Comm(), module=model,
                           sparse_tables=tables)
    else:
        muon, adam = muon_split(model)
        opt = ShardedMuon(muon, adam, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WD,
                          ns_dtype=torch.float64, adamw_lr=LR, adamw_betas=BETAS, adamw_weight_decay=WD,
                          comm=Comm(), module=model)
    _train(model, opt, range(STEPS), sparse=sparse)
    return _snapshot(model)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo,sparse", [("adamw", False), ("adamw", True), ("muon", False)])
def test_sharded_optimizers_follow_torch_on_unused_and_frozen_params(world: int, algo: str, sparse: bool) -> None:
    _initial_frozen_differs(world)
    res = run_ranks(_sharded, world, algo, sparse)
    ref = reference_run(world, STEPS, _ref_adamw if algo == "adamw" else _ref_muon)
    _assert_matches(res, ref)
    assert set(MUON_NAMES) <= set(ref["params"])


def test_reference_really_skips_unused_params() -> None:
    """The reference itself: branch is untouched on odd steps, lane0 on steps 2 and 5 (used by no lane),
    so a zero-filling optimizer would differ from it by far more than the tolerance."""
    zero_filled = _zero_filled_reference(2, STEPS)
    ref = reference_run(2, STEPS, _ref_adamw)
    for name in ("branch.weight", "lane0.weight"):
        assert (zero_filled[name] - ref["params"][name]).abs().max() > 1e-4, name


def _zero_filled_reference(world: int, steps: int) -> dict:
    def opts(model):
        class ZeroFill(torch.optim.AdamW):
            def step(self, closure=None):
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.requires_grad and p.grad is None:
                            p.grad = torch.zeros_like(p)
                return super().step(closure)
        return [ZeroFill(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)]
    return reference_run(world, steps, opts)["params"]


# ------------------------------------------------------------------ DCP resume and reshard
def _sharded_dcp(path: str, steps: tuple[int, int], resume: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = seeded_net(dist.get_rank() + 50 * resume)  # resumed weights come from the checkpoint
    opt = ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=Comm(), module=model)
    if resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(model, opt, range(*steps))
    if not resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _snapshot(model)


@pytest.mark.parametrize("world_save,world_load", [(2, 2), (2, 4)])
def test_sharded_adamw_dcp_resume_keeps_per_parameter_steps(tmp_path: Path, world_save: int,
                                                           world_load: int) -> None:
    """Saved after step 3 (branch last used at step 2, lane0 unused at step 2): the per-parameter
    step counts and moments resume, also resharded, so 3 + 3 steps equal 6 uninterrupted ones. The
    lanes are fixed by the load world (the reference runs its lanes); the save run uses the first
    ``world_save`` of them."""
    path = str(tmp_path / "ckpt")
    run_ranks(_sharded_dcp, world_save, path, (0, 3), False)
    res = run_ranks(_sharded_dcp, world_load, path, (3, STEPS), True)
    ref = _split_reference(world_save, world_load)
    _assert_matches(res, ref)


def _split_reference(world_a: int, world_b: int) -> dict:
    """Reference for a run of 3 steps on ``world_a`` lanes, then 3 on ``world_b`` lanes."""
    model = seeded_net(0)
    opt = _adamw(model.parameters())
    for step in range(STEPS):
        world = world_a if step < 3 else world_b
        total = torch.zeros((), dtype=torch.float64)
        for lane in range(world):
            model.calls.fill_(step)
            total = total + model(*lane_batch(step, lane), lane)
        (total / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.calls.fill_(STEPS)
    return _snapshot(model)


# ------------------------------------------------------------------ GTP
def _gtp() -> dict:
    from lowband.parallel import GTPRuntime, shard_linears, sync_replicated_grads
    from lowband.parallel.gtp_state import GTPStateLayout
    from lowband.parallel.mesh import build_mesh

    model = seeded_net(dist.get_rank())
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    # lane0 runs on rank 0 only: a GTP layer must run on every rank of its group, so it stays replicated
    shard_linears(model, rt, include=lambda name, _m: name != "lane0")
    opt = _adamw(model.parameters())
    _train(model, opt, range(STEPS), sync=lambda: sync_replicated_grads(rt, model))
    logical = GTPStateLayout(model, opt).logical_state_dict()["model"]
    return {"params": {k: v.clone() for k, v in logical.items()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
            "sharded": sorted(n for n, m in model.named_modules() if type(m).__name__ == "GTPLinear")}


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_frozen_and_conditional_linears_follow_torch(world: int) -> None:
    res = run_ranks(_gtp, world)
    ref = reference_run(world, STEPS, _ref_adamw)
    _assert_matches(res, ref)
    assert res[0]["sharded"] == ["base", "branch", "head", "lora_a", "lora_b", "mlp"]


# ------------------------------------------------------------------ Hugging Face Llama, frozen part
def _llama(seed_rank: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(100 + seed_rank)
    cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    model.model.embed_tokens.requires_grad_(False)  # frozen embedding and first block (a fine-tune)
    model.model.layers[0].requires_grad_(False)
    return model


def _llama_batch(step: int, lane: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 * step + lane)
    return torch.randint(0, 48, (2, 8), generator=g)


def _llama_sharded() -> dict:
    rank = dist.get_rank()
    model = _llama(rank)
    opt = ShardedAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=Comm(), module=model)
    for step in range(4):
        x = _llama_batch(step, rank)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_hf_llama_with_frozen_part_under_sharded_adamw(world: int) -> None:
    res = run_ranks(_llama_sharded, world)
    model = _llama(0)
    opt = _adamw(model.parameters())
    for step in range(4):
        loss = sum(model(input_ids=(x := _llama_batch(step, lane)), labels=x).loss for lane in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    frozen_before = _llama(0)
    for n, p in model.named_parameters():
        for r in res:
            torch.testing.assert_close(r[n], p.detach(), rtol=TOL, atol=TOL, msg=n)
        if not p.requires_grad:  # frozen: rank 0's initial values, untouched
            assert torch.equal(res[-1][n], dict(frozen_before.named_parameters())[n].detach()), n
