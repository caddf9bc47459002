"""``param_gather="forward"`` with parameters read outside their own module's forward.

A model that indexes ``self.wpe.weight[:T]`` (the embedding module is never called) or passes another module's
weight to ``F.linear`` reads that parameter without the forward pre-hook that waits for its all-gather. The
optimizer learns such reads at the first step (nothing is in flight then) and waits for those units when the
model's forward starts, so the result is bitwise the one of ``param_gather="step"``; a parameter first read that
way while its gather is in flight is refused by the next ``step()`` on every rank, naming it.

The parameter all-gathers are made to land only when waited for (``_land_on_wait``): on gloo a small gather
often completes before the next forward reads it, which would hide a missing wait; here a missing wait always
reads the previous step's values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.optim import ShardedAdamW
from lowband.testing import run_ranks

DIM, HID, SEQ, BATCH, STEPS = 6, 8, 5, 4, 4


class FunctionalReads(nn.Module):
    """``wpe.weight`` is only ever indexed; ``extra.weight`` goes through ``F.linear`` from step ``direct_from``
    on (``extra`` itself is never called)."""

    def __init__(self, direct_from: int) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.l1 = nn.Linear(DIM, HID)
        self.l2 = nn.Linear(HID, DIM)
        self.extra = nn.Linear(DIM, DIM, bias=False)
        self.direct_from = direct_from
        self.step_no = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.wpe.weight[: x.shape[1]]
        h = h + self.l2(torch.tanh(self.l1(h)))
        if self.step_no >= self.direct_from:
            h = h + F.linear(h, self.extra.weight)
        return h.pow(2).mean()


class _Landed:
    def __init__(self, output: torch.Tensor, staged: torch.Tensor) -> None:
        self.output, self.staged = output, staged

    def wait(self) -> None:
        self.output.copy_(self.staged)


def _land_on_wait(comm: Comm) -> None:
    """Parameter all-gathers run at once into a staging copy that reaches the parameters only at ``wait()``."""
    inner = comm.all_gather

    def all_gather(output: torch.Tensor, input: torch.Tensor, **kw: Any) -> Any:
        if not str(kw.get("tag", "")).startswith("param:"):
            return inner(output, input, **kw)
        staged = output.detach().clone()
        inner(staged, input.detach().clone(), **{**kw, "async_op": False})
        return _Landed(output, staged)

    comm.all_gather = all_gather  # type: ignore[method-assign]


def _train(param_gather: str, direct_from: int) -> dict:
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    model = FunctionalReads(direct_from)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, comm=Comm(ledger=CommLedger()),
                       bucket_mb=100 / 2**20, module=model, param_gather=param_gather)
    _land_on_wait(opt.comm)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    error = None
    for step in range(STEPS):
        model.step_no = step
        model(torch.randn(BATCH, SEQ, DIM, generator=g)).backward()
        try:
            opt.step()
        except ValueError as e:
            error = (step, str(e))
            break
        opt.zero_grad()
    opt.wait_for_params()
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "error": error, "units": len(opt.units)}


def _compare(direct_from: int) -> dict:
    forward, step = _train("forward", direct_from), _train("step", direct_from)
    return {"equal": all(torch.equal(a, b) for a, b in zip(forward["params"], step["params"], strict=True)),
            "forward_error": forward["error"], "step_error": step["error"], "units": forward["units"]}


@pytest.mark.parametrize("world", [2, 4])
def test_reads_outside_the_owner_are_learned_at_the_first_step(world: int) -> None:
    """Read that way from the first step: bitwise the result of param_gather='step' (on the old code, without
    the learned wait, the second step's forward read the previous step's wpe.weight and extra.weight)."""
    for r in run_ranks(_compare, world, 0):
        assert r["units"] >= 3  # the parameters are spread over several units (one wait does not cover all)
        assert r["forward_error"] is None and r["step_error"] is None
        assert r["equal"]


@pytest.mark.parametrize("world", [2, 4])
def test_a_new_read_outside_the_owner_mid_gather_is_refused_on_every_rank(world: int) -> None:
    res = run_ranks(_compare, world, 2)
    for r in res:
        assert r["step_error"] is None  # param_gather='step' has nothing in flight at a forward
        step, msg = r["forward_error"]
        assert step == 2, r["forward_error"]
        assert "extra.weight" in msg and "param_gather='step'" in msg and "in flight" in msg


class ReadBeforeOwner(nn.Module):
    """``l1.weight`` goes through ``F.linear`` (of an input that needs a gradient, so autograd saves the weight)
    before ``l1`` itself runs in the same forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.l1 = nn.Linear(DIM, DIM)
        self.l2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(x))
        early = F.linear(h, self.l1.weight)
        return (self.l1(h) + early).pow(2).mean()


def _read_before_owner() -> dict:
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    model = ReadBeforeOwner()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, comm=Comm(ledger=CommLedger()), bucket_mb=100 / 2**20,
                       module=model, param_gather="forward")
    _land_on_wait(opt.comm)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    for step in range(3):
        loss = model(torch.randn(BATCH, SEQ, DIM, generator=g))
        try:
            loss.backward()
        except RuntimeError as e:
            return {"step": step, "error": str(e)}
        opt.step()
        opt.zero_grad()
    return {"step": None, "error": None}


@pytest.mark.parametrize("world", [2, 4])
def test_a_read_before_the_owner_runs_fails_autograds_version_check(world: int) -> None:
    """The read is not learned (l1 runs in the same forward), but the wait that the gather wrote l1.weight
    bumps its version: backward raises (on every rank: every rank reads the same way) instead of taking a gradient
    of the previous step's values. Step 0 has nothing in flight and passes."""
    for r in run_ranks(_read_before_owner, world):
        assert r["step"] == 1, r
        assert "modified by an inplace operation" in r["error"]
