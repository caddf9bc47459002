"""Checkpoint, exact resume, resharding and the non-finite guard for ``sharded-adamw`` / ``sharded-muon``.

States are compared as the checkpoint holds them (``Strategy.state_dict()`` with the ``Shard(0)``
DTensors gathered: full parameters, per-parameter moments / momentum, hyperparameters), so states at
different world sizes are comparable. Float64 with Muon's Newton-Schulz in float64, so that a run at
another world size (another reduce-scatter summation order) agrees to 1e-10.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lowband.optim.tp_state import full_state
from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import nan_loss_at, resume_error

GLOBAL_BATCH = 4


def sharded_config(shard: str, world: int, strategy: str, *, steps: int = 4, ckpt_dir: str = "",
                   every: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 2, 8
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, GLOBAL_BATCH // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 1, 0.1, 0.5
    cfg.optim.muon_ns_dtype = "float64"
    cfg.strategy.name, cfg.strategy.bucket_mb = strategy, 0.002  # several buckets, boundaries inside params
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _snapshot(res) -> dict:
    state = full_state(res.strategy.logical_state_dict(),  # whole tensors (gathered), the saved keys
                       lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v)
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state,
            "start": res.start_step, "skipped": list(res.skipped_steps)}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


def _run_nan(cfg: Config, nan_step: int, nan_rank: int) -> dict:
    """Train with the loss made NaN on ``nan_rank`` at training step ``nan_step`` (1-based)."""
    with nan_loss_at(nan_step, nan_rank):
        return _run(cfg)


def assert_same_state(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k in skip:
            continue
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize(("strategy", "world", "sparse"), [("sharded-adamw", 1, ()), ("sharded-adamw", 2, ()),
                                                           ("sharded-adamw", 4, ()), ("sharded-muon", 2, ()),
                                                           ("sharded-muon", 4, ()), ("sharded-adamw", 2, ("tok_emb",))])
def test_sharded_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, strategy: str, world: int,
                                                  sparse: tuple[str, ...]) -> None:
    """The last case sends the token embedding's gradient row-sparse (its AdamW state is an ordinary unit)."""
    base = sharded_config(shard, world, strategy)
    base.sparse.tables = list(sparse)
    full = run_ranks(_run, world, base)
    cfg = sharded_config(shard, world, strategy, ckpt_dir=str(tmp_path), every=2)
    cfg.sparse.tables = list(sparse)
    first = run_ranks(_run, world, cfg, stop_after=2)
    second = run_ranks(_run, world, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same_state(second[r]["state"], full[r]["state"])
    keys = set(full[0]["state"])
    if strategy == "sharded-adamw":
        assert {"optim.state.tok_emb.weight.exp_avg", "optim.state.blocks.0.mlp.fc.weight.step"} <= keys
    else:
        assert {"optim.state.blocks.0.mlp.fc.weight.momentum_buffer", "optim.state.tok_emb.weight.exp_avg"} <= keys


def test_sharded_async_save_snapshots_at_save_time(shard: str, tmp_path: Path) -> None:
    """Async save of rank-local chunks (views of the live optimizer state and parameters): step-2 is staged
    at save time and written while steps 3-4 train; resuming from it equals the uninterrupted run."""
    world = 2
    full = run_ranks(_run, world, sharded_config(shard, world, "sharded-adamw"))
    cfg = sharded_config(shard, world, "sharded-adamw", ckpt_dir=str(tmp_path), every=2)
    cfg.checkpoint.async_save, cfg.checkpoint.keep_last = True, 3
    run_ranks(_run, world, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    cfg.checkpoint.resume, cfg.checkpoint.overwrite = str(tmp_path / "step-2"), True
    second = run_ranks(_run, world, cfg)
    for r in range(world):
        assert second[r]["start"] == 2
        assert second[r]["losses"] == {k: v for k, v in full[r]["losses"].items() if k > 2}
        assert_same_state(second[r]["state"], full[r]["state"])


@pytest.mark.parametrize(("strategy", "saved_world", "new_world"),
                         [("sharded-adamw", 4, 2), ("sharded-adamw", 2, 4), ("sharded-muon", 4, 2),
                          ("sharded-muon", 2, 4)])
def test_sharded_reshard_loads_and_continues(shard: str, tmp_path: Path, strategy: str, saved_world: int,
                                             new_world: int) -> None:
    saved = run_ranks(_run, saved_world, sharded_config(shard, saved_world, strategy, ckpt_dir=str(tmp_path),
                                                        every=2), stop_after=2)
    cfg_new = sharded_config(shard, new_world, strategy, ckpt_dir=str(tmp_path), every=2)
    loaded = run_ranks(_run, new_world, cfg_new, stop_after=2)  # loads, takes no step
    for r in range(new_world):
        assert loaded[r]["start"] == 2
        assert_same_state(loaded[r]["state"], saved[0]["state"])  # every byte of the moments re-split
    cont = run_ranks(_run, new_world, cfg_new)
    ref = run_ranks(_run, new_world, sharded_config(shard, new_world, strategy))
    for r in range(new_world):
        assert sorted(cont[r]["losses"]) == [3, 4]
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (3, 4)], [ref[r]["losses"][s] for s in (3, 4)],
                                   rtol=1e-10)
        for k, v in ref[r]["state"].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(cont[r]["state"][k], v, rtol=1e-10, atol=1e-10, msg=k)
            else:
                assert cont[r]["state"][k] == v, k


