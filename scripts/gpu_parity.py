"""CUDA against CPU for lowband's device-sensitive kernels (one GPU; run by scripts/gpu_check.sh, part "parity").

``python scripts/gpu_parity.py [--numel N]`` prints one line per check and exits 1 if a bitwise check fails:

* every wire codec (lowband.comm.codecs.WIRE_CODECS): the encoded bytes of the same float32 input on CUDA and
  on CPU are identical, and so are the decoded values (the codecs promise bitwise-identical results on every
  rank, which must hold for a job whose ranks mix devices, or a CPU reference of a GPU run); plus the CUDA
  encode / decode time of N elements (median of 10, CUDA events);
* GTP's fp8 gather packet (``lowband.parallel.gtp_quant.fp8_pack``): bitwise equal on CUDA and CPU;
* AdamW (``lowband.optim.adamw.adamw_update_``) 5 steps on CUDA vs CPU: max |difference| of the parameters
  (elementwise fp32 arithmetic: expected 0 or a few ulps where CUDA fuses multiply-adds);
* Muon's ``orthogonalize`` (NS5) of a 1024x4096 matrix in float32 and bfloat16: max |difference| CUDA vs CPU
  and the CUDA time (matrix products: reduction order differs, so not bitwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from lowband.comm.codecs import WIRE_CODECS, Codec, chunk_layout, get_wire
from lowband.optim.adamw import adamw_update_
from lowband.optim.muon import orthogonalize


def cuda_ms(fn, repeats: int = 10) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def codec_parity(numel: int) -> bool:
    ok = True
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, 2, numel)[torch.randperm(numel, generator=g)]
    for name in WIRE_CODECS:
        codec = get_wire(name)
        if isinstance(codec, Codec):  # a two-phase codec encodes (rows, m) padded to its blocks
            m = chunk_layout(numel, 1, codec)
            padded = torch.zeros(m)
            padded[:numel] = x
            xs = padded.view(1, m)
        else:
            m, xs = numel, x

        def dec(b, c=codec, m=m):
            return c.decode(b, m, torch.float32)

        xg = xs.cuda()
        b_cpu, bg = codec.encode(xs), codec.encode(xg)
        same_bytes = torch.equal(b_cpu, bg.cpu())
        same_vals = torch.equal(dec(b_cpu), dec(bg).cpu())
        t_enc, t_dec = cuda_ms(lambda t=xg, c=codec: c.encode(t)), cuda_ms(lambda b=bg, d=dec: d(b))
        ok &= same_bytes and same_vals
        verdict = f"bytes {'equal' if same_bytes else 'DIFFER'}  decoded {'equal' if same_vals else 'DIFFER'}"
        print(f"codec {name:10s} {verdict}"
              f"  cuda encode {t_enc:7.3f} ms  decode {t_dec:7.3f} ms  ({numel:,} elements, {b_cpu.numel():,} bytes)")
    return ok


def gtp_fp8_parity() -> bool:
    from lowband.parallel.gtp_quant import BlockSpec, fp8_pack

    g = torch.Generator().manual_seed(3)
    w = torch.randn(1024, 1024, generator=g) * torch.logspace(-3, 1, 1024)[:, None]
    block = BlockSpec(32, 32)
    cpu, gpu = fp8_pack(w, block), fp8_pack(w.cuda(), block)
    same = torch.equal(cpu, gpu.cpu())
    print(f"gtp fp8 gather packing 1024x1024, 32x32 blocks: {'equal' if same else 'DIFFER'} on CUDA and CPU")
    return same


def adamw_parity() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.randn(1 << 20, generator=g)
    grads = [torch.randn(1 << 20, generator=g) for _ in range(5)]
    out = []
    for dev in ("cpu", "cuda"):
        q, m, v = p.to(dev).clone(), torch.zeros(1 << 20, device=dev), torch.zeros(1 << 20, device=dev)
        for step, gr in enumerate(grads, 1):
            adamw_update_(q, gr.to(dev), m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        out.append(q.cpu())
    d = (out[0] - out[1]).abs().max().item()
    eps = torch.finfo(torch.float32).eps
    print(f"adamw 5 steps, 1M fp32 elements: max |cuda - cpu| = {d:.3e} (fp32 ulp at 1: {eps:.1e})")


def muon_parity() -> None:
    g = torch.Generator().manual_seed(2)
    m = torch.randn(1024, 4096, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = orthogonalize(m, dtype=dtype).float()
        gm = m.cuda()
        gpu = orthogonalize(gm, dtype=dtype).float().cpu()
        ms = cuda_ms(lambda x=gm, dt=dtype: orthogonalize(x, dtype=dt))
        print(f"muon ns5 1024x4096 {dtype!s:15s}: max |cuda - cpu| = {(cpu - gpu).abs().max().item():.3e}, "
              f"cuda {ms:.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 24)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_parity: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    ok = codec_parity(args.numel)
    ok &= gtp_fp8_parity()
    adamw_parity()
    muon_parity()
    print("gpu_parity:", "codecs bitwise equal on CUDA and CPU" if ok else "A CODEC DIFFERS between CUDA and CPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
