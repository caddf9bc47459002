"""``comm`` suite: each collective, torch-native against lowband's choice, at several sizes.

Per (op, size): ``torch`` calls the torch.distributed function directly (``reduce_scatter_single``,
``all_gather_single``, ``all_reduce``, ``all_to_all_single``); ``lowband`` calls :class:`Comm`, which
picks the algorithm per backend. Wire bytes are per rank: lowband's from its ledger (ring model);
torch-native reduce-scatter on gloo is an all-reduce underneath, so its bytes are counted as one.

``wire:<codec>`` (e.g. ``wire:topk-rice-int2``, any of ``lowband.comm.codecs.WIRE_CODECS``): the codec average
DiLoCo's outer sync runs (:func:`~lowband.comm.codecs.wire_all_reduce` with the error-feedback residual: encode,
exchange, decode every message, sum), against torch's fp32 ``all_reduce`` of the same buffer. Each rank's
input is its own seeded random tensor, copied in before every call (so no two ranks send the same message);
``--block-size``, ``--topk-chunk`` and ``--topk-k`` set the codec. The ratio is the codec's cost in time, its
wire bytes what it saves.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from lowband.bench.harness import add_ratios, result_row, timed_alternating
from lowband.comm import Comm, CommLedger, ring_wire_bytes
from lowband.comm.codecs import DEFAULT_BLOCK_SIZE, get_wire, wire_all_reduce
from lowband.comm.compress import DEFAULT_TOPK_CHUNK, DEFAULT_TOPK_K
from lowband.train.env import DistEnv

QUICK = {"sizes_mib": "0.0625"}
"""``--quick`` settings (lowband.bench.__main__.apply_quick)."""


OPS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="1,8,32", help="comma-separated buffer sizes in MiB")
    p.add_argument("--ops", default="reduce_scatter,all_gather,all_reduce,all_to_all",
                   help="comma-separated: reduce_scatter, all_gather, all_reduce, all_to_all, wire:<codec>")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="wire:<codec> scale block")
    p.add_argument("--topk-chunk", type=int, default=DEFAULT_TOPK_CHUNK, help="wire:topk* chunk")
    p.add_argument("--topk-k", type=int, default=DEFAULT_TOPK_K, help="wire:topk* values kept per chunk")


def validate_options(opts: dict[str, Any]) -> list[str]:
    """The ``--ops`` list; raises ``ValueError`` naming an unknown op, or a wire codec's bad name or settings
    (``python -m lowband.bench`` calls it before any rank starts: one line, exit 2)."""
    ops = [o for o in str(opts["ops"]).split(",") if o]
    for op in ops:
        if op.startswith("wire:"):
            get_wire(op.removeprefix("wire:"), block_size=opts["block_size"], topk_chunk=opts["topk_chunk"],
                     topk_k=opts["topk_k"])
        elif op not in OPS:
            raise ValueError(f"comm suite: unknown op {op!r}; allowed: {', '.join(OPS)}, wire:<codec>")
    return ops


def _torch_calls(op: str, full: torch.Tensor, chunk: torch.Tensor, out_full: torch.Tensor):
    if op.startswith("wire:"):
        return lambda: dist.all_reduce(full)
    if op == "reduce_scatter":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(chunk, full)
    if op == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(out_full, chunk)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out_full, full)
    raise ValueError(f"comm suite: unknown op {op!r}")


def _wire_call(op: str, comm: Comm, full: torch.Tensor, opts: dict[str, Any], rank: int):
    """``wire:<codec>``: the codec average with the error-feedback residual, on this rank's own seeded input."""
    codec = get_wire(op.removeprefix("wire:"), block_size=opts["block_size"], topk_chunk=opts["topk_chunk"],
                     topk_k=opts["topk_k"])
    src = torch.randn(full.numel(), generator=torch.Generator().manual_seed(1000 + rank)).to(full.device)
    work, residual = torch.empty_like(full), torch.empty_like(full)

    def call() -> None:
        work.copy_(src)
        wire_all_reduce(comm, work, codec, residual_out=residual)
    return call


def _lowband_calls(op: str, comm: Comm, full: torch.Tensor, chunk: torch.Tensor, out_full: torch.Tensor):
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(chunk, full)
    if op == "all_gather":
        return lambda: comm.all_gather(out_full, chunk)
    if op == "all_reduce":
        return lambda: comm.all_reduce(full)
    if op == "all_to_all":
        return lambda: comm.all_to_all(out_full, full)
    raise ValueError(f"comm suite: unknown op {op!r}")


def _torch_bytes(op: str, n: int, nbytes: int, backend: str) -> int:
    if op.startswith("wire:"):
        return ring_wire_bytes("all_reduce", n, nbytes)
    if op == "reduce_scatter" and "nccl" not in backend:
        return ring_wire_bytes("all_reduce", n, nbytes)  # gloo emulates RS with an all-reduce
    if op == "all_to_all":
        return (n - 1) * nbytes // n
    return ring_wire_bytes(op, n, nbytes)


def run(env: DistEnv, opts: dict[str, Any]) -> dict[str, Any]:
    n = env.world_size
    sizes = [float(s) for s in str(opts["sizes_mib"]).split(",") if s]
    ops = validate_options(opts)
    ledger = CommLedger()
    comm = Comm(name="world", ledger=ledger)
    timer = Comm(name="world", ledger=CommLedger())
    backend = str(dist.get_backend()) if dist.is_initialized() else "local"
    sync = (lambda: torch.cuda.synchronize(env.device)) if env.device.type == "cuda" else None
    results = []
    for mib in sizes:
        numel = int(mib * 2**20) // 4 // n * n
        full = torch.randn(numel, device=env.device)
        chunk = torch.empty(numel // n, device=env.device)
        out_full = torch.empty(numel, device=env.device)
        for op in ops:
            label = f"{op} {mib:g}MiB"
            mine = (_wire_call(op, comm, full, opts, env.rank) if op.startswith("wire:")
                    else _lowband_calls(op, comm, full, chunk, out_full))
            fns = {f"{label} torch": _torch_calls(op, full, chunk, out_full), f"{label} lowband": mine}
            ledger.reset()
            times = timed_alternating(fns, opts["repeats"], opts["warmup"], timer, sync)
            calls = opts["repeats"] + opts["warmup"]
            lb_bytes = ledger.wire_bytes() // max(calls, 1)
            algo = ledger.records[-1].algorithm if ledger.records else ""
            results.append(result_row(f"{label} torch", times[f"{label} torch"],
                                      wire_bytes=_torch_bytes(op, n, numel * 4, backend), op=op, size_mib=mib,
                                      algorithm="native"))
            results.append(result_row(f"{label} lowband", times[f"{label} lowband"], wire_bytes=lb_bytes, op=op,
                                      size_mib=mib, algorithm=algo))
            add_ratios(results, {f"{label} lowband": [f"{label} torch"]})
    codec_keys = {k: opts[k] for k in ("block_size", "topk_chunk", "topk_k")} if any(
        o.startswith("wire:") for o in ops) else {}
    return {"config": {"sizes_mib": sizes, "ops": ops, **codec_keys, "repeats": opts["repeats"],
                       "warmup": opts["warmup"],
                       "threads_per_rank": opts.get("threads"), "dtype": "float32",
                       "note": "step_time_s = seconds per call (slowest rank); ratio_vs = lowband/torch time"},
            "results": results}
