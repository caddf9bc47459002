"""The sharded optimizer on the ring (3 and 4 gloo ranks, a unit with chunks of at least ``RING_MIN_CHUNK``
elements): its parameters after clipped AdamW steps against single-process ``torch.optim.AdamW`` on the global
batch, the algorithm each unit's reduce-scatter and all-gather ran, and every rank holding the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.comm.ring import RING_MIN_CHUNK
from lowband.optim import ShardedAdamW
from lowband.testing import run_ranks

IN, WIDE, OUT, PER_RANK, STEPS = 24, 4 * RING_MIN_CHUNK // 24 + 8, 5, 4, 3  # the wide weight: 4 chunks or more
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(IN, WIDE), nn.Tanh(), nn.Linear(WIDE, OUT)).to(dtype)


def _batch(step: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(n * PER_RANK, IN, generator=g, dtype=torch.float64).to(dtype),
            torch.randint(0, OUT, (n * PER_RANK,), generator=g))


def _train(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(dtype)
    ledger = CommLedger()
    # a 10 kB bucket: the wide weight (fp64: 256 kB) is a unit of its own (chunks >= RING_MIN_CHUNK: the ring), the rest
    # are small units (one exchange each)
    opt = ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), bucket_mb=0.01, module=model,
                       param_gather="forward", **HP)
    for step in range(STEPS):
        x, y = _batch(step, n, dtype)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    algos = sorted({(r.op, r.numel // n >= RING_MIN_CHUNK, r.algorithm) for r in ledger.records
                    if r.tag.startswith(("grad:", "param:"))})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    return {"params": [p.detach().clone() for p in model.parameters()], "algos": algos,
            "same_bits": all(torch.equal(e, flat) for e in everyone)}


def _reference(dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    model = _model(dtype)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    for step in range(STEPS):
        x, y = _batch(step, n, dtype)
        # the mean over ranks of each rank's mean loss is the mean over the global batch (equal shares)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [3, 4])
def test_sharded_adamw_on_the_ring_matches_torch_adamw(world: int) -> None:
    assert WIDE * IN // world >= RING_MIN_CHUNK
    ref = _reference(torch.float64, world)
    for r in run_ranks(_train, world, "float64"):
        assert r["same_bits"]
        assert r["algos"] == [("all_gather", False, "p2p"), ("all_gather", True, "ring"),
                              ("reduce_scatter", False, "p2p+sum"), ("reduce_scatter", True, "ring")]
        # fp64, a handful of summation orders of O(1) terms over 3 steps: far inside 1e-10
        for p, q in zip(r["params"], ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)
    for r in run_ranks(_train, world, "float32"):
        assert r["same_bits"]


def _exchange_choice(exchange: str) -> dict:
    model = _model(torch.float32)
    ledger = CommLedger()
    opt = ShardedAdamW(model.parameters(), comm=Comm(ledger=ledger), bucket_mb=0.01, exchange=exchange, **HP)
    x, y = _batch(0, dist.get_world_size(), torch.float32)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return {"purpose": opt.comm.purpose, "algos": sorted({r.algorithm for r in ledger.records
                                                          if r.tag.startswith(("grad:", "param:"))})}


def _mixed_exchange() -> str:
    try:
        ShardedAdamW(_model(torch.float32).parameters(), comm=Comm(ledger=CommLedger()),
                     exchange="ring" if dist.get_rank() == 0 else "p2p")
    except ValueError as e:
        return str(e)
    return "built"


def test_exchange_p2p_keeps_every_peer_at_once_and_is_agreed() -> None:
    ring, p2p = run_ranks(_exchange_choice, 3, "ring")[0], run_ranks(_exchange_choice, 3, "p2p")[0]
    assert ring == {"purpose": "sharded", "algos": ["p2p", "p2p+sum", "ring"]}
    assert p2p == {"purpose": "sharded-p2p", "algos": ["p2p", "p2p+sum"]}
    # ranks that chose differently are refused at construction, on every rank, naming the settings
    assert all("settings" in r for r in run_ranks(_mixed_exchange, 3, timeout=120))
    with pytest.raises(ValueError, match="exchange='tree' is not allowed"):
        ShardedAdamW(_model(torch.float32).parameters(), exchange="tree")
