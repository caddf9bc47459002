"""Streaming DiLoCo single-process tests: the schedule against plain tables, fragments, validation,
and one replica reproducing plain local training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.diloco import ScheduleConfig, StaticMembership, StreamingDiLoCo, actions_at, plan, split_fragments

P, S = "prepare", "sync"

# (n, H, tau) -> every (inner step, action, fragment) for steps 1..12 when every sync commits
TABLES = {
    (1, 4, 0): [(4, P, 0), (4, S, 0), (8, P, 0), (8, S, 0), (12, P, 0), (12, S, 0)],
    (1, 4, 3): [(1, P, 0), (4, S, 0), (5, P, 0), (8, S, 0), (9, P, 0), (12, S, 0)],
    (2, 6, 1): [(2, P, 0), (3, S, 0), (5, P, 1), (6, S, 1), (8, P, 0), (9, S, 0), (11, P, 1), (12, S, 1)],
    (2, 4, 0): [(2, P, 0), (2, S, 0), (4, P, 1), (4, S, 1), (6, P, 0), (6, S, 0), (8, P, 1), (8, S, 1),
                (10, P, 0), (10, S, 0), (12, P, 1), (12, S, 1)],
    (3, 6, 1): [(1, P, 0), (2, S, 0), (3, P, 1), (4, S, 1), (5, P, 2), (6, S, 2), (7, P, 0), (8, S, 0),
                (9, P, 1), (10, S, 1), (11, P, 2), (12, S, 2)],
    (3, 12, 3): [(1, P, 0), (4, S, 0), (5, P, 1), (8, S, 1), (9, P, 2), (12, S, 2)],
    (4, 4, 0): [(s, a, (s - 1) % 4) for s in range(1, 13) for a in (P, S)],
    (2, 12, 5): [(1, P, 0), (6, S, 0), (7, P, 1), (12, S, 1)],
}


@pytest.mark.parametrize("key", sorted(TABLES))
def test_schedule_matches_table(key: tuple[int, int, int]) -> None:
    n, h, tau = key
    assert plan(12, ScheduleConfig(n, h, tau)) == TABLES[key]


def test_actions_at() -> None:
    cfg = ScheduleConfig(2, 8, 2)  # K = 4
    assert [actions_at(s, cfg) for s in range(1, 5)] == [(), (P,), (), (S,)]
    assert actions_at(1, ScheduleConfig(4, 4, 0)) == (P, S)
    with pytest.raises(ValueError, match="local_step=5 is outside"):
        actions_at(5, cfg)


@pytest.mark.parametrize(("n", "h", "tau", "match"), [
    (2, 1, 0, r"^diloco sync_every must be a positive multiple of diloco num_fragments \(2\); got 1$"),
    (3, 0, 0, r"sync_every must be a positive multiple of diloco num_fragments \(3\); got 0"),
    (3, 8, 0, r"sync_every must be a positive multiple of diloco num_fragments \(3\); got 8"),
    (2, 8, 4, r"^diloco delay must be in \[0, diloco sync_every / diloco num_fragments\) = \[0, 4\); got 4$"),
    (2, 8, -1, r"delay must be in .*; got -1$"),
    (0, 8, 0, r"^diloco num_fragments must be >= 1; got 0$"),
])
def test_schedule_validation(n: int, h: int, tau: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(n, h, tau)


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8, dtype=dtype)
        self.blocks = nn.ModuleList(nn.Linear(8, 8, dtype=dtype) for _ in range(layers))
        self.head = nn.Linear(8, 2, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_default_split_is_consecutive_and_balanced() -> None:
    m = Tiny()
    frags = split_fragments(m, 2)
    names = [n for f in frags for n in f.names]
    assert names == [n for n, _ in m.named_parameters()]  # consecutive, covering, model order
    assert frags[0].names[:2] == ["emb.weight", "emb.bias"]
    assert frags[1].names[-1] == "head.weight"
    assert all(not n.startswith("blocks.1.") for n in frags[0].names) or \
        all(not n.startswith("blocks.1.") for n in frags[1].names)  # a block is never split
    assert abs(frags[0].numel - frags[1].numel) <= 72 + 16
    assert len(split_fragments(m, 5)) == 5
    with pytest.raises(ValueError, match=r"num_fragments=6 must be in \[1, 5\]"):
        split_fragments(m, 6)


def test_fragment_validation() -> None:
    m = Tiny()
    with pytest.raises(ValueError,
                       match=r"fragments overlap: parameter 'blocks.0.weight' is in fragments 0 and 1"):
        split_fragments(m, [[m.emb.weight, m.emb.bias, m.blocks[0].weight], m.blocks, m.head])
    with pytest.raises(ValueError, match=r"leave 3 trainable parameter\(s\) out: 'emb.weight', 'emb.bias', "
                                         r"'head.weight'"):
        split_fragments(m, [m.blocks])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        split_fragments(m, [m, [nn.Parameter(torch.zeros(2))]])
    with pytest.raises(ValueError, match=r"fragments\[1\] has no parameters"):
        split_fragments(m, [m, nn.ReLU()])
    m.head.weight.requires_grad_(False)  # frozen parameters may be left out
    assert split_fragments(m, [m.emb, m.blocks])[0].names == ["emb.weight", "emb.bias"]


def _make(**kw):
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return StreamingDiLoCo(m, opt, comm=Comm(ledger=CommLedger()), **kw)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    (dict(sync_every=1, fragments=2), ValueError, r"sync_every must be a positive multiple of .* \(2\); got 1$"),
    (dict(sync_every=6, fragments=4), ValueError, r"sync_every must be a positive multiple of .* \(4\); got 6$"),
    (dict(sync_every=4, fragments=2, delay=2), ValueError,
     r"delay must be in \[0, diloco sync_every / diloco num_fragments\) = \[0, 2\); got 2$"),
    (dict(sync_every=4, delay=-1), ValueError, "delay must be in .*; got -1"),
    (dict(sync_every=4, alpha=1.5), ValueError, r"^diloco alpha must be in \[0, 1\]; got 1.5$"),
    (dict(sync_every=4, alpha=-0.1), ValueError, r"alpha must be in \[0, 1\]; got -0.1"),
    (dict(sync_every=4, fragments=2, outer_optimizer=[lambda p: torch.optim.SGD(p, lr=1.0)] * 3),
     ValueError, r"outer_optimizer: got a list of 3, expected one per fragment \(2\)"),
    (dict(sync_every=4, wire="fp4"), ValueError, r"^diloco wire must be one of fp64, fp32, bf16, .*; got 'fp4'$"),
    (dict(sync_every=4, wire="int8", block_size=10), ValueError, "block_size must be a positive multiple of 4; got 10"),
    (dict(sync_every=4, bucket_cap_mb=0), ValueError, "bucket_cap_mb=0 must be a positive number"),
    (dict(sync_every=4, outer_optimizer=3), TypeError, "outer_optimizer must be None, a callable"),
    (dict(sync_every=4.0), TypeError, "sync_every must be an int"),
])
def test_diloco_validation(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        _make(**kw)


def test_diloco_fragment_validation_through_constructor() -> None:
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fragments overlap"):
        StreamingDiLoCo(m, opt, sync_every=4, fragments=[m, m.head])
    with pytest.raises(ValueError, match="leave 2 trainable"):
        StreamingDiLoCo(m, opt, sync_every=4, fragments=[m.blocks, m.head])
    assert not opt._optimizer_step_post_hooks  # nothing registered on failure


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 4, generator=g, dtype=dtype), torch.randn(5, 2, generator=g, dtype=dtype)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, dtype: torch.dtype) -> None:
    for s in range(steps):
        x, y = _batch(s, dtype)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize(("n", "h", "tau", "alpha"), [(1, 4, 0, 0.0), (3, 6, 0, 0.0), (2, 8, 2, 1.0),
                                                      (3, 9, 1, 1.0)])
def test_one_replica_reproduces_local_training(n: int, h: int, tau: int, alpha: float) -> None:
    """Outer SGD lr 1, no momentum: the global copy moves onto the local weights at every sync.

    With alpha 0 and tau 0 the weights are reset to themselves (up to ``G - (G - L)`` rounding, so
    float64 to 1e-12); with alpha 1 the local weights are never touched (bitwise), whatever tau.
    """
    dtype = torch.float64
    torch.manual_seed(0)
    ref = Tiny(dtype)
    model = Tiny(dtype)
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ledger = CommLedger()
    syncs: list[int] = []
    dl = StreamingDiLoCo(model, opt, comm=Comm(ledger=ledger), sync_every=h, fragments=n, delay=tau,
                         alpha=alpha, wire="fp64", outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    dl.add_sync_callback(lambda _d, i: syncs.append(i))
    steps = 2 * h + 1
    _train(ref, ref_opt, steps, dtype)
    _train(model, opt, steps, dtype)
    assert syncs == [i % n for i in range(steps // (h // n))]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if alpha == 1.0:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    # the ledger shows each fragment's outer traffic (zero bytes on one rank, 2 records per sync)
    for i in range(n):
        assert ledger.count(tag=f"diloco:frag{i}") == 2 * syncs.count(i)
    assert ledger.wire_bytes(tag="diloco") == 0
    dl.close()
    assert not opt._optimizer_step_post_hooks


def test_membership_validation() -> None:
    from types import SimpleNamespace

    from lowband.diloco import replica_mesh
    from lowband.diloco.ft import TorchftMembership

    with pytest.raises(ValueError, match="use_async_quorum=False"):
        TorchftMembership(SimpleNamespace(_use_async_quorum=True))
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    registered = {}
    manager = SimpleNamespace(_use_async_quorum=False,
                              register_state_dict_fn=lambda key, load, save: registered.setdefault(key, (load, save)))
    dl = StreamingDiLoCo(m, opt, sync_every=4, wire="int8", membership=TorchftMembership(manager))  # any wire now
    assert registered["lowband_diloco"] == (dl.load_outer_state, dl.outer_state)  # the healing state
    dl.close()
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    with pytest.raises(ValueError, match="num_replicas=3 must be a positive divisor of the world size 1"):
        replica_mesh(3)


@pytest.mark.parametrize(("wire", "stop"), [("fp32", 2), ("fp32", 3), ("int2", 3), ("topk-int4", 5)])
def test_state_dict_resume_is_bitwise(wire: str, stop: int) -> None:
    """Stop after ``stop`` steps (odd: fragment in flight), resume a fresh copy from the state dicts
    (model, inner optimizer, DiLoCo incl. error-feedback residuals): bitwise the uninterrupted run."""
    kw = dict(sync_every=4, fragments=2, delay=1, wire=wire, block_size=4, topk_chunk=4, topk_k=1)

    def fresh():
        torch.manual_seed(0)
        m = Tiny()
        opt = torch.optim.AdamW(m.parameters(), lr=0.05)
        return m, opt, StreamingDiLoCo(m, opt, comm=Comm(ledger=CommLedger()), **kw)

    m, opt, dl = fresh()
    assert dl.error_feedback == (wire != "fp32")
    _train(m, opt, stop, torch.float32)
    committed_at_stop, dl_in_flight_at_stop = dl.committed, dl.in_flight
    assert dl.in_flight == (committed_at_stop % 2 if stop % 2 else None)
    sd = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "opt": copy.deepcopy(opt.state_dict()),
          "diloco": dl.state_dict()}
    if dl.error_feedback:
        assert {k for k in sd["diloco"] if k.startswith("residual.")} == {f"residual.{n}" for n, _ in
                                                                          m.named_parameters()}
        assert any(bool(v.abs().sum() > 0) for k, v in sd["diloco"].items() if k.startswith("residual."))
    for s in range(stop, 9):
        x, y = _batch(s, torch.float32)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    m2, opt2, dl2 = fresh()
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    dl2.load_state_dict(sd["diloco"])
    assert dl2.committed == committed_at_stop and dl2.in_flight == dl_in_flight_at_stop
    for s in range(stop, 9):
        x, y = _batch(s, torch.float32)
        opt2.zero_grad()
        nn.functional.mse_loss(m2(x), y).backward()
        opt2.step()
    assert dl2.committed == dl.committed == 4
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for ga, gb in zip(dl.globals, dl2.globals):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    for ra, rb in zip(dl.residuals, dl2.residuals):
        assert (ra is None and rb is None) or torch.equal(ra, rb)
    missing = {k: v for k, v in dl.state_dict().items() if not k.startswith("residual.")}
    if dl.error_feedback:
        with pytest.raises(ValueError, match=r"key 'residual\.emb\.weight' is missing"):
            dl2.load_state_dict(missing)


def test_rollback_keeps_residual_and_heal_zeroes_it() -> None:
    """Error feedback under faults: a failed commit keeps the residual (and rolls the fragment back),
    a heal from a peer (``load_outer_state``) restarts the residuals at zero."""
    torch.manual_seed(0)
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    votes = iter([True, False, True, True])

    class Scripted(StaticMembership):
        def should_commit(self) -> bool:
            return next(votes)

    comm = Comm(ledger=CommLedger())
    dl = StreamingDiLoCo(m, opt, comm=comm, sync_every=2, fragments=1, wire="int2", block_size=4,
                         membership=Scripted(comm))
    seen: list[tuple[bool, torch.Tensor]] = []
    dl.add_attempt_callback(lambda d, i, ok: seen.append((ok, d.residuals[0].clone())))
    _train(m, opt, 4, torch.float32)  # attempt 1 commits, attempt 2 is rolled back
    (ok1, r1), (ok2, r2) = seen
    assert ok1 and not ok2 and bool(r1.abs().sum() > 0) and torch.equal(r1, r2)
    assert all(torch.equal(p, g) for p, g in zip(dl.frags[0].params, dl.globals[0]))  # rolled back
    assert dl.committed == 1
    dl.load_outer_state(dl.outer_state())
    assert torch.equal(dl.residuals[0], torch.zeros_like(dl.residuals[0]))


def test_nonfinite_pseudo_gradient_raises_and_applies_nothing() -> None:
    torch.manual_seed(0)
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dl = StreamingDiLoCo(m, opt, comm=Comm(ledger=CommLedger()), sync_every=2, fragments=1, wire="int2",
                         block_size=4)
    _train(m, opt, 1, torch.float32)
    with torch.no_grad():
        m.head.weight[0, 0] = float("nan")
    before = [g.clone() for g in dl.globals[0]]
    res_before = dl.residuals[0].clone()
    with pytest.raises(FloatingPointError, match=r"fragment 0 .* non-finite values \(this replica's own was NOT"):
        _train(m, opt, 1, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(before, dl.globals[0]))
    assert torch.equal(res_before, dl.residuals[0]) and dl.committed == 0 and dl.in_flight is None
    assert dl.local_step == 0
