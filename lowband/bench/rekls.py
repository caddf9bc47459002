"""``rekls`` suite: optimizer step of TP-REKLS against the reference tensor-parallel scheme.

``python -m lowband.bench rekls --world 2``: the TP group is the whole world. A set of TP-sharded
matrices (``--shapes``, full sizes with their partition dim) gets fixed synthetic gradients; only
the optimizer step is timed, contenders alternating (median of the slowest rank).

Contenders:

* ``tp_rekls``: :class:`lowband.optim.tp_rekls.TpRekls`: eigenbases kept in state (row-sharded),
  each factor decomposed once per step by one owner rank, 2 batched collectives per step.
* ``reference``: :class:`ReferenceTpRekls`, the upstream TpRekls scheme (NVIDIA Emerging-Optimizers
  PR #175): per matrix three blocking all-gathers (gradient, L rows, R rows), then *every* rank
  decomposes every factor twice (``eigh`` of the pre-update factor to recover the basis, ``eigh``
  of the updated one) and computes the whole update. Same math functions, so after the same steps
  both contenders hold bitwise the same parameters (reported as ``max_abs_diff_vs_reference``).

Reported per contender: wire bytes per step per rank from the ledger, next to the reference
formula ``4 (T-1)/T (mn + m^2 + n^2)`` per matrix (``formula_bytes_per_step_per_rank``), and the
optimizer state bytes per rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from lowband.bench.harness import add_ratios, result_row, timed_alternating
from lowband.comm import Comm, CommLedger
from lowband.optim.rekls import (
    REKLS,
    ReklsHyper,
    apply_update_,
    eigh_descending,
    kl_factor_update,
    shampoo_beta_hat,
    update_direction,
)
from lowband.optim.tp_rekls import TpRekls, tp_rekls_wire_bytes


class ReferenceTpRekls(REKLS):
    """The upstream TpRekls scheme (reference baseline; every matrix must be TP-sharded).

    Communication per sharded matrix per step: three blocking all-gathers on ``tp_comm`` (gradient
    chunk, L rows, R rows), ``4 (T-1)/T (mn + m^2 + n^2)`` bytes per rank in fp32. Compute per rank:
    four ``eigh`` per matrix (two per factor) and the whole m x n update. State: full M, V
    (m x n), L rows (m/T x m), R rows (n/T x n); no eigenbasis. Partition dims come from the
    parameters' ``partition_dim`` attribute.
    """

    handles_sharded_axes = ("tp",)  # the upstream scheme handles TP slices itself

    def __init__(self, params: Any, lr: float, *, tp_comm: Comm, **kwargs: Any) -> None:
        super().__init__(params, lr, **kwargs)
        self.tp_comm = tp_comm

    def _gather(self, local: torch.Tensor, dim: int, tag: str) -> torch.Tensor:
        t = self.tp_comm.size
        buf = torch.empty((t, *local.shape), dtype=local.dtype, device=local.device)
        self.tp_comm.all_gather(buf, local.contiguous(), tag=tag)
        return torch.cat(list(buf.unbind(0)), dim=dim)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        t, me = self.tp_comm.size, self.tp_comm.rank
        for group in self.param_groups:
            h = ReklsHyper.from_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                pd = p.partition_dim
                shape = list(p.shape)
                shape[pd] *= t
                m, n = shape
                st = self.state[p]
                dtype = h.dtype_for(p)
                if not st:
                    st.update(step=0, exp_avg=torch.zeros(m, n, dtype=dtype, device=p.device),
                              exp_avg_sq=torch.zeros(m, n, dtype=dtype, device=p.device),
                              L=torch.zeros(m // t, m, dtype=dtype, device=p.device),
                              R=torch.zeros(n // t, n, dtype=dtype, device=p.device))
                k = st["step"] + 1
                G = self._gather(p.grad.to(dtype), pd, "ref:grad")
                L = self._gather(st["L"], 0, "ref:L")
                R = self._gather(st["R"], 0, "ref:R")
                ql_pre, lam_l = eigh_descending(L)  # eigh #1: recover the previous basis
                qr_pre, lam_r = eigh_descending(R)
                bh = shampoo_beta_hat(h.shampoo_beta, k)
                plain = h.first_step == "plain" and k == 1
                L_new = kl_factor_update(L, G, qr_pre, lam_r, bh, h.eps, plain)
                R_new = kl_factor_update(R, G.T, ql_pre, lam_l, bh, h.eps, plain)
                st["L"] = L_new[me * m // t:(me + 1) * m // t].clone()
                st["R"] = R_new[me * n // t:(me + 1) * n // t].clone()
                ql, _ = eigh_descending(L_new)  # eigh #2
                qr, _ = eigh_descending(R_new)
                u = update_direction(st, G, ql_pre, qr_pre, ql, qr, h, k)
                apply_update_(p, u.chunk(t, dim=pd)[me], h)
                st["step"] = k
        return None


QUICK = {"shapes": "32x32:0,32x16:1", "distinct_grads": 2}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="512x512:0,512x512:1,768x256:0,256x768:1",
                   help="comma-separated MxN:PD (full shape, partition dim 0 = column-, 1 = row-parallel)")
    p.add_argument("--contenders", default="tp_rekls,reference")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--distinct-grads", type=int, default=3, help="gradients cycled through")


def parse_shapes(spec: str) -> list[tuple[int, int, int]]:
    out = []
    for item in spec.split(","):
        try:
            dims, pd = item.split(":")
            m, n = dims.lower().split("x")
            out.append((int(m), int(n), int(pd)))
        except ValueError:
            raise ValueError(f"rekls suite: --shapes item {item!r} is not MxN:PD (e.g. 512x256:0)") from None
        if out[-1][2] not in (0, 1):
            raise ValueError(f"rekls suite: --shapes item {item!r}: partition dim must be 0 or 1")
    return out


def run(env: Any, opts: dict[str, Any]) -> dict[str, Any]:
    t, rank, dev = env.world_size, env.rank, env.device
    dtype = getattr(torch, opts["dtype"])
    shapes = parse_shapes(opts["shapes"])
    for m, n, _ in shapes:
        if m % t or n % t:
            raise ValueError(f"rekls suite: shape {m}x{n} is not divisible by the TP size {t}")
    names = [c for c in str(opts["contenders"]).split(",") if c]
    allowed = ("tp_rekls", "reference")
    if any(c not in allowed for c in names):
        raise ValueError(f"rekls suite: unknown contenders {names}; allowed: {', '.join(allowed)}")
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(m, n, generator=gen, dtype=torch.float64) * 0.02 for m, n, _ in shapes]
    grads = [[torch.randn(m, n, generator=gen, dtype=torch.float64).to(dtype)
              for _ in range(opts["distinct_grads"])] for m, n, _ in shapes]
    world = env.comm.group

    contenders: dict[str, tuple[torch.optim.Optimizer, list[torch.nn.Parameter], CommLedger]] = {}
    for name in names:
        ledger = CommLedger()
        comm = Comm(world, name="tp", ledger=ledger)
        params = []
        for (_m, _n, pd), d in zip(shapes, dense):
            p = torch.nn.Parameter(d.chunk(t, pd)[rank].to(dtype=dtype, device=dev).clone())
            p.partition_dim, p.tp_comm = pd, comm
            params.append(p)
        cls = TpRekls if name == "tp_rekls" else ReferenceTpRekls
        opt = cls(params, opts["lr"], tp_comm=comm)
        contenders[name] = (opt, params, ledger)

    counters = dict.fromkeys(names, 0)
    wire: dict[str, list[int]] = {n: [] for n in names}
    sync = torch.cuda.synchronize if dev.type == "cuda" else None

    def make(name: str) -> Callable[[], None]:
        opt, params, ledger = contenders[name]

        def fn() -> None:
            i = counters[name]
            for (_m, _n, pd), p, gs in zip(shapes, params, grads):
                p.grad = gs[i % len(gs)].chunk(t, pd)[rank].to(dev).contiguous()
            ledger.mark_step()
            opt.step()
            wire[name].append(sum(r.wire_bytes for r in ledger.step_records()
                                  if not r.tag.endswith("validate")))
            counters[name] = i + 1

        return fn

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = timed_alternating({n: make(n) for n in names}, opts["repeats"], opts["warmup"], env.comm,
                              sync=sync)
    esize = torch.empty((), dtype=dtype).element_size()
    full_shapes = [(m, n) for m, n, _ in shapes]
    expect = tp_rekls_wire_bytes(full_shapes, t, rank, esize)
    formula = sum(4 * (t - 1) * (m * n + m * m + n * n) // t for m, n in full_shapes)
    results = []
    for name in names:
        opt, params, _ = contenders[name]
        state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor))
        diff = None
        if "reference" in contenders and name != "reference" and counters[name] == counters["reference"]:
            ref_params = contenders["reference"][1]
            diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(params, ref_params))
        results.append(result_row(
            name, times[name], wire_bytes=max(wire[name][1:] or wire[name]),
            optimizer_state_bytes=state_bytes,
            peak_memory_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
            formula_bytes_per_step_per_rank=formula,
            expected_bytes_per_step_per_rank=expect["total"] if name == "tp_rekls" else expect["reference"],
            max_abs_diff_vs_reference=diff))
    add_ratios(results, {"tp_rekls": ["reference"]})
    return {"config": {"shapes": opts["shapes"], "dtype": opts["dtype"], "tp": t, "lr": opts["lr"],
                       "repeats": opts["repeats"], "warmup": opts["warmup"], "threads": opts["threads"]},
            "results": results}
