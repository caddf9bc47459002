"""Wire formats for the GTP weight all-gather: native, bf16, and fp8 e4m3 with per-block scales.

``fp8`` quantizes a weight in 2-D blocks of ``rows x cols`` elements, one fp32 scale per block
(``scale = amax / 448``, 1 for an all-zero block). A GTP shard holds ``shard_rows`` rows, a multiple
of ``rows``, so no block ever straddles a shard boundary: quantizing each shard and gathering equals
quantizing the (padded) full weight. A shard travels as one flat ``uint8`` *packet*:
``[fp8 payload (shard_rows * cols bytes) | fp32 scales viewed as bytes]``, so one all-gather carries
payload and scales and its ledger bytes count both.

Bytes per element on the wire: fp32 4, bf16 2, fp8 ``1 + 4 / (rows * cols)`` (e.g. 1.016 for 16x16
blocks, 1.004 for 32x32).

This module is pure math: it never calls a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowband.comm.comm import true_div

GATHER_FORMATS = ("native", "bf16", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class BlockSpec:
    """fp8 scaling block of ``rows x cols`` weight elements."""

    rows: int = 32
    cols: int = 32

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"fp8 block {name} must be a positive int, got {v!r}")


def check_format(fmt: str) -> str:
    if fmt not in GATHER_FORMATS:
        raise ValueError(f"gather_format {fmt!r} not in {GATHER_FORMATS}")
    return fmt


def row_alignment(fmt: str, block: BlockSpec) -> int:
    """Rows each shard must be a multiple of: ``block.rows`` for fp8, else 1."""
    return block.rows if check_format(fmt) == "fp8" else 1


def check_block_rule(fmt: str, block: BlockSpec, in_features: int, what: str) -> None:
    """Raise ``ValueError`` if a ``[*, in_features]`` weight cannot be padded to the block rule.

    Rows are always padded (GTP pads dim 0); columns are not sharded, so they must divide evenly.
    """
    if check_format(fmt) == "fp8" and in_features % block.cols:
        raise ValueError(f"{what}: in_features {in_features} is not a multiple of the fp8 block width "
                         f"{block.cols}; choose gtp fp8 block cols dividing it, or gather_format "
                         "'bf16' / 'native'")


def fp8_packet_bytes(rows: int, cols: int, block: BlockSpec) -> int:
    """Bytes of one packed fp8 shard of ``rows x cols`` (payload + fp32 scales)."""
    if rows % block.rows or cols % block.cols:
        raise ValueError(f"fp8 packet: shape ({rows}, {cols}) is not a multiple of block "
                         f"({block.rows}, {block.cols})")
    return rows * cols + (rows // block.rows) * (cols // block.cols) * 4


def fp8_quantize(w: torch.Tensor, block: BlockSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``w`` (shape a multiple of the block) to e4m3 with one fp32 scale per block.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn of ``w``'s shape, ``scales`` fp32
        ``[rows / block.rows, cols / block.cols]``.
    """
    r, c = w.shape
    if r % block.rows or c % block.cols:
        raise ValueError(f"fp8_quantize: shape ({r}, {c}) is not a multiple of block "
                         f"({block.rows}, {block.cols})")
    br, bc = block.rows, block.cols
    blocks = w.detach().to(torch.float32).reshape(r // br, br, c // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, true_div(amax, FP8_MAX), torch.ones_like(amax))  # true division on CUDA too
    q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(r, c), scales


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp8_bytes_to_float(u8: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (a flat ``uint8`` tensor) to fp32 through a 256-entry table: the same values as
    ``.to(torch.float32)``, about twice as fast on CPU."""
    table = _FP8_TABLES.get(u8.device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=u8.device).view(FP8_DTYPE).to(torch.float32)
        _FP8_TABLES[u8.device] = table
    return table.index_select(0, u8.reshape(-1).to(torch.int32))


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor, block: BlockSpec,
                   out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize` into ``out`` (or a new tensor of ``dtype``)."""
    r, c = q.shape
    br, bc = block.rows, block.cols
    vals = _fp8_bytes_to_float(q.contiguous().view(torch.uint8))
    deq = vals.view(r // br, br, c // bc, bc) * scales[:, None, :, None]
    if out is None:
        return deq.reshape(r, c).to(dtype)
    out.copy_(deq.reshape(r, c))
    return out


def fp8_pack(w: torch.Tensor, block: BlockSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize a shard and pack it as one flat ``uint8`` packet (payload then scale bytes)."""
    q, scales = fp8_quantize(w, block)
    r, c = w.shape
    nbytes = fp8_packet_bytes(r, c, block)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=w.device)
    if out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"fp8_pack: out must be {nbytes} uint8 bytes, got {out.numel()} {out.dtype}")
    out[: r * c].copy_(q.reshape(-1).view(torch.uint8))
    out[r * c:].copy_(scales.reshape(-1).view(torch.uint8))
    return out


def fp8_unpack_gathered(packets: torch.Tensor, n: int, shard_rows: int, cols: int, block: BlockSpec,
                        out: torch.Tensor) -> torch.Tensor:
    """Dequantize ``n`` concatenated packets (rank order) into ``out`` of shape ``[n*shard_rows, cols]``."""
    per = fp8_packet_bytes(shard_rows, cols, block)
    if packets.numel() != n * per:
        raise ValueError(f"fp8_unpack_gathered: {packets.numel()} bytes, expected {n} x {per}")
    payload = shard_rows * cols
    rows = n * shard_rows
    per_rank = packets.view(n, per)
    vals = _fp8_bytes_to_float(per_rank[:, :payload])  # rank r's rows land at r * shard_rows
    # contiguous copy: the scale bytes may sit at an offset that is not 4-byte aligned
    scales = per_rank[:, payload:].contiguous().view(torch.float32)
    scales = scales.reshape(rows // block.rows, cols // block.cols)
    shape4 = (rows // block.rows, block.rows, cols // block.cols, block.cols)
    if out.dtype == torch.float32 and out.is_contiguous():
        torch.mul(vals.view(shape4), scales[:, None, :, None], out=out.view(shape4))
    else:
        out.copy_((vals.view(shape4) * scales[:, None, :, None]).view(rows, cols))
    return out


def quantize_dequantize(w: torch.Tensor, fmt: str, block: BlockSpec) -> torch.Tensor:
    """What a weight looks like after travelling in ``fmt`` (reference for tests and docs)."""
    if check_format(fmt) == "native":
        return w.clone()
    if fmt == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    q, s = fp8_quantize(w, block)
    return fp8_dequantize(q, s, block, dtype=w.dtype)


def wire_bytes_per_element(fmt: str, dtype: torch.dtype, block: BlockSpec) -> float:
    """Bytes per gathered weight element in ``fmt`` for a ``dtype`` parameter (scales included)."""
    if check_format(fmt) == "native":
        return float(torch.empty((), dtype=dtype).element_size())
    if fmt == "bf16":
        return 2.0
    return 1.0 + 4.0 / (block.rows * block.cols)
