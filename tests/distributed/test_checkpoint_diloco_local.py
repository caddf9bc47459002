"""DiLoCo checkpoints are rank-local: no state collective at save or load, and DCP reshards inside a replica.

``DilocoCheckpoint`` (the ``diloco`` strategy's ``state_dict``) with a sharded inner (``sharded-adamw``,
``sharded-muon``) and a GTP inner (``gtp``, AdamW and Muon), 2 replicas x 2 inner ranks, float64, saved
by hand with ``dcp.save`` after step 3 (a fragment in flight, ``delay = 1``), and loaded by hand
(``dcp.load`` into a fresh template, then ``load_state_dict``) into a run stopped after step 2 (other
values, nothing in flight) at the same layout and at 2 replicas x 1 rank (dp 2 -> 1, GTP 2 -> 1).
Checked:

* the ledger records no collective of lowband's during the save or the load (in particular no ``state``,
  ``gtp:state`` or ``diloco:state`` all-gather / broadcast); the in-flight all-reduce completes before;
* every rank's pieces are its own elements: with GTP 2 a rank holds exactly its real rows of a sharded
  weight (half of it; the per-replica rows of the model at its replica's offset), with dp 2 the two ranks
  of a replica hold disjoint parts of each AdamW moment that together make it whole, or a Muon matrix's
  momentum on its owner only;
* ``dcp_to_torch_save`` (no process group) reads the file as the whole logical tensors;
* the loaded state, made whole for comparison (``gather_chunks``, a test-only ``all_gather_object``),
  equals the saved one bit for bit (the same values are copied, no arithmetic), in-flight fragment
  included.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from lowband.optim.tp_state import full_state
from lowband.testing import run_ranks
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.test_checkpoint_diloco import assert_same_state, diloco_config, gather_chunks

STATE_TAGS = {"state", "gtp:state", "diloco:state"}


def _config(shard: str, world: int, inner: str, gtp: int, optimizer: str) -> Config:
    cfg = diloco_config(shard, world, replicas=2)
    cfg.diloco.inner, cfg.gtp.size, cfg.gtp.optimizer = inner, gtp, optimizer
    cfg.optim.muon_ns_dtype = "float64"
    return cfg


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in gather_chunks(full_state(state)).items():
        if isinstance(v, bytes):
            v = pickle.loads(v) if v else None
        out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _save_or_load(cfg: Config, path: str, save: bool, earlier: bool = False) -> dict[str, Any]:
    """``earlier``: save the ``diloco`` part in the earlier, gathered form (``StreamingDiLoCo.state_dict()``:
    no ``inflight_avg`` keys, the in-flight fragment in logical form in the blob), or load with the
    template fitted to the file's keys first (what the trainer does)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lowband.comm import default_ledger
    from lowband.dcp_chunks import LocalChunks

    res = train(cfg, write_run_dir=False, log=False, stop_after=3 if save else 2)
    st = res.strategy
    ledger = default_ledger()
    out: dict[str, Any] = {"in_flight": st.diloco.in_flight}
    st.diloco.wait_inflight()  # its all-reduce (tag diloco:frag<i>) completes here, not inside the save
    n0 = len(ledger.records)
    sd = st.state_dict()
    if save:
        if earlier:
            sd["diloco"] = st.diloco.state_dict()
        dcp.save(sd, checkpoint_id=path)
    else:
        if earlier:
            st.fit_resume_template(sd, set(FileSystemReader(path).read_metadata().state_dict_metadata))
            out["fitted_keys"] = sorted(k for k in sd["diloco"] if k.startswith("inflight_avg."))
        dcp.load(sd, checkpoint_id=path)
        st.load_state_dict(sd)
    out["records"] = [(r.op, r.tag, r.group) for r in ledger.records[n0:]]
    flat = full_state(sd)
    out["held"] = {k: [(tuple(o), tuple(t.shape)) for o, t in v.pieces] for k, v in flat.items()
                   if isinstance(v, LocalChunks)}
    out["plain_keys"] = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor)
                               and not isinstance(v, LocalChunks))
    out["state"] = _plain(st.state_dict())
    out["after_in_flight"] = st.diloco.in_flight
    st.diloco.close()
    return out


def _numel(pieces: list) -> int:
    return sum(int(torch.Size(s).numel()) for _o, s in pieces)


@pytest.mark.parametrize(("inner", "gtp", "optimizer"),
                         [("sharded-adamw", 0, "adamw"), ("sharded-muon", 0, "adamw"), ("gtp", 2, "adamw"),
                          ("gtp", 2, "muon")])
