"""Where a StreamingDiLoCo replica's weights come from, from a user's own script: weights loaded after it was built
(pretrained, or a model-only resume), a model loaded before it was built and then overwritten by init_sync, one
rank's saved state loaded on every replica, a parameter frozen mid-run. Each was silently wrong before (the
global copies, residuals or outer momentum no longer matched the weights); each is now refused by name, and the
documented orders resume bit for bit."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm
from lowband.diloco import StreamingDiLoCo
from lowband.testing import run_ranks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))


def _step(model: nn.Module, opt: torch.optim.Optimizer, replica: int, step: int, io: tuple[int, int] = (3, 2)) -> None:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(5, io[0], generator=g, dtype=torch.float64)
    y = torch.randn(5, io[1], generator=g, dtype=torch.float64)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------------------------------- one process
def _built() -> tuple[nn.Module, torch.optim.Optimizer, StreamingDiLoCo]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, StreamingDiLoCo(model, opt, sync_every=2)


def test_model_loaded_after_building_is_refused_at_the_next_step() -> None:
    """Pretrained weights loaded after StreamingDiLoCo was built: the global copies are the built weights, so the
    first sync applied (pretrained - built) as a pseudo-gradient; now the next inner step raises."""
    model, opt, dl = _built()
    model.load_state_dict(_model(seed=1).state_dict())
    with pytest.raises(ValueError, match=r"model.load_state_dict\(\) was called after StreamingDiLoCo was built, "
                                         r"but DiLoCo's own state was not loaded"):
        _step(model, opt, 0, 0)
    dl.close()


def test_an_in_place_load_before_the_first_step_is_refused() -> None:
    """dcp.load into model.state_dict() writes in place (no load_state_dict call): seen by the version counters."""
    model, opt, dl = _built()
    with torch.no_grad():
        for p, q in zip(model.parameters(), _model(seed=1).parameters(), strict=True):
            p.copy_(q)
    with dl.paused():  # a paused zero-lr step after the write (torch's get_state_dict) does not hide it
        opt.step()
    with pytest.raises(ValueError, match=r"the weights were written in place \(dcp.load, copy_\) after "
                                         "StreamingDiLoCo was built"):
        _step(model, opt, 0, 0)
    dl.close()


def test_a_model_only_reload_mid_run_is_refused() -> None:
    model, opt, dl = _built()
    for s in range(3):
        _step(model, opt, 0, s)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 0, 3)
    model.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"model.load_state_dict\(\) was called after StreamingDiLoCo was built"):
        _step(model, opt, 0, 4)
    dl.close()


def test_resume_after_building_in_either_order_matches_the_uninterrupted_run() -> None:
    """The documented resume (build, then load the model and DiLoCo's state, in either order) is not refused and
    continues bit for bit; so does an in-place write with the state loaded."""
    def run(stop: int | None, order: str = "") -> tuple[torch.Tensor, dict]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        dl = StreamingDiLoCo(model, opt, sync_every=4, fragments=2, delay=1)
        for s in range(stop if stop is not None else 11):
            _step(model, opt, 0, s)
        if stop is None:
            return _flat(model), {}
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "dl": dl.state_dict()}, buf)
        dl.close()
        return _flat(model), {"blob": buf.getvalue()}

    want, _ = run(None)
    _, saved = run(7)
    for order in ("model-first", "state-first", "in-place"):
        st = torch.load(io.BytesIO(saved["blob"]), weights_only=False)
        model = _model(seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        dl = StreamingDiLoCo(model, opt, sync_every=4, fragments=2, delay=1)
        if order == "state-first":
            dl.load_state_dict(st["dl"])
        if order == "in-place":
            with torch.no_grad():
                for (_, p), v in zip(model.named_parameters(), st["model"].values(), strict=True):
                    p.copy_(v)
        else:
            model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        if order != "state-first":
            dl.load_state_dict(st["dl"])
        for s in range(7, 11):
            _step(model, opt, 0, s)
        assert torch.equal(_flat(model), want), order
        dl.close()


def test_a_fragment_parameter_frozen_mid_run_is_refused() -> None:
    """Outer momentum kept moving a parameter frozen after DiLoCo was built (torch leaves a frozen weight alone);
    now the next prepare refuses it by name, and a freeze between a prepare and its sync is refused at the sync."""
    for delay, freeze_at in ((0, 2), (1, 3)):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dl = StreamingDiLoCo(model, opt, sync_every=4, fragments=2, delay=delay)
        for s in range(freeze_at):
            _step(model, opt, 0, s)
        model[0].weight.requires_grad_(False)
        before = model[0].weight.detach().clone()
        with pytest.raises(ValueError, match=r"diloco: \['0.weight'\] was frozen \(requires_grad=False\) after "
                                             "StreamingDiLoCo was built"):
            for s in range(freeze_at, freeze_at + 4):
                _step(model, opt, 0, s)
        assert torch.equal(model[0].weight, before)
        dl.close()


# ---------------------------------------------------------------------------------------- two replicas
def _resume_worker(mode: str, path: str, wire: str = "topk-int2") -> object:
    """Replica r trains 6 steps on its own data (H=4: one fragment synced, the other in progress), saves; then a
    fresh process resumes in ``mode`` and trains to step 10; returns the weights (or the error)."""
    rank = dist.get_rank()
    codec = dict(topk_chunk=4, topk_k=2, block_size=4) if wire != "fp32" else {}

    def build(model: nn.Module, init_sync: bool | str = True) -> tuple[torch.optim.Optimizer, StreamingDiLoCo]:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        dl = StreamingDiLoCo(model, opt, comm=Comm(name="replica"), sync_every=4, fragments=2, wire=wire,
                             init_sync=init_sync, **codec)
        return opt, dl

    model = _model(seed=rank)  # seeded per rank, nanoGPT style: init_sync makes the replicas equal
    opt, dl = build(model)
    for s in range(6):
        _step(model, opt, rank, s)
    own = f"{path}.{rank}"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "dl": dl.state_dict()}, own)
    if mode == "uninterrupted":
        for s in range(6, 10):
            _step(model, opt, rank, s)
        dl.close()
        return _flat(model)
    dl.close()
    dist.barrier()
    st = torch.load(f"{path}.0" if mode.startswith("rank0-file") else own, weights_only=False)
    if mode == "rank0-file-old-key":  # a file of the previous version: the owner row was named for the residuals
        st["dl"]["residual_owner"] = st["dl"].pop("saved_by_replica")
    model = _model(seed=rank)
    try:
        if mode in ("load-before-build", "load-before-build-no-init-sync"):
            model.load_state_dict(st["model"])
            opt, dl = build(model, init_sync=mode == "load-before-build")
        else:
            opt, dl = build(model)
            rank0 = torch.load(f"{path}.0", weights_only=False) if mode == "rank0-model" else st
            model.load_state_dict(rank0["model"])
        opt.load_state_dict(st["opt"])
        dl.load_state_dict(st["dl"])
        if mode == "rank0-model":  # replica 1 refuses at its first step; replica 0 would then wait for it at a sync
            if rank == 1:
                _step(model, opt, rank, 6)
            dl.close()
            return "stepped"
        if mode.startswith("rank0-file"):  # replica 1 refused the load: train no further (it would wait for replica 1)
            dl.close()
            return "loaded"
        for s in range(6, 10):
            _step(model, opt, rank, s)
    except ValueError as e:
        return str(e)
    dl.close()
    return _flat(model)


@pytest.mark.parametrize(("mode", "wire"), [("load-before-build", "topk-int2"), ("rank0-file", "topk-int2"),
                                           ("rank0-file", "fp32"), ("rank0-file-old-key", "topk-int2"),
                                           ("rank0-model", "fp32")])
def test_two_replicas_resumed_wrongly_are_refused(tmp_path, mode: str, wire: str) -> None:
    """Loading the model before building StreamingDiLoCo let init_sync overwrite replica 1's weights with replica 0's;
    loading rank 0's saved files (model, inner optimizer, DiLoCo state: nanoGPT's master-process checkpoint) on every
    replica replaced replica 1's own work since its last syncs with replica 0's (and handed it replica 0's
    error-feedback residuals). Both resumed with no error; now refused by name (the first on both replicas, the second
    on replica 1, with or without error feedback). Rank 0's model file next to each replica's own DiLoCo state is
    refused at replica 1's first step, naming the fragment in progress at the save (the other had just synced)."""
    res = run_ranks(_resume_worker, 2, mode, os.fspath(tmp_path / "ckpt"), wire)
    if mode == "load-before-build":
        for r in res:
            # synced at steps 2, 4 and 6
            assert isinstance(r, str) and "a state with progress was loaded (committed 3, local_step 0)" in r, r
            assert "build it with init_sync=False when every replica loads its own weights first" in r
    elif mode == "rank0-model":  # rank 0's model file, each replica's own optimizer and DiLoCo state
        assert res[0] == "stepped"
        assert isinstance(res[1], str) and res[1].startswith(
            "diloco: the weights of ['2.weight', '2.bias'] (2 of the fragment parameters) are not the ones this "
            "replica held when the loaded DiLoCo state was saved: a model file of another replica"), res[1]
    else:
        assert res[0] == "loaded"  # replica 0 loads its own file
        assert isinstance(res[1], str), res[1]
        assert res[1].startswith("diloco load_state_dict: this state was saved by replica 0, and this is replica 1 "
                                 "(a state_dict() saved by one rank and loaded on every replica)"), res[1]
        assert ("error-feedback residuals" in res[1]) == (wire != "fp32"), res[1]


