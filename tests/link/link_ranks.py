"""Rank programs the link tests start inside the namespaces: ``python -m tests.link.link_ranks NAME OUT``.

``allreduce``: after a small warm-up all-reduce (gloo connections made), ``reps`` timed fp32 all-reduces
(sum) of ``numel`` ones through :class:`lowband.comm.Comm`, each between barriers; rank 0 writes the
times, the ledger's wire bytes of one timed all-reduce, the reduced values' min/max and its ``lb0``
counters over the timed window to OUT (JSON).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from lowband.bench.netns import read_counters
from lowband.comm import Comm, CommLedger


def allreduce(out: str, numel: int, reps: int) -> None:
    dist.init_process_group("gloo")
    comm = Comm(name="world", ledger=CommLedger())
    comm.all_reduce(torch.ones(1024), "sum")
    x = torch.ones(numel)
    times = []
    comm.barrier()
    rx0, tx0 = read_counters()
    for _ in range(reps):
        x.fill_(1.0)
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x, "sum")
        times.append(time.perf_counter() - t0)
    rx1, tx1 = read_counters()
    rec = comm.ledger.select(op="all_reduce")[-1]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "wire_bytes": rec.wire_bytes, "min": float(x.min()), "max": float(x.max()),
                       "tx": tx1 - tx0, "rx": rx1 - rx0, "world": dist.get_world_size()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    if name == "allreduce":
        allreduce(out, int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown rank program {name!r}")
