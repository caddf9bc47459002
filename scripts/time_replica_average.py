"""Time lowband.diloco.average.average_modules (the replicas' average: the trainer's DiLoCo export,
StreamingDiLoCo.averaged_model) on 2 gloo ranks over loopback, one thread each, for a 25.2M-parameter stack of six
Linear(2048, 2048) layers: every layer different on the two replicas (full training), or only the last one
(adapter-like: a frozen base the replicas share). Prints the median of 3 calls and the wire bytes per call, and
row_digest_pairs' cost per element. Usage: .venv/bin/python scripts/time_replica_average.py"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lowband.comm import Comm, CommLedger
from lowband.diloco.average import _host_copy, average_modules
from lowband.diloco.row_digest import row_digest_pairs
from lowband.testing import run_ranks


def _time_average(shared: bool) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])
    with torch.no_grad():
        for i, layer in enumerate(model):
            if not shared or i == len(model) - 1:
                layer.weight.add_(dist.get_rank() * 1e-3)
    ledger = CommLedger()
    comm = Comm(ledger=ledger)
    dest = _host_copy(model) if dist.get_rank() == 0 else None
    times = []
    for _ in range(3):
        comm.barrier()
        t0 = time.perf_counter()
        average_modules(comm, model, dest)
        times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 4),
            "wire_bytes": sum(r.wire_bytes for r in ledger.records if r.op == "all_reduce") // 3,
            "params": sum(p.numel() for p in model.parameters())}


def _time_digests() -> float:
    torch.set_num_threads(1)
    t = torch.randn(4096, 2048)
    row_digest_pairs(t)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        row_digest_pairs(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / t.numel() * 1e9


if __name__ == "__main__":
    print(f"row_digest_pairs: {_time_digests():.2f} ns per element (4096 x 2048 fp32, one thread)")
    for shared in (False, True):
        what = "only the last layer differs" if shared else "every layer differs"
        print(what, run_ranks(_time_average, 2, shared, timeout=600)[0])