@pytest.mark.parametrize("strategy", ["sharded-adamw", "sharded-muon"])
def test_sharded_nonfinite_step_is_skipped_on_every_rank(shard: str, strategy: str) -> None:
    """A NaN loss on rank 2 at step 3 of 3: every rank keeps the step-2 state bit for bit."""
    world = 4
    at2 = run_ranks(_run, world, sharded_config(shard, world, strategy, steps=3), stop_after=2)
    out = run_ranks(_run_nan, world, sharded_config(shard, world, strategy, steps=3), 3, 2)
    for r in range(world):
        assert out[r]["skipped"] == [3]
        lr_keys = tuple(k for k in at2[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr"))
        assert lr_keys  # the LR schedule advances over a skipped step; nothing else changes
        assert_same_state(out[r]["state"], at2[r]["state"], skip=lr_keys)


@pytest.mark.parametrize(("strategy", "dtype"), [("sharded-adamw", "float32"), ("sharded-muon", "float32"),
                                               ("sharded-adamw", "bfloat16")])
def test_sharded_fp32_masters_resume_bitwise(shard: str, tmp_path: Path, strategy: str, dtype: str) -> None:
    """bf16 parameter all-gathers (float32 params) or bf16 params: the owners' fp32 masters are saved too."""
    world = 2

    def config(**kw) -> Config:
        cfg = sharded_config(shard, world, strategy, **kw)
        cfg.run.dtype, cfg.sharded.param_wire_dtype = dtype, "bfloat16"
        cfg.optim.muon_ns_dtype = "float32"
        return cfg

    full = run_ranks(_run, world, config())
    first = run_ranks(_run, world, config(ckpt_dir=str(tmp_path), every=2), stop_after=2)
    second = run_ranks(_run, world, config(ckpt_dir=str(tmp_path), every=2))
    for r in range(world):
        assert second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]
        assert_same_state(second[r]["state"], full[r]["state"])
    assert any(k.endswith(".master") for k in full[0]["state"])


# ------------------------------------------------------------------- rank-local chunks, no gather
class _Net(torch.nn.Module):
    """fp32 ``w [13, 7]`` / ``cube [3, 4, 5]`` / ``b [13]``, bf16 ``wb [9, 5]`` / ``bb [9]`` (fp32 masters),
    Muon-shaped ``m0..m4 [6, 4]`` and ``n0..n2 [4, 6]``, a parameter used only at the first step (its step
    count differs) and one never used (step 0). Built from ``seed``, identically on every rank."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))

        self.w, self.cube, self.b = p(13, 7), p(3, 4, 5), p(13)
        self.wb, self.bb = p(9, 5, dtype=torch.bfloat16), p(9, dtype=torch.bfloat16)
        self.m = torch.nn.ParameterList([p(6, 4) for _ in range(5)])
        self.n = torch.nn.ParameterList([p(4, 6) for _ in range(3)])
        self.first_only, self.unused = p(7), p(3)

    def loss(self, step: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + rank)
        total = torch.zeros(())
        for name, q in self.named_parameters():
            if name == "unused" or (name == "first_only" and step > 0):
                continue
            c = torch.randn(q.shape, generator=g)
            total = total + (q.float() * c).sum() + 0.1 * (q.float() ** 2 * c.abs()).sum()
        return total


def _chunk_opt(model: _Net, algo: str) -> Any:
    from lowband.optim import ShardedAdamW, ShardedMuon

    if algo == "adamw":  # ~30 floats per bucket: owner ranges and buckets cut through w and cube
        return ShardedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                            bucket_mb=120 / 2**20)
    muon = list(model.m) + list(model.n)
    ids = {id(q) for q in muon}
    return ShardedMuon(muon, [q for q in model.parameters() if id(q) not in ids], lr=0.03, ns_dtype=torch.float32,
                       adamw_lr=1e-2, weight_decay=0.05, bucket_mb=200 / 2**20, param_wire_dtype=torch.bfloat16)


def _full(model: _Net, opt: Any) -> dict:
    return {"params": {n: q.detach().clone() for n, q in model.named_parameters()},
            "opt": opt.full_state_dict()}


def _old_format(layout: Any) -> dict:
    """The dict ShardedStateLayout saved before rank-local chunks: parameter copies, and the optimizer's
    ``state_dict()`` (gathered, then each rank's ``torch.chunk`` rows as ``Shard(0)`` DTensors) under flat keys."""
    from lowband.optim.sharded_state import group_hyperparams

    osd = layout.optimizer.state_dict()
    optim = {f"state.{layout.names[i]}.{k}": v for i, st in osd["state"].items() for k, v in st.items()}
    optim.update(group_hyperparams(osd["param_groups"]))
    return {"model": {n: q.detach().clone() for n, q in layout.model.named_parameters()}, "optim": optim}


def _chunk_save_or_load(algo: str, path: str, save: bool, old_format: bool = False) -> dict:
    """Train 3 steps and save (``save``; in the gathered ``Shard(0)`` format of earlier versions with
    ``old_format``), or load into a fresh optimizer built from another seed; the ledger records of the save
    or the load alone, and the whole state around it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from lowband.comm import default_ledger
    from lowband.dcp_chunks import LocalChunks
    from lowband.optim import ShardedStateLayout

    rank = dist.get_rank()
    model = _Net(0 if save else 1)
    opt = _chunk_opt(model, algo)
    layout = ShardedStateLayout(model, opt)
    ledger = default_ledger()
    out: dict[str, Any] = {}
    if save:
        for step in range(3):
            model.loss(step, rank).backward()
            opt.step()
            opt.zero_grad()
        out["full"] = _full(model, opt)
        out["cut_rows"] = [(u.kind, m.shape, (lo - m.offset) % m.shape[-1])
                           for u in opt.units for lo in [u.owner_range(rank)[0]] for m in u.members
                           if m.offset < lo < m.offset + m.numel]
        if old_format:
            dcp.save(_old_format(layout), checkpoint_id=path)
            return out
        n0 = len(ledger.records)
        sd = layout.state_dict()
        out["chunk_keys"] = sorted(k for k, v in sd["optim"].items() if isinstance(v, LocalChunks))
        dcp.save(sd, checkpoint_id=path)
    else:
        n0 = len(ledger.records)
        sd = layout.state_dict()
        dcp.load(sd, checkpoint_id=path)
        layout.load_state_dict(sd)
    out["records"] = [(r.op, r.tag, r.numel) for r in ledger.records[n0:]]
    if not save:
        out["full"] = _full(model, opt)
    return out


def _assert_same_full(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k, v in a["params"].items():
        assert v.dtype == b["params"][k].dtype and torch.equal(v, b["params"][k]), k
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k, v in sa[i].items():
            assert v.dtype == sb[i][k].dtype and torch.equal(v, sb[i][k]), (i, k)
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]


@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_sharded_layout_saves_and_loads_rank_local_chunks(tmp_path: Path, algo: str) -> None:
    """ShardedStateLayout: saved from 2 ranks, loaded on 4 and on 1; saved from 4, loaded on 2. The loaded
    optimizer's full state (per-member steps, moments / momentum, fp32 masters) and parameters are bitwise
    those of the run that saved, and neither the save nor the load moves optimizer state over the wire
    (no ``tag="state"`` collective; none of lowband's at all)."""
    for saved_world, loads in ((2, (4, 1)), (4, (2,))):
        path = str(tmp_path / f"{algo}-{saved_world}")
        saved = run_ranks(_chunk_save_or_load, saved_world, algo, path, True)
        assert all(r["records"] == [] for r in saved)
        ref = saved[0]["full"]
        for r in saved:
            _assert_same_full(r["full"], ref)
        steps = {i: float(st["step"]) for i, st in ref["opt"]["state"].items() if "step" in st}
        assert {1.0, 3.0} <= set(steps.values())  # per-member steps (first_only stepped once)
        assert any(k.endswith(".master") for k in saved[0]["chunk_keys"])
        if algo == "adamw":
            assert any(kind == "adamw" and len(shape) >= 2 and cut for r in saved for kind, shape, cut in r["cut_rows"])
        else:
            assert any(k.endswith(".momentum_buffer") for k in saved[0]["chunk_keys"])
        for world in loads:
            loaded = run_ranks(_chunk_save_or_load, world, algo, path, False)
            for r in loaded:
                assert [x for x in r["records"] if x[1] == "state"] == []
                assert r["records"] == []
                _assert_same_full(r["full"], ref)


@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_sharded_layout_loads_the_gathered_shard0_format(tmp_path: Path, algo: str) -> None:
    """A checkpoint written by the earlier layout (per-parameter ``Shard(0)`` DTensors of the gathered state)
    on 2 ranks loads into the rank-local layout on 4 ranks and on 1, bitwise."""
    path = str(tmp_path / "old")
    ref = run_ranks(_chunk_save_or_load, 2, algo, path, True, True)[0]["full"]
    for world in (4, 1):
        for r in run_ranks(_chunk_save_or_load, world, algo, path, False):
            assert r["records"] == []
            _assert_same_full(r["full"], ref)


def test_another_param_wire_dtype_is_refused_by_name(shard: str, tmp_path: Path) -> None:
    """sharded.param_wire_dtype decides whether the checkpoint holds fp32 masters: resuming a bf16-gather
    checkpoint with an fp32 gather dropped them silently (training went on from the bf16-rounded parameters,
    3.8e-3 from the masters), the other way failed with DCP's 'Missing key'. Refused before loading, by name."""
    cfg = sharded_config(shard, 2, "sharded-adamw", steps=2, ckpt_dir=str(tmp_path), every=2)
    cfg.run.dtype, cfg.sharded.param_wire_dtype = "float32", "bfloat16"
    run_ranks(_run, 2, cfg)
    cfg.run.steps, cfg.sharded.param_wire_dtype = 4, "float32"
    out = run_ranks(resume_error, 2, cfg)
    assert out[0] == out[1]
    assert "does not match this run: sharded.param_wire_dtype: checkpoint 'bfloat16', this run 'float32'" in out[0], \
        out[0]


def _muon_groups(cfg: Config) -> list[tuple]:
    res = train(cfg, write_run_dir=False, log=False)
    return [(g["algorithm"], g.get("ns_method"), g.get("ns_dtype")) for g in res.strategy.optimizer.param_groups]


def test_a_resume_orthogonalizes_with_its_own_muon_settings(shard: str, tmp_path: Path) -> None:
    """The checkpoint's param groups hold Muon's ns_method / ns_dtype, and loading them brought the checkpoint's
    back silently (a resume asking for polar_express kept ns5, bitwise the old run). The config's apply, as for
    the lr and the other optimizer settings."""
    cfg = sharded_config(shard, 2, "sharded-muon", steps=2, ckpt_dir=str(tmp_path), every=2)
    cfg.optim.muon_ns_method = "ns5"
    run_ranks(_run, 2, cfg)
    cfg.run.steps, cfg.optim.muon_ns_method = 4, "polar_express"
    out = run_ranks(_muon_groups, 2, cfg)
    assert out[0] == out[1]
    assert ("muon", "polar_express", torch.float64) in out[0], out[0]
