"""Time ShardedOptimizer._adopt_edits (the per-step check for parameter writes made outside the optimizer) on a
1.2M-element owned slice, the dp suite comm-heavy config's unit size at 2 ranks, next to the AdamW update of the same
slice. One thread. Usage: .venv/bin/python scripts/time_adopt_edits.py"""

import time
from types import SimpleNamespace

import torch

from lowband.optim.adamw import adamw_update_
from lowband.optim.sharded import ShardedOptimizer

torch.set_num_threads(1)
n = 1_200_000


def t(f, *a, **k):
    for _ in range(3):
        f(*a, **k)
    t0 = time.perf_counter()
    for _ in range(30):
        f(*a, **k)
    return (time.perf_counter() - t0) / 30 * 1e3


for pdt, wire in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
    master = torch.randn(n)
    own = master.to(wire).to(pdt) if wire is not None else master.to(pdt)
    fake = SimpleNamespace(param_wire_dtype=wire, _param_wire=lambda u, w=wire, d=pdt: w or d)
    unit = SimpleNamespace(layout=SimpleNamespace(dtype=pdt))
    ms = t(ShardedOptimizer._adopt_edits, fake, unit, own, master)
    print(f"params {pdt}, wire {wire}: _adopt_edits {ms:.2f} ms per {n} elements")
p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
hp = dict(step=5, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
print(f"adamw_update_ {t(adamw_update_, p, g, m, v, **hp):.2f} ms per {n} elements")
