"""``fsdp2-muon``'s premise: ``torch.optim.Muon`` on FSDP2's DTensor shards orthogonalizes the whole
matrices (not the local row shards), with collectives that :class:`CollectiveBytes` sees."""

from __future__ import annotations

import pytest
import torch

from lowband.testing import run_ranks

TIMEOUT = 90


def _fsdp2_muon_vs_single() -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from lowband.bench.torch_muon import CollectiveBytes, ns_dtype

    torch.manual_seed(0)
    n = dist.get_world_size()
    # 7 x 6 and 5 x 7: rows not divisible by 2 or 4 (FSDP2 pads the last shard); one tall, one wide
    full = nn.Sequential(nn.Linear(6, 7, bias=False), nn.Tanh(), nn.Linear(7, 5, bias=False)).double()
    ref = nn.Sequential(nn.Linear(6, 7, bias=False), nn.Tanh(), nn.Linear(7, 5, bias=False)).double()
    ref.load_state_dict(full.state_dict())
    fully_shard(full)
    kw = dict(lr=0.1, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    opt, ropt = torch.optim.Muon(full.parameters(), **kw), torch.optim.Muon(ref.parameters(), **kw)
    counts: dict[str, int] = {}
    for step in range(3):
        x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        full(x).square().sum().backward()
        mode = CollectiveBytes()
        with ns_dtype(torch.float64), mode:
            opt.step()
        counts, wire = dict(mode.counts), mode.wire_bytes
        opt.zero_grad()
        ref(x).square().sum().backward()
        with ns_dtype(torch.float64):
            ropt.step()
        ropt.zero_grad()
    diff = max((p.full_tensor().detach() - q.detach()).abs().max().item()
               for p, q in zip(full.parameters(), ref.parameters()))
    return {"diff": diff, "counts": counts, "wire": wire, "n": n}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_muon_orthogonalizes_whole_matrices(world: int) -> None:
    for r in run_ranks(_fsdp2_muon_vs_single, world, timeout=TIMEOUT):
        # float64, same torch iteration on the same whole matrices; only the DTensor matmuls' split
        # summation order differs (~1e-16 relative per op), through 3 steps of 5 NS iterations
        assert r["diff"] <= 1e-12, r
        assert r["counts"].get("all_reduce", 0) + r["counts"].get("all_gather", 0) > 2, r  # inside NS
        assert r["wire"] > 0
