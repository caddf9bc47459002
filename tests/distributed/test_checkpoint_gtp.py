"""Checkpoint, exact resume, resharding (4->2) and the non-finite guard for strategy ``gtp``.

GTP saves its state in logical (unpadded) shapes under the ``single``/``ddp`` keys (format
``replicated``; see ``GTPStrategy.state_dict``), each rank writing the real rows of its shards only
(rank-local chunks); ``tests/distributed/test_gtp.py`` covers 2->4 and GTP->DDP. Here: stop/resume bit
for bit at GTP 2, GTP 4 and GTP 2 x DP 2 (vocabulary rows not a multiple of the GTP size, so shards are
tail-padded), 4->2 resharding, and a skipped non-finite step; then ``GTPStateLayout`` /
``GTPMuonStateLayout`` by hand: saved on 2 GTP ranks and loaded on 4 and 1, saved on 4 and loaded on 2,
bitwise, with no state collective, and files of the earlier gathered format loading bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lowband.testing import run_ranks
from lowband.train.checkpoint import list_checkpoints
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.trainer_util import nan_loss_at

GLOBAL_BATCH = 4


def gtp_config(shard: str, world: int, *, steps: int = 4, ckpt_dir: str = "", every: int = 0,
               gtp_size: int = 0) -> Config:
    cfg = Config()
    cfg.run.world_size, cfg.run.steps, cfg.run.dtype = world, steps, "float64"
    cfg.run.val_every, cfg.run.val_batches, cfg.run.log_every, cfg.run.threads = 0, 1, 1, 1
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 16, 2, 8
    cfg.model.vocab_size = 258  # not a multiple of 4: padded shards
    cfg.data.source, cfg.data.train_bin, cfg.data.batch_size = "bin", shard, GLOBAL_BATCH // world
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 1, 0.1, 0.5
    cfg.strategy.name, cfg.gtp.size = "gtp", gtp_size
    cfg.checkpoint.dir, cfg.checkpoint.every = ckpt_dir, every
    return cfg


def _snapshot(res) -> dict:
    sd = res.strategy.logical_state_dict()  # whole logical tensors (gathered), the saved keys
    state = {f"{top}.{k}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
             for top, sub in sd.items() for k, v in sub.items()}
    local = {n: p.detach().clone() for n, p in res.strategy.model.named_parameters()}  # padded shards
    return {"losses": {r["step"]: r["loss"] for r in res.rows if "loss" in r}, "state": state, "local": local,
            "start": res.start_step, "skipped": list(res.skipped_steps)}


def _run(cfg: Config, stop_after: int | None = None) -> dict:
    return _snapshot(train(cfg, write_run_dir=False, log=False, stop_after=stop_after))


def _run_nan(cfg: Config, nan_step: int, nan_rank: int) -> dict:
    with nan_loss_at(nan_step, nan_rank):
        return _run(cfg)


def assert_same(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k in skip:
            continue
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize(("world", "gtp_size"), [(1, 0), (2, 0), (4, 0), (4, 2)])
def test_gtp_stop_and_resume_is_bitwise_exact(shard: str, tmp_path: Path, world: int, gtp_size: int) -> None:
    full = run_ranks(_run, world, gtp_config(shard, world, gtp_size=gtp_size))
    cfg = gtp_config(shard, world, gtp_size=gtp_size, ckpt_dir=str(tmp_path), every=2)
    first = run_ranks(_run, world, cfg, stop_after=2)
    second = run_ranks(_run, world, cfg)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 4]
    for r in range(world):
        assert first[r]["start"] == 0 and second[r]["start"] == 2
        assert {**first[r]["losses"], **second[r]["losses"]} == full[r]["losses"]  # exact
        assert_same(second[r]["state"], full[r]["state"])
        assert_same(second[r]["local"], full[r]["local"])  # padded shards too (padding rows stay zero)


def test_gtp_reshard_4_to_2_loads_and_continues(shard: str, tmp_path: Path) -> None:
    saved = run_ranks(_run, 4, gtp_config(shard, 4, ckpt_dir=str(tmp_path), every=2), stop_after=2)
    cfg_new = gtp_config(shard, 2, ckpt_dir=str(tmp_path), every=2)
    loaded = run_ranks(_run, 2, cfg_new, stop_after=2)
    for r in range(2):
        assert loaded[r]["start"] == 2
        assert_same(loaded[r]["state"], saved[0]["state"])
    cont = run_ranks(_run, 2, cfg_new)
    ref = run_ranks(_run, 2, gtp_config(shard, 2))
    for r in range(2):
        np.testing.assert_allclose([cont[r]["losses"][s] for s in (3, 4)], [ref[r]["losses"][s] for s in (3, 4)],
                                   rtol=1e-10)
        for k, v in ref[r]["state"].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(cont[r]["state"][k], v, rtol=1e-10, atol=1e-10, msg=k)


def test_gtp_nonfinite_step_is_skipped_on_every_rank(shard: str) -> None:
    world = 4
    at2 = run_ranks(_run, world, gtp_config(shard, world, steps=3, gtp_size=2), stop_after=2)
    out = run_ranks(_run_nan, world, gtp_config(shard, world, steps=3, gtp_size=2), 3, 3)
    for r in range(world):
        assert out[r]["skipped"] == [3]
        lr_keys = tuple(k for k in at2[r]["state"] if k.startswith("optim.param_groups.") and k.endswith(".lr"))
        assert lr_keys
        assert_same(out[r]["state"], at2[r]["state"], skip=lr_keys)
        assert_same(out[r]["local"], at2[r]["local"])


# ------------------------------------------------------------------- rank-local rows, no gather
class _Tiny(nn.Module):
    """GTP linears ``a [5, 6]``, ``b [7, 5]``, ``c [3, 7]``: no row count divisible by 2 or 4, so shards are
    tail-padded; at GTP 4, rank 3 holds only padding rows of ``a`` and ``c``. The LayerNorm and the biases
    stay replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln, self.b, self.c = nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.ln(self.a(x))))))