def test_two_replicas_resumed_rightly_match_the_uninterrupted_run(tmp_path) -> None:
    want = run_ranks(_resume_worker, 2, "uninterrupted", os.fspath(tmp_path / "a"))
    assert not torch.equal(want[0], want[1])  # the replicas differ between syncs: what a wrong resume loses
    for mode in ("load-after-build", "load-before-build-no-init-sync"):
        got = run_ranks(_resume_worker, 2, mode, os.fspath(tmp_path / mode))
        for r in range(2):
            assert isinstance(got[r], torch.Tensor), got[r]
            assert torch.equal(got[r], want[r]), (mode, r)


def test_a_copy_of_the_model_carries_no_live_marker() -> None:
    """The load marker is a hook on the model: a deepcopy (an export's unsharded copy) or a pickle of the model must
    not carry StreamingDiLoCo along (its in-flight work handles cannot be copied), and loading into the copy must
    not mark the live run."""
    import copy
    import pickle

    model, opt, dl = _built()
    _step(model, opt, 0, 0)
    twin = copy.deepcopy(model)
    twin.load_state_dict(_model(seed=1).state_dict())
    pickle.loads(pickle.dumps(model)).load_state_dict(_model(seed=2).state_dict())
    _step(model, opt, 0, 1)  # not refused: the live model was not loaded
    assert dl.committed == 1
    dl.close()


