"""Issue 20: every lowband component on its own communicator (``Comm.private``), and GTP following
PyTorch semantics for frozen and unused parameters, on 2 and 4 gloo ranks.

Rule under test (torch.optim + DDP(find_unused_parameters=True)): a frozen parameter is never
touched; a parameter used on some ranks is averaged with zeros from the others; a parameter used on
no rank keeps ``.grad = None`` and torch's optimizer leaves it alone. A GTP layer that some ranks of
its group run and others do not cannot work (its gather is a collective): every rank must end with
:class:`GTPCollectiveError` within the process-group timeout.

Tolerances (float64): the distributed run sums the lanes' gradients in another order than the
reference (pre-scaled reduce-scatter partial sums vs one backward of the lanes' mean loss): a
relative O(k eps64), k < 100 terms, per step; AdamW maps it to parameter differences of
lr * O(k eps) per step, far below 1e-10 after 4 steps. A departure from the rule (one extra AdamW
step with zero gradient: weight decay plus a moment-driven update) moves a parameter by
~lr = 1e-2 and shows at once.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm, default_ledger, group_timeout
from lowband.optim.gtp_muon import GTPMuon
from lowband.parallel.gtp import GTPCollectiveError, GTPOptions, GTPRuntime, shard_linears, sync_replicated_grads
from lowband.parallel.mesh import build_mesh
from lowband.testing import run_ranks

TOL = 1e-10
STEPS = 4
LR, WD = 1e-2, 0.1
SHORT_PG_TIMEOUT = 8  # seconds: the error tests wait this long for the collective that never pairs


# ------------------------------------------------------------------------------ Comm.private
def _private_properties() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    world = Comm(name="world", algorithms={"all_gather": "broadcast"})
    a = world.private("a")
    assert a is not world and a.group is not None and a.parent is world and a.purpose == "a"
    assert (a.name, a.rank, a.size, a.ledger, a.algorithms) == ("world", rank, n, world.ledger, world.algorithms)
    assert world.private("a") is a and a.private("a") is a  # memoized on the user's Comm
    b = a.private("b")  # derived from the root, not from a
    assert b.parent is world and b is world.private("b") and b.group is not a.group
    # same ranks, two groups: torch names them apart (sha1 of ranks + this rank's group count)
    names = {dist.distributed_c10d._get_process_group_name(c.group) for c in (a, b)}
    assert len(names) == 2
    assert a.timeout == group_timeout(None) == timedelta(seconds=30)  # inherited from run_ranks' pg
    c = world.private("a", timeout=timedelta(seconds=7))
    assert c is not a and c.timeout == timedelta(seconds=7)
    # a subgroup's private group is created by its members only: rank 0 and 1 create one, the others
    # never call private (they would hang here if creation needed every rank of the world)
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        pc = Comm(pair, name="pair").private("p")
        assert pc.size == 2 and pc.rank == rank
        t = torch.tensor([float(rank + 1)], dtype=torch.float64)
        pc.all_reduce(t)
        assert t.item() == 3.0
    # ledger: recorded under the parent's name
    default_ledger().reset()
    x = torch.ones(4, dtype=torch.float64)
    a.all_reduce(x, tag="t")
    recs = [(r.op, r.group, r.numel) for r in default_ledger().records]
    return {"recs": recs, "x": x.tolist()}


def test_local_comm_is_its_own_private_comm() -> None:
    assert not dist.is_initialized()
    local = Comm(None, name="one")
    assert local.private("gtp") is local and local.timeout is None
    with pytest.raises(ValueError, match="purpose"):
        local.private("")


@pytest.mark.parametrize("world", [2, 4])
def test_private_comm_properties(world: int) -> None:
    res = run_ranks(_private_properties, world, pg_timeout=30)
    for r in res:
        assert r["recs"] == [("all_reduce", "world", 4)]
        assert r["x"] == [float(world)] * 4


def _user_collectives_interleaved() -> list[float]:
    """Ranks issue a user all-reduce on the default group before or after lowband's (async)
    collectives: on one process group the user's all-reduce would pair with lowband's all-reduce
    on some ranks (wrong sums, then a hang)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm().private("test")
    mine = torch.full((3,), float(rank + 1), dtype=torch.float64)
    user = torch.full((3,), 10.0 * (rank + 1), dtype=torch.float64)
    gathered = torch.empty(n * 3, dtype=torch.float64)
    if rank % 2 == 0:
        h1 = comm.all_reduce(mine, async_op=True)
        h2 = comm.all_gather(gathered, user.clone(), async_op=True)
        dist.all_reduce(user)
        h1.wait()
        h2.wait()
    else:
        dist.all_reduce(user)
        comm.all_reduce(mine)
        comm.all_gather(gathered, torch.full((3,), 10.0 * (rank + 1), dtype=torch.float64))
    return [mine[0].item(), user[0].item(), *gathered[::3].tolist()]