def _tiny_layout(seed: int, algo: str) -> tuple[nn.Module, Any, Any, Any]:
    """``_Tiny`` (float64, from ``seed``) sharded over a GTP group of the whole world, with torch AdamW
    (``algo="adamw"``) or GTPMuon (``"muon"``: ``a`` and ``b`` Muon, the rest AdamW), and its layout."""
    import torch.distributed as dist

    from lowband.optim.gtp_muon import GTPMuon
    from lowband.optim.gtp_muon_state import GTPMuonStateLayout
    from lowband.parallel.gtp import GTPRuntime, shard_linears
    from lowband.parallel.gtp_state import GTPStateLayout
    from lowband.parallel.mesh import build_mesh

    torch.manual_seed(seed)
    model = _Tiny().double()
    mesh = build_mesh(gtp=dist.get_world_size())
    rt = GTPRuntime(mesh.gtp)
    shard_linears(model, rt)
    if algo == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return model, rt, opt, GTPStateLayout(model, opt)
    muon = [model.a.weight, model.b.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in muon)]
    opt = GTPMuon([{"params": muon, "algorithm": "muon", "lr": 0.05, "weight_decay": 0.1},
                   {"params": rest, "algorithm": "adamw"}], mesh.gtp, lr=1e-2, ns_dtype=torch.float64)
    return model, rt, opt, GTPMuonStateLayout(model, opt)