# ---------------------------------------------------------------------------------------- GTP inside, user script
def _gtp_inside_worker(comm_kind: str) -> object:
    """One replica of GTP 2 (both ranks): ``comm=None`` made the whole world the replica group, so init_sync copied
    rank 0's row shards over rank 1's and the syncs averaged different rows (weights 0.6 off after one step, no
    error); now refused on both ranks. With the replica axis of the mesh, ``state_dict()`` holds whole weights
    (the shards were saved under the weights' names before: a (3, 4) 'global.0.weight' of a (6, 4) weight)."""
    from lowband.parallel import build_mesh
    from lowband.parallel.gtp import GTPRuntime, shard_linears

    mesh = build_mesh(gtp=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, dtype=torch.float64), nn.Tanh(), nn.Linear(6, 5, dtype=torch.float64))
    shard_linears(model, GTPRuntime(mesh.gtp))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        dl = StreamingDiLoCo(model, opt, comm=None if comm_kind == "none" else mesh.replica, sync_every=2)
    except ValueError as e:
        return str(e)
    shapes = {k: tuple(v.shape) for k, v in dl.state_dict().items() if k.startswith("global.")}
    dl.close()
    return shapes


def test_gtp_inside_a_replica_needs_the_replica_group() -> None:
    refused = run_ranks(_gtp_inside_worker, 2, "none")
    assert refused[0] == refused[1]
    assert refused[0].startswith("diloco: the cross-replica group 'replica' holds ranks [0, 1] of the GTP group of "
                                 "'0.weight' (comm=None is every rank)"), refused[0]
    shapes = run_ranks(_gtp_inside_worker, 2, "mesh")
    assert shapes[0] == shapes[1] == {"global.0.weight": (6, 4), "global.0.bias": (6,), "global.2.weight": (5, 6),
                                      "global.2.bias": (5,)}