@pytest.mark.parametrize("world", [2, 4])
def test_user_collective_never_pairs_with_lowband(world: int) -> None:
    res = run_ranks(_user_collectives_interleaved, world)
    total = world * (world + 1) / 2
    for r in res:
        assert r == [total, 10 * total, *[10.0 * (k + 1) for k in range(world)]]


def _gtp_with_user_collectives() -> list[float]:
    """A GTP model built on the *default* group's ``Comm`` while the user all-reduces on that group:
    rank 0's all-reduce is in flight during the forward, the others issue theirs after it. On one
    process group rank 0's all-reduce would pair with the others' first weight gather."""
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    rt = GTPRuntime(Comm())
    shard_linears(model, rt)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    t = torch.ones(1, dtype=torch.float64)
    work = dist.all_reduce(t, async_op=True) if rank == 0 else None  # in flight during the forward
    loss = model(x).square().sum()
    if rank != 0:
        dist.all_reduce(t)
    loss.backward()
    if work is not None:
        work.wait()
    return [t.item(), float(loss)]


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_on_default_group_ignores_user_collectives(world: int) -> None:
    res = run_ranks(_gtp_with_user_collectives, world)
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    for rank, r in enumerate(res):
        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        assert r[0] == world
        assert abs(r[1] - float(ref(x).square().sum().detach())) <= 1e-12 * max(1.0, abs(r[1]))