def _plain(sd: dict) -> dict:
    return {f"{top}.{k}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for top, sub in sd.items() for k, v in sub.items()}


def _gtp_save_or_load(algo: str, path: str, save: bool, old_format: bool = False) -> dict:
    """Train 3 steps and save (``save``; with ``old_format`` the gathered ``logical_state_dict()``, the
    format of earlier versions), or load into a fresh model and optimizer built from another seed; the
    ledger records of the save or the load alone, the gathered logical state, and the padded shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from lowband.comm import default_ledger
    from lowband.dcp_chunks import LocalChunks
    from lowband.parallel.gtp import sync_replicated_grads
    from lowband.sharding import placement_of

    rank = dist.get_rank()
    model, rt, opt, layout = _tiny_layout(0 if save else 1, algo)
    ledger = default_ledger()
    out: dict[str, Any] = {}
    if save:
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            model(torch.randn(4, 6, generator=g, dtype=torch.float64)).square().sum().backward()
            sync_replicated_grads(rt, model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["logical"] = _plain(layout.logical_state_dict())
        if old_format:
            dcp.save(layout.logical_state_dict(), checkpoint_id=path)
            return out
        n0 = len(ledger.records)
        sd = layout.state_dict()
        out["pieces"] = {f"{top}.{k}": [(o, tuple(t.shape)) for o, t in v.pieces]
                         for top, sub in sd.items() for k, v in sub.items() if isinstance(v, LocalChunks)}
        dcp.save(sd, checkpoint_id=path)
    else:
        n0 = len(ledger.records)
        sd = layout.state_dict()
        dcp.load(sd, checkpoint_id=path)
        layout.load_state_dict(sd)
    out["records"] = [(r.op, r.tag) for r in ledger.records[n0:]]
    if not save:
        out["logical"] = _plain(layout.logical_state_dict())
        pads = []
        for p in model.parameters():
            if hasattr(p, "gtp"):
                cut = placement_of(p).split("gtp")  # real rows: the shard's rows short of the padded length
                real = max(0, min(p.shape[0], p.gtp.out_features - cut.rank * p.shape[0]))
                pads.append(p.detach()[real:])
                pads += [t[real:] for t in opt.state[p].values() if isinstance(t, torch.Tensor)
                         and t.shape == p.shape]
        out["pads_zero"] = all(not t.any() for t in pads)
    return out


def _assert_same_logical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


@pytest.mark.parametrize("algo", ["adamw", "muon"])
@pytest.mark.parametrize(("saved_world", "loads"), [(2, (4, 1)), (4, (2,))])
def test_gtp_layout_saves_and_loads_rank_local_rows(tmp_path: Path, algo: str, saved_world: int,
                                                    loads: tuple[int, ...]) -> None:
    """GTPStateLayout (torch AdamW) / GTPMuonStateLayout: each rank saves the real rows of its shards only
    (a rank of padding rows saves nothing), and a load at another GTP size gives, bitwise, the gathered
    logical state of the run that saved; padding rows stay zero; neither the save nor the load issues a
    ``gtp:state`` collective."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_gtp_save_or_load, saved_world, algo, path, True)
    ref = saved[0]["logical"]
    for r in saved:
        assert [x for x in r["records"] if x[1] == "gtp:state"] == []
        assert r["records"] == []  # no collective of lowband's at all
        _assert_same_logical(r["logical"], ref)
    assert any(k.startswith("optim.state.c.weight.exp_avg") for k in saved[0]["pieces"])
    if saved_world == 4:  # a [5, 6]: shard_rows 2, rank 2 holds row 4 only, rank 3 padding only
        assert saved[2]["pieces"]["model.a.weight"] == [((4, 0), (1, 6))]
        assert saved[3]["pieces"]["model.a.weight"] == []
    if algo == "muon":  # a GTP Muon momentum: whole, on its owner only
        held = [r["pieces"]["optim.state.a.weight.momentum_buffer"] for r in saved]
        assert sorted(map(len, held)) == [0] * (saved_world - 1) + [1]
    for world in loads:
        for r in run_ranks(_gtp_save_or_load, world, algo, path, False):
            assert [x for x in r["records"] if x[1] == "gtp:state"] == []
            assert r["records"] == []
            assert r["pads_zero"]
            _assert_same_logical(r["logical"], ref)


@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_gtp_layout_loads_the_gathered_format(tmp_path: Path, algo: str) -> None:
    """A file of the earlier gathered format (plain logical tensors: ``dcp.save(logical_state_dict())``)
    saved on 2 GTP ranks loads into the rank-local layout on 4 ranks, bitwise."""
    path = str(tmp_path / "old")
    ref = run_ranks(_gtp_save_or_load, 2, algo, path, True, True)[0]["logical"]
    for r in run_ranks(_gtp_save_or_load, 4, algo, path, False):
        assert r["records"] == []
        _assert_same_logical(r["logical"], ref)