def _gtp_lossy_worker(fix: bool) -> dict:
    """2 replicas x GTP 2, int8 wire (block 8), per-rank data: after two syncs, the whole (replicated) parameters must
    be bitwise equal on both GTP ranks of a replica. ``fix=False`` passes the user's model-order split with an empty
    break list (what a script got before: one bucket mixing whole parameters with the rank's row shards)."""
    from lowband.parallel import build_mesh
    from lowband.parallel.gtp import GTPRuntime, shard_linears

    mesh = build_mesh(replica=2, gtp=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, dtype=torch.float64), nn.LayerNorm(6, dtype=torch.float64),
                          nn.Linear(6, 5, dtype=torch.float64))
    shard_linears(model, GTPRuntime(mesh.gtp))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    dl = StreamingDiLoCo(model, opt, comm=mesh.replica, sync_every=2, wire="int8", block_size=8,
                         bucket_breaks=None if fix else [[]])
    order = list(dl.frags[0].names)
    for s in range(4):
        _step(model, opt, dist.get_rank(), s, io=(4, 5))
    whole = {n: p.detach().clone() for n, p in model.named_parameters() if getattr(p, "gtp", None) is None}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, whole)
    dl.close()
    gtp_peer = everyone[dist.get_rank() ^ 1]  # the other GTP rank of this replica (replica-major, gtp innermost)
    return {"order": order, "breaks": dl.bucket_breaks, "committed": dl.committed,
            "same": all(torch.equal(whole[n], gtp_peer[n]) for n in whole)}


def test_gtp_inside_with_a_lossy_wire_keeps_whole_parameters_equal_in_a_replica() -> None:
    res = run_ranks(_gtp_lossy_worker, 4, True)
    for r in res:
        assert r["committed"] == 2 and r["same"], r
        assert r["order"] == ["0.bias", "1.weight", "1.bias", "2.bias", "0.weight", "2.weight"], r["order"]
        assert r["breaks"] == [[6 + 6 + 6 + 5]], r["breaks"]
    unfixed = run_ranks(_gtp_lossy_worker, 4, False)
    assert not all(r["same"] for r in unfixed)  # the control: mixed with the shards, they drift apart