def test_diloco_checkpoint_is_rank_local_and_reshards(shard: str, tmp_path: Path, inner: str, gtp: int,
                                                      optimizer: str) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_or_load, 4, _config(shard, 4, inner, gtp, optimizer), path, True, timeout=180)
    ref = saved[0]["state"]
    assert saved[0]["in_flight"] is not None and ref["diloco.inflight"] is not None
    for r in saved:
        assert r["records"] == [], r["records"]  # no collective of lowband's at all during the save
        assert_same_state(r["state"], ref)  # the same logical state seen from every rank
        assert not [k for k in r["plain_keys"] if k.startswith(("model.", "optim.state."))]  # every row is chunks
    w = "blocks.0.mlp.fc.weight"  # [64, 16]
    for rank, r in enumerate(saved):
        replica = rank // 2
        model_rows = r["held"][f"model.{w}"]
        assert {o[0] for o, _s in model_rows} == {replica}  # this replica's row only
        if inner == "gtp":  # GTP 2: exactly this rank's 32 real rows, of every per-parameter value
            for key in (f"model.{w}", f"diloco.global.{w}", f"diloco.outer.{w}.momentum_buffer",
                        f"diloco.inflight_avg.{w}"):
                held = r["held"][key]
                assert _numel(held) == 32 * 16, key
                assert {o[-2] for o, _s in held} == {32 * (rank % 2)}, key
        elif inner == "sharded-adamw":  # dp 2: the replica's two ranks hold disjoint parts of each moment
            mine, other = r["held"][f"optim.state.{w}.exp_avg"], saved[rank ^ 1]["held"][f"optim.state.{w}.exp_avg"]
            assert 0 < _numel(mine) < 64 * 16 and _numel(mine) + _numel(other) == 64 * 16
            assert not {o for o, _s in mine} & {o for o, _s in other}
        else:  # sharded-muon, dp 2: a matrix's momentum whole on its owner, nothing on the other rank
            key = f"optim.state.{w}.momentum_buffer"
            assert sorted([_numel(r["held"][key]), _numel(saved[rank ^ 1]["held"][key])]) == [0, 64 * 16]
            assert _numel(model_rows) == 64 * 16  # whole parameters inside a replica (written once by DCP)
    # torch's own single-process tool reads the file as whole logical tensors
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
    assert f"diloco.global.{w}" in tensors and (inner != "gtp" or f"diloco.inflight_avg.{w}" in tensors)
    for k in tensors:
        top, rest = k.split(".", 1)
        assert torch.equal(whole[top][rest], ref[k]), k
    # load: the same layout (4 ranks) and one rank per replica (dp 2 -> 1, GTP 2 -> 1)
    for world in (4, 2):
        loaded = run_ranks(_save_or_load, world, _config(shard, world, inner, gtp if world == 4 else 0, optimizer),
                           path, False, timeout=180)
        for r in loaded:
            assert r["in_flight"] is None and r["after_in_flight"] == ref["diloco.inflight"][0]
            assert r["records"] == [], r["records"]
            assert_same_state(r["state"], ref)


def test_gtp_inner_async_save_snapshots_at_save_time(shard: str, tmp_path: Path) -> None:
    """The rank-local pieces are views of the live state: ``checkpoint.async_save`` stages them at save time
    (step 3, a fragment in flight), steps 4-6 train meanwhile, and resuming from step 3 equals the
    uninterrupted run bit for bit."""
    from lowband.train.checkpoint import list_checkpoints
    from tests.distributed.test_checkpoint_diloco import _run

    full = run_ranks(_run, 4, _config(shard, 4, "gtp", 2, "adamw"), timeout=180)
    cfg = _config(shard, 4, "gtp", 2, "adamw")
    cfg.checkpoint.dir, cfg.checkpoint.every = str(tmp_path), 3
    cfg.checkpoint.async_save, cfg.checkpoint.keep_last = True, 3
    run_ranks(_run, 4, cfg, timeout=180)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 6]
    cfg.checkpoint.resume, cfg.checkpoint.overwrite = str(tmp_path / "step-3"), True
    second = run_ranks(_run, 4, cfg, timeout=180)
    for r in range(4):
        assert second[r]["start"] == 3
        assert second[r]["losses"] == {k: v for k, v in full[r]["losses"].items() if k > 3}
        assert_same_state(second[r]["state"], full[r]["state"])


def test_gtp_inner_file_of_the_earlier_gathered_format_still_loads(shard: str, tmp_path: Path) -> None:
    """A file whose DiLoCo part is the gathered form (how checkpoints with a GTP inner and a fragment in
    flight were written before the rank-local layout: no ``inflight_avg`` keys) loads bit for bit once the
    template is fitted to the file's keys, at the same layout and at GTP 2 -> 1."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_or_load, 4, _config(shard, 4, "gtp", 2, "adamw"), path, True, True, timeout=180)
    ref = saved[0]["state"]
    assert ref["diloco.inflight"] is not None
    for world, gtp in ((4, 2), (2, 0)):
        loaded = run_ranks(_save_or_load, world, _config(shard, world, "gtp", gtp, "adamw"), path, False, True,
                           timeout=180)
        for r in loaded:
            assert r["fitted_keys"] == []  # the template's inflight_avg keys were dropped
            assert r["after_in_flight"] == ref["diloco.inflight"][0]
            assert_same_state(r["state"], ref)
