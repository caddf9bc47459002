"""Single-process pieces of Muon on GTP weights (lowband/optim/gtp_muon.py): the ownership/bucket plan,
the split of the Muon update into direction + apply, the wire dtype rule, refusals, and GTPMuon on a
one-rank GTP group against lowband.optim.muon.Muon + torch AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowband.comm import Comm
from lowband.optim.buckets import matrix_cost
from lowband.optim.gtp_muon import GTPMuon, MatrixSpec, _wire_dtype, plan_gtp_muon
from lowband.optim.muon import Muon, muon_apply_, muon_direction_, muon_shape_scale, muon_update_
from lowband.parallel.gtp import GTPRuntime, shard_linears
from lowband.plan import muon_split
from lowband.sharding import Split, placement_of
from lowband.train.optimizers import adamw_param_groups


def _spec(rows: int, cols: int, n: int, group: int = 0, dtype=torch.float32) -> MatrixSpec:
    return MatrixSpec(rows, cols, -(-rows // n), group, dtype)


def test_plan_is_backward_ordered_capped_and_cost_balanced():
    n = 4
    shapes = [(48, 16), (16, 48), (33, 16), (16, 16), (64, 64), (7, 5)]
    specs = [_spec(r, c, n) for r, c in shapes]
    cap = 64 * 64 * 4  # one 64x64 fp32 matrix per bucket at most
    buckets = plan_gtp_muon(specs, n, cap)
    # backward order (last registered first), every matrix exactly once
    assert [m for b in buckets for m in b.members] == list(reversed(range(len(specs))))
    for b in buckets:
        assert sum(specs[m].rows * specs[m].cols * 4 for m in b.members) <= cap or len(b.members) == 1
    # greedy least-loaded with the running cost carried over buckets, ties to the lower rank
    loads = [0] * n
    for b in buckets:
        for m in sorted(b.members, key=lambda m: (-specs[m].cost, b.members.index(m))):
            r = min(range(n), key=lambda q: (loads[q], q))
            assert b.owners[b.members.index(m)] == r
            loads[r] += matrix_cost(specs[m].rows, specs[m].cols)
    # deterministic: the same plan again
    again = plan_gtp_muon(specs, n, cap)
    assert [(b.members, b.owners) for b in again] == [(b.members, b.owners) for b in buckets]
    # splits: every rank sends each owner the shard elements of the matrices it owns
    b = buckets[0]
    sp = b.splits()
    assert sum(sp) == sum(specs[m].shard_numel for m in b.members)
    for o in range(n):
        assert sp[o] == sum(specs[m].shard_numel for m in b.owned(o))


def test_plan_splits_buckets_at_group_and_dtype_changes():
    specs = [_spec(8, 8, 2, 0), _spec(8, 8, 2, 0), _spec(8, 8, 2, 1), _spec(8, 8, 2, 1, torch.float64)]
    buckets = plan_gtp_muon(specs, 2, 1 << 30)
    assert [(b.members, b.group, b.dtype) for b in buckets] == [
        ([3], 1, torch.float64), ([2], 1, torch.float32), ([1, 0], 0, torch.float32)]
    assert buckets[2].owners == [0, 1]  # equal cost: first to rank 0, then the least loaded rank 1
    with pytest.raises(ValueError, match="bucket cap must be positive"):
        plan_gtp_muon(specs, 2, 0)


def test_direction_then_apply_is_muon_update_bitwise():
    g = torch.Generator().manual_seed(0)
    for shape in ((5, 9), (9, 5), (3, 6, 4)):
        p = torch.randn(*shape, generator=g, dtype=torch.float64)
        grad = torch.randn(*shape, generator=g, dtype=torch.float64)
        mb = torch.randn(*shape, generator=g, dtype=torch.float64)
        p2, mb2 = p.clone(), mb.clone()
        kw = dict(momentum=0.9, nesterov=True, ns_method="ns5", ns_steps=5, ns_dtype=torch.float32)
        muon_update_(p, grad, mb, lr=0.1, weight_decay=0.2, **kw)
        o = muon_direction_(grad, mb2, **kw)
        # applied row block by row block, as GTP ranks do on their shards: elementwise, so bitwise
        scale = muon_shape_scale(shape[-2], shape[-1])
        for rows in (slice(0, 2), slice(2, None)):
            muon_apply_(p2[..., rows, :], o[..., rows, :], lr=0.1, weight_decay=0.2, scale=scale)
        assert torch.equal(p, p2) and torch.equal(mb, mb2)


def test_wire_dtype_is_the_narrower_exact_choice():
    assert _wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert _wire_dtype(torch.float32, torch.float32) == torch.float32
    assert _wire_dtype(torch.float64, torch.float32) == torch.float32
    assert _wire_dtype(torch.float16, torch.bfloat16) == torch.bfloat16


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))
    return m.double()


def _groups(model: nn.Module, names: set[str]) -> list[dict]:
    muon = [p for n, p in model.named_parameters() if n in names]
    rest = nn.ParameterList([p for n, p in model.named_parameters() if n not in names])
    return ([{"params": muon, "algorithm": "muon", "lr": 0.05, "weight_decay": 0.1}]
            + [dict(g, algorithm="adamw") for g in adamw_param_groups(rest, 0.1)])


def test_one_rank_gtp_muon_equals_muon_and_adamw():
    """GTP group of one (no padding, local all-to-alls): equal to the single-device optimizers.
    float64; the only difference is batched vs single matmuls in Newton-Schulz: O(k eps64), k ~ 10."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    muon, _ = muon_split(ref)
    names = {n for n, p in ref.named_parameters() if any(p is q for q in muon)}
    rt = GTPRuntime(Comm(None, name="gtp"))
    shard_linears(model, rt)
    opt = GTPMuon(_groups(model, names), rt.comm, lr=1e-2, ns_dtype=torch.float64, bucket_mb=1e-4)
    assert len(opt.buckets) == 3  # a tiny cap: one matrix per bucket
    rmuon = Muon([p for n, p in ref.named_parameters() if n in names], lr=0.05, weight_decay=0.1,
                 ns_dtype=torch.float64)
    radam = torch.optim.AdamW(adamw_param_groups(nn.ParameterList(
        [p for n, p in ref.named_parameters() if n not in names]), 0.1), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        for m in (model, ref):
            m(x).square().mean().backward()
        opt.step()
        rmuon.step()
        radam.step()
        for o in (opt, rmuon, radam):
            o.zero_grad(set_to_none=True)
    ref_p = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_p[n].detach(), rtol=0, atol=1e-12, msg=n)
    want = sum(t.numel() * 8 for o in (rmuon, radam) for st in o.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0) + 4 * sum(1 for st in radam.state.values())
    assert opt.state_bytes() == want  # momenta + moments + one float32 step per AdamW param


def test_refusals_name_the_cause():
    rt = GTPRuntime(Comm(None, name="gtp"))
    model = _mlp()
    shard_linears(model, rt)
    with pytest.raises(ValueError, match="Muon handles 2-D matrices"):
        GTPMuon([{"params": [model[1].weight], "algorithm": "muon"}], rt.comm)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        GTPMuon([{"params": [model[1].weight], "algorithm": "sgd"}], rt.comm)
    w = model[0].weight
    alone = placement_of(w)
    # as gtp_tp's mark_partition: a TP cut outside the GTP one
    w.placement = alone.with_outer(Split("tp", 0, 2, 0), (2 * alone.shape[0], *alone.shape[1:]))
    with pytest.raises(ValueError, match=r"split over a TP group of 2 ranks.*whole matrix"):
        GTPMuon([{"params": [w], "algorithm": "muon"}], rt.comm)
    w.placement = alone
    other = Comm(None, name="other")
    with pytest.raises(ValueError, match="GTP shard of group 'gtp'"):
        GTPMuon([{"params": [w], "algorithm": "muon"}], other)
    with pytest.raises(ValueError, match="bucket_mb"):
        GTPMuon([{"params": [w], "algorithm": "muon"}], rt.comm, bucket_mb=0)
