"""Parameters without a gradient in the sharded optimizers, against plain torch on 2 and 4 gloo ranks.

torch.optim + DDP(find_unused_parameters=True) semantics: a parameter used on some ranks is averaged
with zeros from the others; one used on no rank keeps ``grad=None`` and torch.optim leaves it untouched
(no moment decay, no weight decay, no step count; AdamW's step is per parameter); a ``requires_grad=False``
parameter is never touched, also when frozen after construction. The reference is one process on the
global batch with ``torch.optim.AdamW`` (``foreach=False``) and lowband's single-device ``Muon``, where a
parameter no rank used is simply absent from the graph. Float64 (Newton-Schulz in float64): 1e-10.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.optim import Muon, ShardedAdamW, ShardedMuon, ShardedOptimizer
from lowband.optim.sparse_rows import SparseTable
from lowband.testing import run_ranks

VOCAB, ROWS, DIM, HID, SEQ, BATCH, MICRO, STEPS, MID = 11, 13, 6, 8, 3, 8, 2, 6, 3
ADAM_HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON_HP = dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.05, ns_method="ns5", ns_dtype=torch.float64)


class SideModel(nn.Module):
    """Embedding, a sparse-able table, a frozen linear, Muon-shaped linears and three optional parts:
    ``side`` (a linear), ``extra`` (a 1-D scale) and ``table`` are used only where :func:`uses` says."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.table = nn.Embedding(ROWS, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.l1 = nn.Linear(DIM, HID)
        self.l2 = nn.Linear(HID, HID)
        self.side = nn.Linear(HID, HID)
        self.l3 = nn.Linear(HID, DIM)
        self.extra = nn.Parameter(torch.randn(DIM) * 0.1)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, use: frozenset[str]) -> torch.Tensor:
        x = self.frozen(self.embed(idx))
        if "table" in use:
            x = x + self.table((idx * 5 + 1) % ROWS)
        h = torch.tanh(self.l1(x))
        h = h + torch.tanh(self.l2(h))
        if "side" in use:
            h = h + torch.tanh(self.side(h))
        out = x + self.l3(h)
        if "extra" in use:
            out = out * (1 + self.extra)
        return self.head(out)


def uses(step: int, rank: int, micro: int, n: int) -> frozenset[str]:
    """Which optional parts rank ``rank`` uses in microbatch ``micro`` of ``step``:

    * ``side``: rank 0 only on even steps (averaged with zeros), no rank on odd steps;
    * ``extra``: every rank on steps 0, 1 and 5; on step 3 only rank N-1 and only in its first
      microbatch (inside ``no_sync``: the gradient is in ``p.grad``, no hook fires); no rank on 2 and 4;
    * ``table``: rank 1 on step 0, every rank on step 2, rank 0 on step 4, no rank on 1, 3 and 5.
    """
    out = set()
    if step % 2 == 0 and rank == 0:
        out.add("side")
    if step in (0, 1, 5) or (step == 3 and rank == n - 1 and micro == 0):
        out.add("extra")
    if (step == 0 and rank == 1) or step == 2 or (step == 4 and rank == 0):
        out.add("table")
    return frozenset(out)


