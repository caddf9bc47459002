"""Checkpoint, exact resume, TP-size resharding and the non-finite guard for strategy ``tp``.

States are compared in canonical coordinates (``Strategy.state_dict()`` with DTensors gathered: the
dense model's parameters, REKLS factors/bases/moments with the qkv rows in ``[q; k; v]`` order), so a
state saved with one TP size can be compared with one loaded at another.

TP-REKLS at different TP sizes is not the same floating-point computation: the qkv rows are permuted
per TP size and the row-parallel all-reduce sums in another grouping, and the eigenbases of the
rank-deficient Kronecker factors amplify those 1e-16 differences (two uninterrupted float64 runs at
TP 2 and TP 4 differ by ~1e-7 in the loss after three steps). The reshard tests therefore check that
the loaded state equals the saved one bit for bit, that the first step after the load sees the
same parameters, and that what that step computes and is well defined (the new factors, their
eigenvalues, the AdamW-path parameters) matches the saved size's run; with
``tp_optimizer = "adamw"`` (no eigendecompositions) they check that training
continues like a run at the new size to 1e-10.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.optim.tp_state import full_state, qkv_perm
from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import nan_loss_at

GLOBAL_BATCH = 4


def tp_config(shard: str, world: int, *, optimizer: str = "rekls", steps: int = 4, ckpt_dir: str = "",
              every: int = 0, tp_size: int = 0, lr: float = 1e-2, eps: float = 1e-8) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 4, 8
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, GLOBAL_BATCH // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = lr, 1, 0.1, 0.5
    cfg.optim.eps = eps
    cfg.strategy.name, cfg.tp.optimizer, cfg.tp.size = "tp", optimizer, tp_size
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _snapshot(res) -> dict:
    state = full_state(res.strategy.state_dict(),
                       lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v)
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state,
            "start": res.start_step, "skipped": list(res.skipped_steps)}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


def _run_nan(cfg: Config, nan_step: int, nan_rank: int) -> dict:
    """Train with the loss made NaN on ``nan_rank`` at training step ``nan_step`` (1-based)."""
    with nan_loss_at(nan_step, nan_rank):
        return _run(cfg)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, torch.Tensor):
            assert va.shape == vb.shape and torch.equal(va, vb), k
        else:
            assert va == vb, k


def assert_close_state(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)
        else:
            assert a[k] == b[k], k


def test_qkv_perm_matches_the_strategy_layout() -> None:
    from lowband.parallel.tensor import permute_sections

    e, t = 8, 4
    rows = torch.arange(3 * e, dtype=torch.float32)[:, None].expand(3 * e, e)
    permuted = permute_sections(rows, 3, t)[:, 0].long()  # the row order shard_tp gives a 3-section qkv
    assert torch.equal(permuted, qkv_perm(e, t))  # row p of the TP layout is canonical row perm[p]
    assert torch.equal(qkv_perm(e, 1), torch.arange(3 * e))


@pytest.mark.parametrize(("world", "tp_size", "optimizer"), [(1, 0, "rekls"), (2, 0, "rekls"), (4, 2, "rekls"),
                                                           (2, 0, "adamw")])
def test_tp_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, world: int, tp_size: int,
                                             optimizer: str) -> None:
    """world 2: TP 2; world 4: TP 2 x DP 2 (REKLS factors sharded, DP gradient all-reduce)."""
    full = run_ranks(_run, world, tp_config(shard, world, tp_size=tp_size, optimizer=optimizer))
    cfg = tp_config(shard, world, tp_size=tp_size, optimizer=optimizer, ckpt_dir=str(tmp_path), every=2)
    first = run_ranks(_run, world, cfg, stop_after=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    second = run_ranks(_run, world, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same_state(second[r]["state"], full[r]["state"])
    keys = full[0]["state"]
    if optimizer == "rekls":
        assert {"optim.state.blocks.0.attn.qkv.weight.L", "optim.state.blocks.0.mlp.fc.weight.Q_R",
                "optim.state.tok_emb.weight.exp_avg", "optim.param_groups.0.lr"} <= set(keys)
        assert keys["optim.state.blocks.0.attn.qkv.weight.L"].shape == (3, 16, 48)
    else:
        assert {"optim.state.blocks.0.attn.qkv.weight.exp_avg", "optim.state.blocks.0.mlp.fc.weight.step"} <= set(keys)
    assert keys["model.blocks.0.attn.qkv.weight"].shape == (3, 16, 16)


def test_tp4_rekls_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path) -> None:
    full = run_ranks(_run, 4, tp_config(shard, 4, steps=3))
    cfg = tp_config(shard, 4, steps=3, ckpt_dir=str(tmp_path), every=2)
    run_ranks(_run, 4, cfg, stop_after=2)
    second = run_ranks(_run, 4, cfg)
    for r in range(4):
        assert second[r]["start"] == 2 and second[r]["losses"] == {3: full[r]["losses"][3]}
        assert_same_state(second[r]["state"], full[r]["state"])


@pytest.mark.parametrize(("saved_world", "new_world"), [(4, 2), (2, 4)])
def test_tp_rekls_reshards_factors_to_another_tp_size(shard: str, tmp_path: Path, saved_world: int,
                                                      new_world: int) -> None:
    kw = {"steps": 3, "lr": 1e-3, "eps": 1e-6}  # parameters stay O(1) (see the module doc)
    cfg_saved = tp_config(shard, saved_world, ckpt_dir=str(tmp_path), every=2, **kw)
    cfg_new = tp_config(shard, new_world, ckpt_dir=str(tmp_path), every=2, **kw)
    saved = run_ranks(_run, saved_world, cfg_saved, stop_after=2)
    # 1) the state loaded at the other TP size (L, R, Q_L, Q_R re-split, qkv rows re-permuted) is the saved one
    loaded = run_ranks(_run, new_world, cfg_new, stop_after=2)
    for r in range(new_world):
        assert loaded[r]["start"] == 2
        assert_same_state(loaded[r]["state"], saved[0]["state"])
    # 2) one more step at the new size, against the uninterrupted run at the saved size
    cont = run_ranks(_run, new_world, cfg_new)
    ref = run_ranks(_run, saved_world, tp_config(shard, saved_world, **kw))[0]
    for r in range(new_world):
        assert cont[r]["start"] == 2 and sorted(cont[r]["losses"]) == [3]
        # step 3's loss is computed with the loaded parameters: equal up to the forward's reduction order
        np.testing.assert_allclose(cont[r]["losses"][3], ref["losses"][3], rtol=1e-12)
        # The step-3 update used the re-split factors. What is well defined across TP sizes is compared:
        # (a) parameters on the AdamW path (embeddings, norms, lm_head): elementwise, 1e-10;
        # (b) the REKLS factors L, R after step 3: L3 = beta L2 + (1 - beta) G3 C2 G3^T with L2, C2 loaded bit
        #     for bit, so only G3's reduction order differs (relative k eps64, k <= 10^3 terms: 2.2e-13); two
        #     products and a lerp at most double it: |dL| <= 1e-12 max|L|;
        # (c) their eigenvalues, by Weyl: |d lam_i| <= ||dL||_2 <= ||dL||_F, plus eigh's backward error
        #     (d eps ||L||_F per side, d the factor's size).
        # Not compared: the REKLS-updated weights. The factors are rank-deficient; the eigenbasis inside a
        # (near-)degenerate eigenvalue cluster is not determined by the factor, and Adam's elementwise division
        # in that basis is not rotation invariant, so the update is not a continuous function of rounding.
        eps64 = torch.finfo(torch.float64).eps
        st, rs = cont[r]["state"], ref["state"]
        sharded = {k[len("optim.state."):-len(".L")] for k in rs if k.startswith("optim.state.") and k.endswith(".L")}
        assert sharded, "no REKLS-sharded parameter"
        for k, v in rs.items():
            if k.startswith("model.") and k[len("model."):] not in sharded:
                torch.testing.assert_close(st[k], v, rtol=0, atol=1e-10, msg=k)
        for name in sharded:
            for side, lam in (("L", "lam_L"), ("R", "lam_R")):
                f_ref, f_got = rs[f"optim.state.{name}.{side}"], st[f"optim.state.{name}.{side}"]
                d_f = (f_got - f_ref).abs()
                assert d_f.max() <= 1e-12 * f_ref.abs().max(), (name, side, float(d_f.max()))
                d_lam = (st[f"optim.state.{name}.{lam}"] - rs[f"optim.state.{name}.{lam}"]).abs().max()
                bound = torch.linalg.norm(f_got - f_ref) + 2 * f_ref.shape[0] * eps64 * torch.linalg.norm(f_ref)
                assert d_lam <= bound, (name, lam, float(d_lam), float(bound))


@pytest.mark.parametrize(("saved_world", "new_world"), [(4, 2), (2, 4)])
def test_tp_adamw_reshard_continues_like_a_run_at_the_new_size(shard: str, tmp_path: Path, saved_world: int,
                                                               new_world: int) -> None:
    kw = {"optimizer": "adamw", "steps": 4}
    run_ranks(_run, saved_world, tp_config(shard, saved_world, ckpt_dir=str(tmp_path), every=2, **kw), stop_after=2)
    cont = run_ranks(_run, new_world, tp_config(shard, new_world, ckpt_dir=str(tmp_path), every=2, **kw))
    ref = run_ranks(_run, new_world, tp_config(shard, new_world, **kw))
    for r in range(new_world):
        assert cont[r]["start"] == 2 and sorted(cont[r]["losses"]) == [3, 4]
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (3, 4)], [ref[r]["losses"][s] for s in (3, 4)],
                                   rtol=1e-10)
        assert_close_state(cont[r]["state"], ref[r]["state"], 1e-10)
        assert_same_state(cont[r]["state"], cont[0]["state"])


def test_tp_nonfinite_step_is_skipped_on_every_rank(shard: str, tmp_path: Path) -> None:
    """A NaN loss on rank 1 at step 3 of 3: every rank keeps the step-2 state bit for bit (TP 2 x DP 2)."""
    world = 4
    at2 = run_ranks(_run, world, tp_config(shard, world, tp_size=2, steps=3), stop_after=2)
    out = run_ranks(_run_nan, world, tp_config(shard, world, tp_size=2, steps=3), 3, 1)
    for r in range(world):
        assert out[r]["skipped"] == [3]
        assert out[r]["losses"][2] == at2[r]["losses"][2]
        lr_keys = [k for k in at2[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr")]
        assert lr_keys  # the LR schedule advances over a skipped step; everything else is untouched
        assert_same_state(*({k: v for k, v in st.items() if k not in lr_keys}
                            for st in (out[r]["state"], at2[r]["state"])))


def _bn_model(seed: int):
    """A TP model with persistent buffers (BatchNorm running stats) and a non-persistent one, its AdamW."""
    import torch.nn.functional as F
    from torch import nn

    from lowband.comm import Comm
    from lowband.parallel import shard_tp
    from lowband.plan import ModelPlan, ParallelLinear

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj = nn.Linear(6, 8, dtype=torch.float64), nn.Linear(8, 6, dtype=torch.float64)
            self.bn = nn.BatchNorm1d(6, dtype=torch.float64)
            self.register_buffer("scratch", torch.zeros(3, dtype=torch.float64), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.proj(F.gelu(self.fc(x))))

    torch.manual_seed(seed)
    m = M()
    plan = ModelPlan(parallel_linears=(ParallelLinear("fc", "column"), ParallelLinear("proj", "row")))
    shard_tp(m, plan, Comm(name="tp"))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _tp_state_buffers(path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lowband.optim.tp_state import TPStateLayout

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    m1, o1 = _bn_model(0)
    for _ in range(2):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        m1(x).square().mean().backward()
        o1.step()
        o1.zero_grad()
    m1.scratch.fill_(7.0)
    saved = TPStateLayout(m1, o1, world, 1).state_dict()
    keys = sorted(saved["model"])
    dcp.save(saved, checkpoint_id=f"{path}/new")
    old = {"model": {k: v for k, v in saved["model"].items() if not k.startswith("bn.running")
                     and k != "bn.num_batches_tracked"}, "optim": saved["optim"]}
    dcp.save(old, checkpoint_id=f"{path}/old")  # the form written before buffers were saved

    m2, o2 = _bn_model(5)
    lay = TPStateLayout(m2, o2, world, 1)
    sd = lay.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/new")
    lay.load_state_dict(sd)
    bufs = {n: (b.clone(), dict(m1.named_buffers())[n].clone()) for n, b in m2.named_buffers()}
    xe = torch.randn(4, 6, generator=g, dtype=torch.float64)
    m1.eval(), m2.eval()
    with torch.no_grad():
        fwd = (m2(xe), m1(xe))

    m3, o3 = _bn_model(5)
    fresh = {n: b.clone() for n, b in m3.named_buffers()}
    lay3 = TPStateLayout(m3, o3, world, 1)
    sd3 = lay3.state_dict()
    try:
        dcp.load(sd3, checkpoint_id=f"{path}/old")
        strict = "loaded"
    except CheckpointException as e:  # a BaseException: DCP's wrapper of every rank's error
        strict = str(e)
    sd3 = lay3.state_dict()
    saved_keys = set(dcp.FileSystemReader(f"{path}/old").read_metadata().state_dict_metadata)
    dropped = lay3.fit_template(sd3, saved_keys)
    dcp.load(sd3, checkpoint_id=f"{path}/old")
    lay3.load_state_dict(sd3)
    same_w = torch.equal(m3.fc.weight, m1.fc.weight) and torch.equal(m3.bn.weight, m1.bn.weight)
    kept = all(torch.equal(b, fresh[n]) for n, b in m3.named_buffers())
    return {"keys": keys, "bufs": bufs, "fwd": fwd, "strict": strict, "dropped": sorted(dropped),
            "old_same_w": same_w, "old_kept_buffers": kept}


def test_tp_state_layout_saves_and_loads_persistent_buffers(tmp_path: Path) -> None:
    """TPStateLayout holds the model's persistent buffers (torch state_dict semantics: the non-persistent
    ``scratch`` is left out) as replicated plain tensors, so a resumed BatchNorm has the saved running
    stats; a checkpoint written without buffer keys loads through fit_template (buffers left as they are)."""
    out = run_ranks(_tp_state_buffers, 2, str(tmp_path))
    for r in out:
        assert r["keys"] == ["bn.bias", "bn.num_batches_tracked", "bn.running_mean", "bn.running_var", "bn.weight",
                             "fc.bias", "fc.weight", "proj.bias", "proj.weight"]
        for n, (got, want) in r["bufs"].items():
            if n == "scratch":
                assert torch.equal(got, torch.zeros(3, dtype=torch.float64))  # not saved, not loaded
            else:
                assert torch.equal(got, want), n
        assert int(r["bufs"]["bn.num_batches_tracked"][0]) == 2
        torch.testing.assert_close(*r["fwd"], rtol=0, atol=0)  # same state, same arithmetic: bitwise
        assert "bn.running_mean" in r["strict"]  # a template with buffer keys stops at the old checkpoint
        assert r["dropped"] == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
        assert r["old_same_w"] and r["old_kept_buffers"]


def _group_key_override() -> str:
    """A TP chunk declared only by TpRekls' param-group key ``partition_dim`` (no placement on the tensor)."""
    import torch.distributed as dist
    from torch import nn

    from lowband.comm import Comm
    from lowband.optim.tp_rekls import TpRekls
    from lowband.optim.tp_state import TPStateLayout

    rank, t = dist.get_rank(), dist.get_world_size()
    w = nn.Parameter(torch.arange(24, dtype=torch.float64).reshape(4, 6).chunk(t, 0)[rank].clone())
    model = nn.Module()
    model.w = w
    opt = TpRekls([{"params": [w], "partition_dim": 0}], lr=1e-2, tp_comm=Comm(name="tp"))
    try:
        TPStateLayout(model, opt, tp_size=t, dp_size=1).state_dict()
    except ValueError as e:
        return str(e)
    return "no error"


def test_tp_state_layout_refuses_a_layout_declared_by_the_group_key_only() -> None:
    """The layout follows the placement: a chunk declared by the group key alone was saved as a replicated tensor
    (one rank's chunk kept, every rank loading it: silently swapped state); now refused naming the parameter."""
    out = run_ranks(_group_key_override, 2)
    assert out[0] == out[1]
    assert out[0].startswith("TPStateLayout: param_groups[0]['params'][0] (shape (2, 6)) is stepped with "
                             "partition_dim=0 (the param group's 'partition_dim' key) but its placement says "
                             "replicated"), out[0]