# ------------------------------------------------------------------------------ frozen and unused
class _Net(nn.Module):
    """``inp`` (trainable) -> ``mid`` (frozen weight and bias; its input needs a gradient, so its
    backward gathers it for dgrad) -> ``branch`` (used on even steps only, by every rank) -> ``head``;
    ``gain`` a replicated vector used by some lanes only (see :func:`_uses_gain`)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.mid.requires_grad_(False)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor, step: int, lane: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        if step % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        if _uses_gain(step, lane):
            h = h * self.gain
        return self.head(h)


def _uses_gain(step: int, lane: int) -> bool:
    """Step 0: every lane; 1 and 3: lane 0 only (averaged with zeros); 2: no lane (grad stays None)."""
    return step == 0 or (step % 2 == 1 and lane == 0)


def _net() -> _Net:
    torch.manual_seed(21)
    return _Net().double()


def _batch(step: int, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + lane)
    return (torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randn(4, 3, generator=g, dtype=torch.float64))


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=False)


def _reference(world: int) -> dict:
    model = _net()
    opt = _adamw(model.parameters())
    for step in range(STEPS):
        loss = sum(F.mse_loss(model(*_lane_in(step, lane)), _batch(step, lane)[1]) for lane in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _lane_in(step: int, lane: int) -> tuple[torch.Tensor, int, int]:
    return _batch(step, lane)[0], step, lane


def _gtp_frozen_unused(prefetch: bool) -> dict:
    rank = dist.get_rank()
    model = _net()
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp, GTPOptions(prefetch=prefetch))
    layers = shard_linears(model, rt)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    opt = _adamw(model.parameters())
    ledger = default_ledger()
    per_step = []
    grads_none = []
    for step in range(STEPS):
        ledger.reset()
        x, y = _batch(step, rank)
        F.mse_loss(model(x, step, rank), y).backward()
        sync_replicated_grads(rt, model)
        grads_none.append(sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None))
        per_step.append([(r.op, r.tag, r.numel, r.async_op) for r in ledger.records])
        opt.step()
        opt.zero_grad(set_to_none=True)
    logical = {f"{n}.weight": rt.full_weight(m.gtp) for n, m in layers.items()}
    logical.update({n: p.detach().clone() for n, p in model.named_parameters() if not hasattr(p, "gtp")})
    return {"params": logical, "flags": flags, "records": per_step, "grads_none": grads_none,
            "frozen_grads": [model.mid.weight.grad, model.mid.bias.grad],
            "shard_numel": {n: m.weight.numel() for n, m in layers.items()},
            "padded": {n: m.gtp.padded_out * m.gtp.in_features for n, m in layers.items()}}


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_gtp_frozen_and_unused_params_follow_torch(world: int, prefetch: bool) -> None:
    res = run_ranks(_gtp_frozen_unused, world, prefetch)
    ref = _reference(world)
    init = {n: p.detach().clone() for n, p in _net().named_parameters()}
    for r in res:
        assert r["flags"]["mid.weight"] is False and r["flags"]["mid.bias"] is False
        assert r["flags"]["inp.bias"] is True
        assert r["frozen_grads"] == [None, None]
        for name, v in ref.items():
            torch.testing.assert_close(r["params"][name], v, rtol=0, atol=TOL, msg=name)
        assert torch.equal(r["params"]["mid.weight"], init["mid.weight"])  # frozen: untouched, bitwise
        assert torch.equal(r["params"]["mid.bias"], init["mid.bias"])
        # used on no rank (branch on odd steps, gain at step 2): grad stays None
        assert r["grads_none"] == [[], ["branch.bias", "branch.weight"], ["gain"],
                                   ["branch.bias", "branch.weight"]]
    for step, recs in enumerate(res[0]["records"]):
        used = ["inp", "mid", "branch", "head"] if step % 2 == 0 else ["inp", "mid", "head"]
        trainable = [u for u in used if u != "mid"]
        rs = [x for x in recs if x[1] == "gtp:rs"]
        ag_f = [x for x in recs if x[1] == "gtp:ag:fwd"]
        ag_b = [x for x in recs if x[1] == "gtp:ag:bwd"]
        # frozen mid: gathered for dgrad in backward, never reduce-scattered; inp's input needs no grad
        assert sorted(x[2] for x in rs) == sorted(res[0]["padded"][u] for u in trainable), step
        assert len(ag_b) == len(used) - 1, step
        # an unused weight is gathered only by a speculative forward prefetch (chain order of step 0),
        # which is dropped unused; without prefetch it is not gathered at all
        speculative = 1 if (prefetch and step % 2 == 1) else 0
        assert len(ag_f) == len(used) + speculative, step
        # one replicated all-reduce: grads + one used flag per replicated param + one per GTP weight
        # + one read-outside-its-layer flag per GTP weight + one non-finite flag per GTP weight
        # (GTPOptions.share_nonfinite)
        rep = [x for x in recs if x[1] == "gtp:replicated"]
        rep_numel = 8 + 8 + 3 + 8  # inp, branch, head biases, gain (mid.bias frozen: left out)
        assert [x[:3] for x in rep] == [("all_reduce", "gtp:replicated", rep_numel + 4 + 4 + 4 + 4)], step
    for r in res[1:]:
        assert [[x[:3] for x in s] for s in r["records"]] == [[x[:3] for x in s] for s in res[0]["records"]]


# ------------------------------------------------------------------------------ GTP Muon
def _gtp_muon_untouched() -> dict:
    model = _net()
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    shard_linears(model, rt)
    gtp = [p for p in model.parameters() if hasattr(p, "gtp")]
    rest = [p for p in model.parameters() if not hasattr(p, "gtp")]
    opt = GTPMuon([{"params": gtp, "algorithm": "muon"}, {"params": rest, "algorithm": "adamw"}], rt.comm,
                  lr=LR, weight_decay=WD, ns_dtype=torch.float64)
    rank = dist.get_rank()
    out = {}
    for step in range(2):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        mom = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
               if "momentum_buffer" in opt.state.get(p, {})}
        x, y = _batch(step, rank)
        F.mse_loss(model(x, step, rank), y).backward()
        sync_replicated_grads(rt, model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # head.weight left out: at N=4 one rank's shard of its 3 rows is pure padding (zero forever)
        out[step] = {"same": sorted(n for n, p in model.named_parameters()
                                    if n != "head.weight" and torch.equal(p, before[n])),
                     "mom_same": sorted(n for n, p in model.named_parameters()
                                        if n in mom and torch.equal(opt.state[p]["momentum_buffer"], mom[n]))}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_muon_leaves_unused_shards_alone(world: int) -> None:
    """Step 1: branch (a Muon GTP shard) has no grad on any rank: its shard and, on its owner, its
    momentum stay bitwise unchanged (no momentum decay, no weight decay); mid is frozen throughout."""
    res = run_ranks(_gtp_muon_untouched, world)
    for r in res:
        assert r[0]["same"] == ["mid.bias", "mid.weight"]
        assert r[1]["same"] == ["branch.bias", "branch.weight", "mid.bias", "mid.weight"]
        assert {"branch.weight", "mid.weight"} >= set(r[1]["mom_same"]) >= set(r[0]["mom_same"])
    owners = [r for r in res if "branch.weight" in r[1]["mom_same"]]
    assert len(owners) == 1  # the owner holds branch's momentum, and it did not move at step 1


# ------------------------------------------------------------------------------ rank-divergent use
class _Fork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mode: str, rank: int) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if mode == "subset" and rank == 0:  # c on rank 0 only: collective counts differ
            h = h + torch.tanh(self.c(h))
        if mode == "swap":  # c on even ranks, d on odd ones: counts and shapes agree, pairing is wrong
            h = h + torch.tanh((self.c if rank % 2 == 0 else self.d)(h))
        return self.b(h)


def _divergent(mode: str) -> tuple[str, str]:
    rank = dist.get_rank()
    torch.manual_seed(4)
    model = _Fork().double()
    rt = GTPRuntime(build_mesh(gtp=dist.get_world_size()).gtp)
    shard_linears(model, rt)
    try:
        for step in range(2):
            x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            model(x, mode, rank).square().sum().backward()
            sync_replicated_grads(rt, model)
    except GTPCollectiveError as e:
        return "GTPCollectiveError", str(e)
    except Exception as e:  # reported to the test, which expects none
        return type(e).__name__, str(e)
    return "none", ""


@pytest.mark.parametrize("mode", ["subset", "swap"])
def test_gtp_layer_used_by_some_ranks_fails_clearly_on_every_rank(mode: str) -> None:
    res = run_ranks(_divergent, 2, mode, timeout=60, pg_timeout=SHORT_PG_TIMEOUT)
    for kind, msg in res:
        assert kind == "GTPCollectiveError", msg
        assert "'gtp'" in msg and "every rank" in msg.lower()
        if mode == "swap":
            assert "['c', 'd']" in msg  # named by the used-flags check, identically on every rank
        else:
            assert f"timeout {SHORT_PG_TIMEOUT} s" in msg


def _eval_on_rank0_while_others_wait() -> tuple[str, str]:
    """Issue 20 item 4: rank 0 evaluates a GTP model (built on the default group) while the others
    wait in ``dist.barrier()``. On one process group the barrier paired with rank 0's first weight
    gather and rank 0 then blocked forever; on GTP's private group nothing pairs, and both sides
    time out."""
    rank = dist.get_rank()
    torch.manual_seed(5)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(4, 4), act=nn.Tanh(), out=nn.Linear(4, 2))).double()
    rt = GTPRuntime(Comm())
    shard_linears(model, rt)
    if rank == 0:
        try:
            with torch.no_grad():
                model(torch.ones(2, 4, dtype=torch.float64))
        except GTPCollectiveError as e:
            return "GTPCollectiveError", str(e)
        return "none", ""
    try:
        dist.barrier()
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return "none", ""


def test_eval_on_one_rank_while_others_barrier_errors_everywhere() -> None:
    res = run_ranks(_eval_on_rank0_while_others_wait, 2, timeout=60, pg_timeout=SHORT_PG_TIMEOUT)
    kind, msg = res[0]
    assert kind == "GTPCollectiveError", msg
    assert "weight 'proj'" in msg and "group 'world'" in msg and "Evaluate on every rank" in msg
    kind, msg = res[1]
    assert kind != "none" and "timed out" in msg.lower(), (kind, msg)
