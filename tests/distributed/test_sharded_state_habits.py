"""Sharded optimizer state and module state from a user's script (2 gloo ranks).

* A 0-d parameter (a learnable ``logit_scale``) in the optimizer: ``opt.state_dict()`` for torch DCP (it raised
  ``IndexError``), saved and loaded, continues bit for bit like the uninterrupted run.
* ``param_gather="forward"``: ``model.state_dict()`` and ``model.load_state_dict()`` right after ``step()``, while
  the parameter all-gathers are in flight (rank 1 is made late), see the gathered parameters (a state dict
  read mid-gather mixed old and new values; a load was overwritten by the late gathers).
* ``amsgrad`` / ``maximize`` in a param group (by hand, or from a torch AdamW state dict): refused by name, not
  ignored.
* An lr that differs between ranks (a scheduler stepped under ``if rank == 0``, a per-rank measured schedule):
  refused on every rank before any update.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm
from lowband.optim import ShardedAdamW
from lowband.testing import run_ranks

TIMEOUT = 90


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x))) * self.logit_scale


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]


def _train(model: nn.Module, opt: ShardedAdamW, steps: range) -> None:
    for s in steps:
        x, y = _batch(s, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _zero_dim(path: str) -> bool:
    import torch.distributed.checkpoint as dcp

    torch.set_default_dtype(torch.float64)

    def build() -> tuple[nn.Module, ShardedAdamW]:
        torch.manual_seed(0)
        model = _Scaled()
        return model, ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, comm=Comm(), module=model)

    model, opt = build()
    _train(model, opt, range(2))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    _train(model, opt, range(2, 4))
    resumed, ropt = build()
    state = {"model": resumed.state_dict(), "optim": ropt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    resumed.load_state_dict(state["model"])
    ropt.load_state_dict(state["optim"])
    _train(resumed, ropt, range(2, 4))
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))


def test_a_zero_dim_parameter_saves_and_resumes_through_dcp(tmp_path: Path) -> None:
    assert run_ranks(_zero_dim, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT) == [True, True]


def _zero_dim_saved(path: str) -> dict:
    torch.set_default_dtype(torch.float64)
    import torch.distributed.checkpoint as dcp

    from lowband.comm import CommLedger

    torch.manual_seed(0)
    model = _Scaled()
    ledger = CommLedger()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(ledger=ledger), module=model, bucket_mb=1e-4)
    _train(model, opt, range(3))
    start = len(ledger.records)
    sd = opt.state_dict()
    ops = {(r.op, r.tag) for r in ledger.records[start:]}
    dcp.save({"optim": sd}, checkpoint_id=path)
    return {"full": opt.full_state_dict()["state"], "ops": ops,
            "kinds": {i: sorted({type(v).__name__ for k, v in st.items() if k != "step"})
                      for i, st in sd["state"].items()}}


def _zero_dim_loaded(path: str) -> dict:
    torch.set_default_dtype(torch.float64)
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = _Scaled()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(), module=model, bucket_mb=1e-4)
    sd = {"optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    opt.load_state_dict(sd["optim"])
    return opt.full_state_dict()["state"]


def test_a_zero_dim_parameters_state_reshards_from_2_ranks_to_4_and_1(tmp_path: Path) -> None:
    """The 0-d parameter's state is a plain tensor on every rank (no rows to shard: DCP writes it once); the
    rest stays ``Shard(0)``. Saved on 2 ranks, it loads on 4 and on 1 to bitwise the same state."""
    saved = run_ranks(_zero_dim_saved, 2, str(tmp_path / "c"), timeout=TIMEOUT)
    for r in saved:  # logit_scale (parameter 0) plain, every other parameter's moments Shard(0) chunks, exchanged
        assert r["kinds"] == {0: ["Tensor"], 1: ["DTensor"], 2: ["DTensor"], 3: ["DTensor"], 4: ["DTensor"]}
        assert r["ops"] == {("all_to_all", "state")}  # not gathered (a 0-d parameter used to gather everything)
    want = saved[0]["full"]
    for world in (4, 1):
        for got in run_ranks(_zero_dim_loaded, world, str(tmp_path / "c"), timeout=TIMEOUT):
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[i][k], v) for i, st in want.items() for k, v in st.items()), world


def _mid_gather() -> dict:
    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Scaled()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(), module=model, param_gather="forward",
                       bucket_mb=1e-4)
    reads, loads = [], []
    for s in range(3):
        x, y = _batch(s, rank)
        F.mse_loss(model(x), y).backward()
        if rank == 1:
            time.sleep(0.3)  # rank 0's step returns with rank 1's slices still to come
        opt.step()
        opt.zero_grad()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        opt.wait_for_params()
        reads.append(all(torch.equal(saved[k], v) for k, v in model.state_dict().items()))
    x, y = _batch(3, rank)
    F.mse_loss(model(x), y).backward()
    if rank == 1:
        time.sleep(0.3)
    opt.step()
    opt.zero_grad()
    model.load_state_dict(saved)  # roll back to the state after step 3, gathers of step 4 in flight
    opt.wait_for_params()
    loads.append(all(torch.equal(saved[k], v) for k, v in model.state_dict().items()))
    return {"reads": reads, "loads": loads}


def test_module_state_dict_waits_for_in_flight_gathers() -> None:
    for r in run_ranks(_mid_gather, 2, timeout=TIMEOUT):
        assert r == {"reads": [True] * 3, "loads": [True]}, r


def _flags(key: str, how: str) -> str:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = _Scaled()
    try:
        if how == "group":
            opt = ShardedAdamW([{"params": list(model.parameters()), key: True}], lr=1e-2, comm=Comm())
        else:
            ref = torch.optim.AdamW(model.parameters(), lr=1e-2, **{key: True})
            opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm())
            opt.load_state_dict(ref.state_dict())
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("key", ["amsgrad", "maximize"])
@pytest.mark.parametrize("how", ["group", "torch-state-dict"])
def test_amsgrad_and_maximize_are_refused_not_ignored(key: str, how: str) -> None:
    msg = (f"ShardedAdamW: param_groups[0] has {key}=True, which lowband's sharded AdamW does not implement (it "
           f"would step as with {key}=False); set it to False or use torch.optim.AdamW")
    assert run_ranks(_flags, 2, key, how, timeout=TIMEOUT) == [msg, msg]


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.lin(x))))


def _layout_buffers(path: str) -> dict:
    """ShardedStateLayout + DCP on a model with BatchNorm (every rank sees the same batch, so its running
    statistics agree): the resumed run continues bit for bit, the running statistics included; a checkpoint
    saved without buffers loads after ``fit_template`` and leaves them as they are."""
    import torch.distributed.checkpoint as dcp

    from lowband.optim import ShardedStateLayout

    torch.set_default_dtype(torch.float64)

    def build(buffers: bool = True) -> tuple[nn.Module, ShardedAdamW, ShardedStateLayout]:
        torch.manual_seed(0)
        model = _Normed()
        opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(), module=model)
        return model, opt, ShardedStateLayout(model, opt, include_buffers=buffers)

    def train(model: nn.Module, opt: ShardedAdamW, steps: range) -> None:
        for s in steps:
            x, y = _batch(s, 0)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    model, opt, layout = build()
    train(model, opt, range(2))
    keys = sorted(layout.state_dict()["model"])
    dcp.save(layout.state_dict(), checkpoint_id=path + "/with")
    dcp.save(build(False)[2].state_dict(), checkpoint_id=path + "/without")
    train(model, opt, range(2, 4))
    resumed, ropt, rlayout = build()
    state = rlayout.state_dict()
    dcp.load(state, checkpoint_id=path + "/with")
    rlayout.load_state_dict(state)
    train(resumed, ropt, range(2, 4))
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values(),
                                                 strict=True))
    old, _oopt, olayout = build()
    template = olayout.state_dict()
    from torch.distributed.checkpoint import FileSystemReader

    saved = set(FileSystemReader(path + "/without").read_metadata().state_dict_metadata)
    dropped = olayout.fit_template(template, saved)
    dcp.load(template, checkpoint_id=path + "/without")
    olayout.load_state_dict(template)
    return {"keys": keys, "same": same, "dropped": dropped, "untouched": int(old.bn.num_batches_tracked)}


def test_sharded_state_layout_saves_persistent_buffers(tmp_path: Path) -> None:
    for r in run_ranks(_layout_buffers, 2, str(tmp_path), timeout=TIMEOUT):
        assert "bn.running_mean" in r["keys"] and "bn.num_batches_tracked" in r["keys"], r
        assert "scratch" not in r["keys"], r
        assert r["same"], r
        assert r["dropped"] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"], r
        assert r["untouched"] == 0, r


def _sparse_grad() -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm())
    try:
        model(torch.tensor([[1, 2, 3, 3]])).sum().backward()
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_sparse_gradient_is_refused_by_name() -> None:
    """nn.Embedding(sparse=True): one line naming the parameter and the ways out (it was a reshape error)."""
    out = run_ranks(_sparse_grad, 2, timeout=TIMEOUT)
    assert out[0] == out[1]
    assert out[0].startswith("ShardedAdamW: parameter param_groups[0]['params'][0] got a sparse gradient "
                             "(torch.sparse_coo;"), out[0]


def _max_norm_table() -> list[str]:
    model = nn.Sequential(nn.Embedding(8, 4, max_norm=0.5), nn.Linear(4, 2))
    errors = []
    try:
        ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(), module=model)
    except ValueError as e:
        errors.append(str(e))
    from lowband.optim.sparse_rows import sparse_table_for

    try:
        sparse_table_for(model, "0.weight")
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_an_embedding_with_max_norm_is_refused_by_name() -> None:
    """nn.Embedding(max_norm=...) renormalizes the looked-up rows in place on each rank; the owner's all-gather
    overwrote the rows another rank renormed (the ranks agreed on a table no single-process run computes, 0.87
    from torch at lr 0). Refused at construction, and by sparse_table_for, on every rank alike."""
    out = run_ranks(_max_norm_table, 2, timeout=TIMEOUT)
    assert out[0] == out[1] and len(out[0]) == 2, out
    assert out[0][0].startswith("ShardedOptimizer: embedding '0' has max_norm=0.5: its forward renormalizes"), out
    assert out[0][1].startswith("sparse_table_for: embedding '0' has max_norm=0.5"), out


class _TwoTables(nn.Module):
    """Two tables and a head; ``emb2`` is used only when ``use2`` is set (a conditional branch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb, self.emb2, self.head = nn.Embedding(20, 4), nn.Embedding(20, 4), nn.Linear(4, 20, bias=False)
        self.double()
        self.use2 = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + (self.emb2(x) if self.use2 else 0.0)
        return F.cross_entropy(self.head(torch.tanh(h)).reshape(-1, 20), y.reshape(-1))


_ACC, _HP = 3, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _micro(step: int, rank: int, m: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + m)
    # emb2 only in microbatch 1 (under no_sync) on rank 0, only in the last one on rank 1
    return torch.randint(0, 20, (2, 5), generator=g), torch.randint(0, 20, (2, 5), generator=g), \
        (m == 1 and rank == 0) or (m == _ACC - 1 and rank == 1)


def _scaled_accumulation() -> tuple[dict[str, torch.Tensor], list[float]]:
    rank = dist.get_rank()
    model = _TwoTables()
    opt = ShardedAdamW(model.parameters(), comm=Comm(), bucket_mb=1e-4, module=model, **_HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    norms = []
    for s in range(3):
        for m in range(_ACC):
            x, y, model.use2 = _micro(s, rank, m)
            loss = scaler.scale(model(x, y) / _ACC)
            if m < _ACC - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        scaler.unscale_(opt)
        norms.append(float(opt.clip_grad_norm(0.05)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def test_gradscaler_with_a_gradient_only_from_no_sync_microbatches_equals_torch() -> None:
    """scale -> backward x3 (the first two under no_sync) -> unscale_ -> clip -> step: a parameter whose gradient
    came only from a no_sync microbatch is copied at step time, after unscale_ divided it by the loss scale; the
    copy is put back into the scaled frame of the copies made in backward (it was refused as 'p.grad changed
    after lowband reduced it'). Equals single-process torch (fp64: rounding only)."""
    out = run_ranks(_scaled_accumulation, 2, timeout=TIMEOUT)
    model = _TwoTables()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **_HP)
    norms = []
    for s in range(3):
        for m in range(_ACC):
            for r in range(2):
                x, y, model.use2 = _micro(s, r, m)
                (model(x, y) / (_ACC * 2)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    for params, got_norms in out:
        for k, v in model.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=0, atol=1e-12, msg=k)
        assert got_norms == pytest.approx(norms, rel=1e-12)


def _rank_lrs(how: str) -> dict:
    """ShardedAdamW with a torch StepLR (gamma 0.5 each step) stepped on every rank ("all"), under
    ``if rank == 0`` ("rank0"), or an lr set by hand from something each rank measures ("measured")."""
    torch.manual_seed(0)
    model = _Scaled()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(), module=model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rank = dist.get_rank()
    done = 0
    try:
        for s in range(3):
            x, y = _batch(s, rank)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if how == "all" or (how == "rank0" and rank == 0):
                sched.step()
            if how == "measured":
                for g in opt.param_groups:
                    g["lr"] = 1e-2 * (1.0 + 1e-9 * rank)  # e.g. a schedule on each rank's wall clock
    except ValueError as e:
        return {"error": str(e), "done": done, "params": None}
    return {"error": None, "done": done, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


@pytest.mark.parametrize("how", ["rank0", "measured"])
def test_hyperparameters_that_differ_between_ranks_are_refused(how: str) -> None:
    """Each rank updates its own slice with its own lr, so the gathered model silently mixed the ranks' lrs (no
    replica check could see it: every rank holds the same mix). Now every rank refuses at the next step, before
    any update (step 0 ran with equal lrs)."""
    res = run_ranks(_rank_lrs, 2, how, timeout=TIMEOUT)
    for r, out in enumerate(res):
        assert out["done"] == 1, (r, out)
        assert out["error"] is not None and "param group(s) [0] differ between ranks" in out["error"], (r, out)
        assert "not under `if rank == 0`" in out["error"]


def test_a_scheduler_stepped_on_every_rank_passes() -> None:
    res = run_ranks(_rank_lrs, 2, "all", timeout=TIMEOUT)
    assert all(out["error"] is None and out["done"] == 3 for out in res), res
    assert torch.equal(res[0]["params"], res[1]["params"])