def _gtp_padded_resume_worker(model_of: str = "own") -> dict:
    """2 replicas x GTP 2, a (5, 6) weight (rank 1's shard holds 2 real rows and 1 pad row), top-k + int2 with error
    feedback, one step of overlap: train 11 steps, and train 6, save this rank's files (GTPStateLayout's logical
    form and dl.state_dict(), both whole weights), rebuild from other seeds, load, train 5 more."""
    from lowband.parallel import build_mesh
    from lowband.parallel.gtp import GTPRuntime, shard_linears
    from lowband.parallel.gtp_state import GTPStateLayout

    rank = dist.get_rank()

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, StreamingDiLoCo]:
        mesh = build_mesh(replica=2, gtp=2)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 6, dtype=torch.float64), nn.LayerNorm(6, dtype=torch.float64),
                              nn.Linear(6, 5, dtype=torch.float64))
        shard_linears(model, GTPRuntime(mesh.gtp))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        dl = StreamingDiLoCo(model, opt, comm=mesh.replica, sync_every=4, fragments=2, delay=1, wire="topk-int2",
                             topk_chunk=4, topk_k=2, block_size=4)
        return model, opt, dl

    model, opt, dl = build(rank)
    for s in range(11):
        _step(model, opt, rank, s, io=(4, 5))
    want = _flat(model)
    weight = model[2].weight
    pads = {"weight": weight[2:].detach().clone() if rank % 2 else None}
    for i, f in enumerate(dl.frags):
        if any(p is weight for p in f.params):
            j = next(k for k, p in enumerate(f.params) if p is weight)
            off = sum(p.numel() for p in f.params[:j])
            pads["global"] = dl.globals[i][j][2:].clone() if rank % 2 else None
            pads["residual"] = dl.residuals[i][off:off + weight.numel()].view(3, 6)[2:].clone() if rank % 2 else None
    dl.close()

    model, opt, dl = build(rank)
    for s in range(6):
        _step(model, opt, rank, s, io=(4, 5))
    buf = io.BytesIO()
    torch.save({"layout": GTPStateLayout(model, opt).logical_state_dict(), "dl": dl.state_dict()}, buf)
    dl.close()
    model, opt, dl = build(rank + 50)
    st = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    if model_of == "other-replica":  # the same GTP rank of the other replica wrote the model part
        files = [None] * dist.get_world_size()
        dist.all_gather_object(files, buf.getvalue())
        st["layout"] = torch.load(io.BytesIO(files[rank ^ 2]), weights_only=False)["layout"]
    GTPStateLayout(model, opt).load_state_dict(st["layout"])
    dl.load_state_dict(st["dl"])
    if model_of == "other-replica":
        try:
            _step(model, opt, rank, 6, io=(4, 5))
        except ValueError as e:
            return {"refused": str(e)}
        finally:
            dl.close()
        return {"refused": None}
    for s in range(6, 11):
        _step(model, opt, rank, s, io=(4, 5))
    got = _flat(model)
    dl.close()
    return {"pads": pads, "equal": torch.equal(got, want), "diff": (got - want).abs().max().item()}


def test_gtp_inside_pad_rows_stay_zero_and_a_resume_is_exact() -> None:
    """A mid-rise codec (int2) decodes a zero it sends as +-scale/2: the pad row of a GTP shard took nonzero values
    in the averaged pseudo-gradient and the residual, and from there in the global copy, the outer momentum and the
    weight. A checkpoint holds real rows only, so a resumed run restarted them at zero and diverged (0.04 on the
    padded weight after 5 steps, silently). The sync now keeps padding zero; the resume is bit for bit."""
    res = run_ranks(_gtp_padded_resume_worker, 4)
    for r, out in enumerate(res):
        assert out["equal"], (r, out["diff"])
        if r % 2:
            for what, t in out["pads"].items():
                assert t is not None and not t.any(), (r, what, t)


def test_gtp_inside_another_replicas_model_rows_are_refused() -> None:
    """Each GTP rank compares its own real rows against its slice of the saved whole weights' row digests (gathered
    as digests at save, not as rows): the model part of another replica's file is refused on every rank."""
    res = run_ranks(_gtp_padded_resume_worker, 4, "other-replica")
    for r, out in enumerate(res):
        assert out["refused"] is not None and "are not the ones this replica held" in out["refused"], (r, out)
        assert "2.weight" in out["refused"] or "0.weight" in out["refused"], (r, out)