def used_anywhere(step: int, n: int) -> set[str]:
    return set().union(*(uses(step, r, k, n) for r in range(n) for k in range(MICRO)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_fn(model: SideModel, idx: torch.Tensor, tgt: torch.Tensor, use: frozenset[str]) -> torch.Tensor:
    return F.cross_entropy(model(idx, use).reshape(-1, VOCAB), tgt.reshape(-1))


def muon_matrices(model: SideModel) -> list[nn.Parameter]:
    return [model.l1.weight, model.l2.weight, model.side.weight, model.l3.weight]


def adamw_params(model: SideModel, algo: str) -> list[nn.Parameter]:
    """Every other parameter, the frozen layer included (it stays out of the units)."""
    muon = {id(p) for p in muon_matrices(model)} if algo == "muon" else set()
    return [p for p in model.parameters() if id(p) not in muon]


def make_sharded(model: SideModel, algo: str, comm: Comm) -> ShardedOptimizer:
    """600-byte buckets (75 float64; shards cut through parameters). ``adamw``: units
    [head, l3.bias], [l3.weight, side.bias], [side.weight, l2.bias], [l2.weight, l1.bias], [l1.weight],
    [table], [embed, extra]: used and unused members share units, and members of one unit reach
    different step counts (``extra``, ``l2.bias``), so the per-run update is exercised; ``muon``: Muon
    on the four matrices + AdamW, the table row-sparse."""
    if algo == "adamw":
        return ShardedAdamW(adamw_params(model, algo), comm=comm, bucket_mb=600 / 2**20, module=model, **ADAM_HP)
    return ShardedMuon(muon_matrices(model), adamw_params(model, algo), comm=comm, bucket_mb=600 / 2**20,
                       module=model, adamw_lr=ADAM_HP["lr"], adamw_betas=ADAM_HP["betas"],
                       adamw_eps=ADAM_HP["eps"], adamw_weight_decay=ADAM_HP["weight_decay"],
                       sparse_tables=[SparseTable("table", model.table.weight)], sparse_mode="sparse", **MUON_HP)


def make_reference(model: SideModel, algo: str) -> list[torch.optim.Optimizer]:
    adam = torch.optim.AdamW(adamw_params(model, algo), foreach=False, **ADAM_HP)
    if algo == "adamw":
        return [adam]
    return [Muon(muon_matrices(model), **MUON_HP), adam]


def param_groups_of(algo: str) -> int:
    """ShardedAdamW over one parameter list: one group; ShardedMuon: a Muon group and an AdamW group."""
    return 1 if algo == "adamw" else 2


def n_used_flags(model: SideModel, algo: str) -> int:
    """One flag per trainable optimizer parameter, one per frozen one (checked for unfreezing), 8 per param group
    (its hyperparameters' 4-byte digest and complement), and the four trailing bytes (the GradScaler factor as a
    max and a min code, "a reduced shard is not finite", and "a late gradient copy with no factor seen")."""
    return sum(1 for _ in model.parameters()) + 8 * param_groups_of(algo) + 4


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _named_state(opt: ShardedOptimizer, model: SideModel, full: dict) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    return {names[id(params[i])]: st for i, st in full["state"].items()}


def _ref_state(ref: SideModel, opts: list[torch.optim.Optimizer]) -> dict[str, dict]:
    names = {id(p): n for n, p in ref.named_parameters()}
    return {names[id(p)]: st for o in opts for p, st in o.state.items()}


def _reload(opt: ShardedOptimizer, model: SideModel, algo: str, comm: Comm, ckpt: str) -> tuple:
    """A checkpoint round trip in the middle of training: DCP (the per-parameter ``Shard(0)`` state
    dict, saved and loaded by ``torch.distributed.checkpoint``), the full state dict and the raw shard
    each rebuild an identical optimizer on a fresh model; training continues with the DCP one."""
    import torch.distributed.checkpoint as dcp

    full = opt.full_state_dict()
    shard = opt.shard_state_dict()
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=ckpt)

    def fresh() -> tuple[SideModel, ShardedOptimizer]:
        m = SideModel()
        with torch.no_grad():
            for p, q in zip(m.parameters(), model.parameters()):
                p.copy_(q)
        return m, make_sharded(m, algo, comm)

    model2, opt2 = fresh()
    template = {"optim": opt2.state_dict()}
    dcp.load(template, checkpoint_id=ckpt)
    opt2.load_state_dict(template["optim"])
    _model3, opt3 = fresh()
    opt3.load_full_state_dict(full)
    _model4, opt4 = fresh()
    opt4.load_shard_state_dict(shard)
    for other in (opt2, opt3):
        got = other.full_state_dict()
        assert got["state"].keys() == full["state"].keys()
        for i, st in full["state"].items():
            assert got["state"][i].keys() == st.keys(), i
            for k, v in st.items():
                assert torch.equal(got["state"][i][k], v), (i, k)
    for ui, st in opt.state.items():
        for k, v in st.items():
            same = torch.equal(opt4.state[ui][k], v) if isinstance(v, torch.Tensor) else opt4.state[ui][k] == v
            assert same, (ui, k)
        if "steps" in st:  # an older shard with one step per unit: every member takes it
            legacy = {k: v for k, v in shard["state"][ui].items() if k != "steps"}
            legacy["step"] = max(st["steps"])
            opt4.load_shard_state_dict(dict(shard, state={**shard["state"], ui: legacy}))
            assert opt4.state[ui]["steps"] == [max(st["steps"])] * len(st["steps"])
            opt4.load_shard_state_dict(shard)
    for o in (opt, opt3, opt4):
        o.remove_hooks()
    return model2, opt2


def train_and_compare(algo: str, clip: float | None, ckpt: str | None) -> dict:
    torch.set_default_dtype(torch.float64)
    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    model = SideModel()
    opt = make_sharded(model, algo, comm)
    ref = SideModel()
    ref_opts = make_reference(ref, algo)
    frozen0 = [p.detach().clone() for p in model.frozen.parameters()]
    n_flags = n_used_flags(model, algo)
    assert opt.used_flags_numel == n_flags
    out: dict = {"norms": [], "ref_norms": [], "untouched": [], "used_records": []}
    for step in range(STEPS):
        if step == 4:  # frozen after construction, on every rank and in the reference: torch skips it
            model.l2.bias.requires_grad_(False)
            ref.l2.bias.requires_grad_(False)
        if step == 5:
            model.l2.bias.requires_grad_(True)
            ref.l2.bias.requires_grad_(True)
        before = _named_state(opt, model, opt.full_state_dict())
        ledger.mark_step()
        idx, tgt = batch(step)
        rows = BATCH // n
        li, lt = idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]
        mrows = rows // MICRO
        for k in range(MICRO):
            ctx = opt.no_sync() if k < MICRO - 1 else contextlib.nullcontext()
            with ctx:
                sl = slice(k * mrows, (k + 1) * mrows)
                (loss_fn(model, li[sl], lt[sl], uses(step, rank, k, n)) / MICRO).backward()
        if clip is not None:
            out["norms"].append(float(opt.clip_grad_norm(clip)))
        opt.step()
        opt.zero_grad()
        out["used_records"].append([(r.op, r.numel, r.wire_dtype, r.wire_bytes)
                                    for r in ledger.step_records() if r.tag == "grad_used"])
        # untouched: a part no rank used keeps its state (step, moments, momentum) bit for bit
        after = _named_state(opt, model, opt.full_state_dict())
        idle = {"side": ["side.weight", "side.bias"], "extra": ["extra"], "table": ["table.weight"]}
        for part, names in idle.items():
            if part in used_anywhere(step, n):
                continue
            for name in names:
                if name in before:
                    assert after[name].keys() == before[name].keys(), name
                    assert all(torch.equal(after[name][k], v) for k, v in before[name].items()), (step, name)
                else:
                    assert name not in after or all(not v.any() for k, v in after[name].items()), (step, name)
                out["untouched"].append((step, name))
        if step == 4:
            assert all(torch.equal(after["l2.bias"][k], v) for k, v in before["l2.bias"].items())
        # reference: one process, the global batch, every rank's microbatches with their own uses
        for r in range(n):
            for k in range(MICRO):
                sl = slice(r * rows + k * mrows, r * rows + (k + 1) * mrows)
                (loss_fn(ref, idx[sl], tgt[sl], uses(step, r, k, n)) / (MICRO * n)).backward()
        if clip is not None:
            out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.grad is not None], clip)))
        for o in ref_opts:
            o.step()
            o.zero_grad()
        if ckpt is not None and step == MID - 1:
            model, opt = _reload(opt, model, algo, comm, ckpt)
    opt.wait_for_params()
    out["param_err"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    out["frozen_unchanged"] = all(torch.equal(a, p) for a, p in zip(frozen0, model.frozen.parameters()))
    flat = _flat(model)
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    out["ranks_bitwise_equal"] = all(torch.equal(e, flat) for e in everyone)
    mine, theirs = _named_state(opt, model, opt.full_state_dict()), _ref_state(ref, ref_opts)
    out["state_names"] = sorted(mine)
    out["ref_state_names"] = sorted(theirs)
    err = 0.0
    for name, st in mine.items():
        if name not in theirs:  # never stepped by torch: only a Muon unit's zero momentum may be here
            assert set(st) == {"momentum_buffer"} and not st["momentum_buffer"].any(), name
            continue
        for k, v in st.items():
            if k == "step":
                assert float(v) == float(theirs[name]["step"]), (name, float(v), float(theirs[name]["step"]))
            else:
                err = max(err, (v - theirs[name][k]).abs().max().item())
    out["state_err"] = err
    out["steps"] = {name: float(st["step"]) for name, st in mine.items() if "step" in st}
    out["n_flags"] = n_flags
    return out


def _expected_steps(n: int) -> dict[str, float]:
    """torch's per-parameter AdamW step counts after STEPS steps (the schedule of :func:`uses`)."""
    counts = {"side": 0, "extra": 0, "table": 0}
    for step in range(STEPS):
        for part in used_anywhere(step, n):
            counts[part] += 1
    return counts


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("algo", "clip"), [("adamw", None), ("muon", 0.05)])
def test_unused_parameters_follow_torch(world: int, algo: str, clip: float | None) -> None:
    """``adamw``: small buckets (used and unused members share units, members' steps diverge: the
    per-run path); ``muon``: Muon + AdamW + a row-sparse table, with clipping."""
    res = run_ranks(train_and_compare, world, algo, clip, None)
    counts = _expected_steps(world)
    assert counts == {"side": 3, "extra": 4, "table": 3}  # every part idles on some steps
    for r in res:
        assert r["param_err"] < 1e-10, r["param_err"]
        assert r["state_err"] < 1e-10, r["state_err"]
        assert r["ranks_bitwise_equal"] and r["frozen_unchanged"]
        assert set(r["ref_state_names"]) <= set(r["state_names"])
        assert not any(name.startswith("frozen") for name in r["state_names"])
        assert r["steps"]["extra"] == counts["extra"] and r["steps"]["table.weight"] == counts["table"]
        assert r["steps"]["l2.bias"] == STEPS - 1  # frozen on step 4 only
        if algo == "adamw":
            assert r["steps"]["side.weight"] == counts["side"]
        assert {s for s, _ in r["untouched"]} == {1, 2, 3, 4, 5}
        for a, b in zip(r["norms"], r["ref_norms"], strict=True):
            assert abs(a - b) <= 1e-12 * b
        # one uint8 MAX all-reduce of the flags per step: 2(N-1)/N bytes per flag
        f = r["n_flags"]
        # 12 trainable parameters (the table included) + the frozen weight and bias + 8 per group + 4
        assert f == 18 + 8 * param_groups_of(algo)
        assert r["used_records"] == [[("all_reduce", f, "uint8", 2 * (world - 1) * f // world)]] * STEPS


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_checkpoint_round_trip_mid_training(world: int, algo: str, tmp_path) -> None:
    """After step MID the state goes through DCP, the full state dict and the raw shard (per-member
    steps included; an older shard's unit step loads into every member); the DCP-restored optimizer
    finishes training equal to torch."""
    res = run_ranks(train_and_compare, world, algo, None, str(tmp_path / "ckpt"))
    for r in res:
        assert r["param_err"] < 1e-10 and r["state_err"] < 1e-10
        assert r["ranks_bitwise_equal"]
        assert r["steps"]["extra"] == _expected_steps(world)["extra"]


def _unfrozen_after_construction() -> dict:
    """The frozen layer's weight is unfrozen on the last rank only: every rank refuses in step(),
    naming it, before any update; the same collectives ran on every rank."""
    torch.set_default_dtype(torch.float64)
    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    model = SideModel()
    opt = ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), module=model, **ADAM_HP)
    before = _flat(model)
    if rank == n - 1:
        model.frozen.weight.requires_grad_(True)
    idx, tgt = batch(0)
    loss_fn(model, idx, tgt, frozenset()).backward()
    msg = ""
    try:
        opt.step()
    except ValueError as e:
        msg = str(e)
    unchanged = torch.equal(_flat(model), before)
    ops = [(r.op, r.tag) for r in ledger.records]
    with torch.no_grad():
        model.frozen.weight.grad = None
    model.frozen.weight.requires_grad_(False)
    # the optimizer is usable again once the parameter is frozen
    loss_fn(model, idx, tgt, frozenset()).backward()
    opt.step()
    return {"msg": msg, "ops": ops, "unchanged_at_refusal": unchanged,
            "ok_after": not torch.equal(_flat(model), before),
            "no_param_gather": not any(t.startswith("param") for _o, t in ops)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_unfrozen_parameter_refused_on_every_rank(world: int) -> None:
    res = run_ranks(_unfrozen_after_construction, world)
    assert all(r["msg"] == res[0]["msg"] for r in res)
    assert "frozen.weight" in res[0]["msg"] and "requires_grad" in res[0]["msg"]
    assert all(r["ops"] == res[0]["ops"] for r in res) and all(r["no_param_gather"] for r in res)
    assert all(r["unchanged_at_refusal"] and r["ok_after"] for r in res)
