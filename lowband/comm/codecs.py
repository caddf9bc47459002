"""Wire codecs and the codec all-reduce: fp32, bf16, fp8 (e4m3) and int8 with per-block scales.

A :class:`Codec` turns a 2-D float tensor ``(rows, m)`` into a ``(rows, encoded_nbytes(m))`` uint8
tensor and back. Row layout: ``[payload | scales]``: ``m`` elements in the wire dtype, then, for the
scaled codecs, one fp32 scale per block of ``block_size`` consecutive elements (``m`` must be a
multiple of ``block_size``). Pure torch; the same code runs on CPU and CUDA tensors.

Round-trip error bounds, per element ``x`` (finite inputs), ``s`` = the block's scale:

==========  =====================  =========================================================
codec       bytes per element      ``|x - decode(encode(x))|`` at most
==========  =====================  =========================================================
``fp64``    8                      0
``fp32``    4                      0 for fp32 input; ``2^-24 |x|`` (+ fp32 underflow) for fp64
``bf16``    2                      ``2^-8 |x| + 2^-133``  (round to nearest even, 8-bit mantissa)
``fp8``     1 + 4/block_size       ``2^-4 |x| + 2^-10 s + 2^-20 |x|``, ``s = amax(block) / 448``
``int8``    1 + 4/block_size       ``s / 2 + 2^-20 |x|``, ``s = amax(block) / 127``
==========  =====================  =========================================================

(``fp8``: e4m3fn has a 3-bit mantissa, so relative rounding ``2^-4`` in its normal range and an
absolute ``2^-10`` (half its subnormal spacing ``2^-9``) below it, times the scale; ``int8``: symmetric
rounding to 255 levels. The ``2^-20 |x|`` term covers the fp32 division and multiplication by the
scale.) An all-zero block gets scale 1. Non-finite inputs give non-finite outputs (a block holding
one gets a NaN scale). The bounds hold for inputs inside the fp32 normal range, away from its ends (the
scale is computed and applied in fp32): a block whose amax is within about 1 % of the fp32 maximum (3.4e38)
can decode to inf, and its average with another block to NaN; an fp64 input beyond the fp32 range decodes
non-finite (the whole block for the scaled codecs); an input below about 1e-38 (fp32 subnormal, or a tiny
fp64 value) can decode to 0 with the scaled codecs. Gradients and pseudo-gradients live far from both ends.

Below 8 bits, top-k and their compositions (``int4``, ``int2``, ``topk``, ``topk-int4``,
``topk-int2``) are *message* codecs, in :mod:`lowband.comm.compress`, reduced by an all-gather of
the messages (:func:`~lowband.comm.compress.gather_all_reduce`). :func:`get_wire` returns either kind
by name, :func:`wire_all_reduce` reduces with either, :func:`wire_bytes_per_rank` states the exact
ledger bytes of one reduction, and both reductions can hand back the sender's own encoding error
(``residual_out``) for error feedback.

:func:`codec_all_reduce` reduces a flat tensor over a :class:`~lowband.comm.Comm` with a codec on the
wire: the buffer is padded to ``N`` chunks (each a multiple of the block size), every chunk encoded,
**all-to-all** of the encoded chunks (rank ``j`` receives chunk ``j`` from everyone), local decode and
sum in rank order in fp32 (fp64 for fp64 buffers), division by ``N`` for ``avg``, the reduced chunk
encoded again, **all-gather** of the encoded chunks, decode. Every rank ends with bitwise-identical
values. Bytes per rank: ``2 (N-1)/N`` of the encoded buffer (the ring all-reduce volume), recorded as
one ``all_to_all`` and one ``all_gather`` record. :func:`reference_all_reduce` computes the same result
in one process from all ranks' inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowband.comm.comm import Comm, CommHandle, all_finite, avg_divisor, true_div, true_div_
from lowband.comm.compress import (
    DEFAULT_TOPK_CHUNK,
    DEFAULT_TOPK_K,
    MESSAGE_CODECS,
    GatherHandle,
    MessageCodec,
    check_block_size,
    gather_all_reduce,
    get_message_codec,
    reference_gather_all_reduce,
)

CODECS = ("fp64", "fp32", "bf16", "fp8", "int8")
WIRE_CODECS = CODECS + MESSAGE_CODECS
"""Every wire format by name: the two-phase codecs, then the message codecs (below 8 bits, top-k)."""
LOSSLESS = ("fp64", "fp32")
DEFAULT_BLOCK_SIZE = 256


@dataclass(frozen=True)
class Codec:
    """One wire format.

    Attributes:
        name: one of ``CODECS``.
        wire_dtype: dtype of the payload elements.
        qmax: largest magnitude of the scaled payload (448 for e4m3, 127 for int8); ``None`` for
            the unscaled codecs.
        block_size: elements sharing one fp32 scale (1 for the unscaled codecs).
    """

    name: str
    wire_dtype: torch.dtype
    qmax: float | None
    block_size: int

    @property
    def scaled(self) -> bool:
        return self.qmax is not None

    def encoded_nbytes(self, m: int) -> int:
        """Bytes of one encoded row of ``m`` elements."""
        esize = torch.empty((), dtype=self.wire_dtype).element_size()
        return m * esize + (4 * (m // self.block_size) if self.scaled else 0)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` of shape ``(rows, m)`` (float) into ``(rows, encoded_nbytes(m))`` uint8."""
        if x.dim() != 2 or not x.is_floating_point():
            raise ValueError(f"Codec {self.name}: encode expects a 2-D float tensor, got shape "
                             f"{tuple(x.shape)} dtype {x.dtype}")
        rows, m = x.shape
        if not self.scaled:
            return x.to(self.wire_dtype).contiguous().view(torch.uint8).reshape(rows, -1)
        b = self.block_size
        if m % b:
            raise ValueError(f"Codec {self.name}: row length {m} is not a multiple of block_size {b}")
        xb = x.to(torch.float32).reshape(rows, m // b, b)
        amax = xb.abs().amax(dim=2)
        if not all_finite(xb):  # keep a block's non-finite value visible in its scale
            amax = torch.where(torch.isfinite(xb).all(dim=2), amax, torch.full_like(amax, float("nan")))
        scale = true_div(amax, self.qmax)  # true division on CUDA too (bitwise as on CPU)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = xb / scale.unsqueeze(2)
        if self.name == "fp8":
            q = q.clamp(-self.qmax, self.qmax).to(self.wire_dtype)
        else:
            q = q.round().clamp(-self.qmax, self.qmax).to(self.wire_dtype)
        payload = q.reshape(rows, m).view(torch.uint8)
        scales = scale.contiguous().view(torch.uint8).reshape(rows, -1)
        return torch.cat([payload, scales], dim=1)

    def decode(self, buf: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode ``(rows, encoded_nbytes(m))`` uint8 into ``(rows, m)`` of ``dtype``."""
        rows = buf.shape[0]
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.encoded_nbytes(m):
            raise ValueError(f"Codec {self.name}: decode expects uint8 of shape "
                             f"({rows}, {self.encoded_nbytes(m)}), got {tuple(buf.shape)} {buf.dtype}")
        buf = buf.contiguous()
        if not self.scaled:
            return buf.view(self.wire_dtype).to(dtype)
        esize = torch.empty((), dtype=self.wire_dtype).element_size()
        payload = buf[:, : m * esize].contiguous().view(self.wire_dtype)
        scales = buf[:, m * esize:].contiguous().view(torch.float32)
        b = self.block_size
        x = payload.to(torch.float32).reshape(rows, m // b, b) * scales.unsqueeze(2)
        return x.reshape(rows, m).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on ``|x - decode(encode(x))|`` for ``x`` of shape ``(rows, m)``."""
        ax = x.abs().to(torch.float64)
        if self.name == "fp64" or (self.name == "fp32" and x.dtype != torch.float64):
            return torch.zeros_like(ax)
        if self.name == "fp32":
            return ax * 2.0**-24 + 2.0**-150
        if self.name == "bf16":
            return ax * 2.0**-8 + 2.0**-133
        rows, m = x.shape
        b = self.block_size
        amax = ax.reshape(rows, m // b, b).amax(dim=2, keepdim=True)
        s = (amax / self.qmax).expand(rows, m // b, b).reshape(rows, m)
        if self.name == "fp8":
            return ax * (2.0**-4 + 2.0**-20) + s * 2.0**-10
        return s / 2 + ax * 2.0**-20


def get_codec(name: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """The codec called ``name`` (``fp64``, ``fp32``, ``bf16``, ``fp8``, ``int8``).

    Raises:
        ValueError: unknown name, or ``block_size`` not a positive multiple of 4 (scaled codecs).
    """
    if name not in CODECS:
        raise ValueError(f"wire codec {name!r} is not supported; allowed: {list(CODECS)}")
    if name in ("fp8", "int8"):
        check_block_size(block_size)
    if name == "fp64":
        return Codec("fp64", torch.float64, None, 1)
    if name == "fp32":
        return Codec("fp32", torch.float32, None, 1)
    if name == "bf16":
        return Codec("bf16", torch.bfloat16, None, 1)
    if name == "fp8":
        return Codec("fp8", torch.float8_e4m3fn, 448.0, block_size)
    return Codec("int8", torch.int8, 127.0, block_size)


def chunk_layout(numel: int, n: int, codec: Codec) -> int:
    """Elements per rank chunk: ``ceil(numel / n)`` rounded up to a multiple of the block size."""
    b = codec.block_size
    chunk = -(-numel // n)
    return max(b, -(-chunk // b) * b)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class CodecHandle:
    """Two-phase completion handle of :func:`codec_all_reduce`.

    Phase 1 is the all-to-all of encoded chunks (issued at creation). :meth:`poll` (never blocks)
    moves to phase 2 once phase 1 has completed: local decode + sum + re-encode, then the all-gather
    is issued asynchronously. :meth:`wait` blocks through both phases and returns the reduced tensor.
    Phase 2 is issued by ``poll`` or ``wait``, whichever comes first. The all-gathers of one group must be
    issued in the same order on every rank, so callers wait for their handles in order and poll them in
    order **stopping at the first that returns False** (as :class:`~lowband.diloco.StreamingDiLoCo`
    does): a later handle's phase 1 can complete before an earlier one's (gloo runs asynchronous work
    on several threads), and polling past a pending handle would issue the later phase 2 first on one
    rank and second on another, pairing different collectives (a size-mismatch abort in gloo, or
    silently mixed data when the sizes agree).
    """

    def __init__(self, first: CommHandle, reduce_local, finish) -> None:
        self._first = first
        self._reduce_local = reduce_local
        self._finish = finish
        self._second: CommHandle | None = None
        self._done = False
        self.result: torch.Tensor | None = None

    def poll(self) -> bool:
        """Advance without blocking; True once phase 2 has been issued."""
        if self._second is None and self._first.is_completed():
            self._first.wait()
            self._second = self._reduce_local()
        return self._second is not None

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._second is None:
                self._first.wait()
                self._second = self._reduce_local()
            self._second.wait()
            self.result = self._finish()
            self._done = True
        return self.result  # type: ignore[return-value]

    def is_completed(self) -> bool:
        return self._done


def codec_all_reduce(comm: Comm, flat: torch.Tensor, codec: Codec, *, op: str = "avg",
                     async_op: bool = False, tag: str = "",
                     residual_out: torch.Tensor | None = None, avg_over: int | None = None) -> CodecHandle:
    """Reduce the 1-D float tensor ``flat`` in place over ``comm`` with ``codec`` on the wire.

    Communication: one all-to-all of the encoded chunks (issued now; asynchronous with
    ``async_op=True``) and one all-gather of the encoded reduced chunks (issued asynchronously by
    :meth:`CodecHandle.poll` once the all-to-all is done, or by ``wait()``). Both records carry
    ``tag``. With one rank nothing is sent, but the values still go through the codec twice, so the
    numerics do not depend on the world size.

    Args:
        comm: the group to reduce over.
        flat: contiguous 1-D float32/float64 tensor (any length; padded internally).
        codec: the wire format (see :func:`get_codec`).
        op: ``"sum"`` or ``"avg"``.
        async_op: return before the collectives complete.
        tag: ledger tag of both collectives.
        residual_out: if given (shape and dtype of ``flat``), receives ``flat - decode(encode(flat))``
            of this rank's own phase-1 encoding (its chunk layout over ``N`` ranks), before the exchange.
        avg_over: ``op="avg"`` divides the sum by this many instead of ``N`` (an average over the ranks
            that contributed, when the others send zeros: fault-tolerant DiLoCo's healed replicas).
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"codec_all_reduce: op {op!r} not in ('sum', 'avg')")
    divisor = avg_divisor(op, avg_over, comm.size, "codec_all_reduce")
    if flat.dim() != 1 or not flat.is_contiguous() or not flat.is_floating_point():
        raise ValueError("codec_all_reduce: flat must be a contiguous 1-D float tensor")
    n = comm.size
    numel = flat.numel()
    chunk = chunk_layout(numel, n, codec)
    acc_dtype = _acc_dtype(flat.dtype)
    padded = torch.zeros(n * chunk, dtype=flat.dtype, device=flat.device)
    padded[:numel].copy_(flat)
    send = codec.encode(padded.view(n, chunk))
    if residual_out is not None:
        own = codec.decode(send, chunk, flat.dtype).reshape(-1)[:numel]
        torch.sub(flat, own, out=residual_out)
    recv = torch.empty_like(send)
    first = comm.all_to_all(recv, send, async_op=True, tag=tag)
    gathered = torch.empty(n, codec.encoded_nbytes(chunk), dtype=torch.uint8, device=flat.device)

    def reduce_local() -> CommHandle:
        parts = codec.decode(recv, chunk, acc_dtype)
        acc = parts[0].clone()
        for i in range(1, n):
            acc.add_(parts[i])
        if divisor is not None:
            true_div_(acc, divisor)
        mine = codec.encode(acc.view(1, chunk))
        return comm.all_gather(gathered, mine, async_op=True, tag=tag)

    def finish() -> torch.Tensor:
        out = codec.decode(gathered, chunk, flat.dtype).reshape(-1)
        flat.copy_(out[:numel])
        return flat

    handle = CodecHandle(first, reduce_local, finish)
    if not async_op:
        handle.wait()
    return handle


def reference_all_reduce(inputs: Sequence[torch.Tensor], codec: Codec, op: str = "avg",
                         avg_over: int | None = None) -> torch.Tensor:
    """Single-process reference of :func:`codec_all_reduce`: what every rank ends with.

    Args:
        inputs: rank-ordered 1-D tensors (one per rank, same length and dtype).
        codec: the wire format.
        op: ``"sum"`` or ``"avg"``.
        avg_over: as in :func:`codec_all_reduce`.
    """
    n = len(inputs)
    divisor = avg_divisor(op, avg_over, n, "reference_all_reduce")
    numel = inputs[0].numel()
    dtype = inputs[0].dtype
    chunk = chunk_layout(numel, n, codec)
    acc_dtype = _acc_dtype(dtype)
    acc = None
    for x in inputs:
        padded = torch.zeros(n * chunk, dtype=dtype, device=x.device)
        padded[:numel].copy_(x.reshape(-1))
        dec = codec.decode(codec.encode(padded.view(n, chunk)), chunk, acc_dtype)
        acc = dec if acc is None else acc.add_(dec)
    assert acc is not None
    if divisor is not None:
        true_div_(acc, divisor)
    out = codec.decode(codec.encode(acc), chunk, dtype).reshape(-1)
    return out[:numel].clone()


class CodecReduceScatterHandle:
    """Completion handle of :func:`codec_reduce_scatter`: :meth:`wait` waits for the all-to-all, then
    decodes and sums the received chunks into the output (once) and returns it."""

    def __init__(self, first: CommHandle, finish) -> None:
        self._first = first
        self._finish = finish
        self._done = False
        self.result: torch.Tensor | None = None

    def is_completed(self) -> bool:
        """Whether the output is in place; once the all-to-all is done the local decode and sum run here."""
        if not self._done and self._first.is_completed():
            self.wait()
        return self._done

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._first.wait()
            self.result = self._finish()
            self._done = True
        return self.result  # type: ignore[return-value]


def codec_reduce_scatter(comm: Comm, output: torch.Tensor, input: torch.Tensor, codec: Codec, *,
                         op: str = "avg", async_op: bool = False, tag: str = "") -> CodecReduceScatterHandle:
    """``output`` (this rank's chunk) = reduction over ranks of chunk ``rank`` of ``input``, with
    ``codec`` on the wire: the first half of :func:`codec_all_reduce`.

    ``input`` holds ``N`` equal contiguous chunks of ``output.numel()`` elements (any float dtype);
    each chunk is zero-padded to a multiple of the codec's block size and encoded, **one all-to-all**
    sends chunk ``j`` to rank ``j``, and the owner decodes the ``N`` chunks it received and sums them in
    rank order in fp32 (fp64 for a fp64 output), divided by ``N`` for ``avg``, into ``output``. Bytes
    per rank: ``(N-1)/N`` of the encoded buffer, ``N * encoded_nbytes(chunk)``; one ``all_to_all``
    ledger record with ``tag``. With one rank nothing is sent, but the values still go through the
    codec, so the numerics do not depend on the world size. :func:`reference_reduce_scatter` computes
    the same in one process.

    Args:
        comm: the group.
        output: contiguous, this rank's reduced chunk (written when the handle is waited for).
        input: contiguous, ``N * output.numel()`` elements (read before this returns: free to reuse).
        codec: the wire format (:func:`get_codec`).
        op: ``"sum"`` or ``"avg"``.
        async_op: return before the all-to-all completes.
        tag: ledger tag.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"codec_reduce_scatter: op {op!r} not in ('sum', 'avg')")
    n = comm.size
    shard = output.numel()
    if input.numel() != n * shard:
        raise ValueError(f"codec_reduce_scatter: input has {input.numel()} elements, expected {n} x {shard} "
                         "(group size x output)")
    if not (input.is_contiguous() and output.is_contiguous()) or not input.is_floating_point():
        raise ValueError("codec_reduce_scatter: input and output must be contiguous float tensors")
    send = codec.encode(_padded_chunks(input.view(n, shard), codec))
    chunk = chunk_layout(shard, 1, codec)
    recv = torch.empty_like(send)
    first = comm.all_to_all(recv, send, async_op=True, tag=tag)

    def finish() -> torch.Tensor:
        parts = codec.decode(recv, chunk, _acc_dtype(output.dtype))
        acc = parts[0].clone()
        for i in range(1, n):
            acc.add_(parts[i])
        if op == "avg":
            true_div_(acc, n)
        output.view(-1).copy_(acc[:shard])
        return output

    handle = CodecReduceScatterHandle(first, finish)
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter_error(input: torch.Tensor, n: int, codec: Codec) -> torch.Tensor:
    """This rank's encoding error in a :func:`codec_reduce_scatter` of ``input`` over ``n`` ranks:
    ``input - decoded``, where ``decoded`` is exactly what the ``n`` owners decode from this rank's
    message (each chunk padded and encoded on its own, decoded in fp32, fp64 for fp64 input). Same
    shape as ``input``, in the accumulation dtype (fp32, fp64 for fp64 input). Error feedback adds it to
    the next input (:class:`lowband.optim.ShardedOptimizer` ``grad_error_feedback``)."""
    shard = input.numel() // n
    if input.numel() != n * shard:
        raise ValueError(f"reduce_scatter_error: input has {input.numel()} elements, not a multiple of {n}")
    acc = _acc_dtype(input.dtype)
    dec = _owners_decode(input.reshape(n, shard), codec, acc)
    return (input.reshape(n, shard).to(acc) - dec[:, :shard]).reshape(input.shape)


def _owners_decode(chunks: torch.Tensor, codec: Codec, dtype: torch.dtype) -> torch.Tensor:
    """``(N, shard)`` -> ``(N, chunk)``: what the owners decode (in ``dtype``) of one rank's
    :func:`codec_reduce_scatter` message, row ``j`` at rank ``j`` (each row padded and encoded on its own)."""
    return codec.decode(codec.encode(_padded_chunks(chunks, codec)), chunk_layout(chunks.shape[1], 1, codec), dtype)


def _padded_chunks(chunks: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``(N, shard)`` -> ``(N, chunk)`` zero-padded to a multiple of the codec's block size."""
    n, shard = chunks.shape
    chunk = chunk_layout(shard, 1, codec)
    if chunk == shard:
        return chunks
    padded = torch.zeros(n, chunk, dtype=chunks.dtype, device=chunks.device)
    padded[:, :shard].copy_(chunks)
    return padded


def reference_reduce_scatter(inputs: Sequence[torch.Tensor], codec: Codec, op: str = "avg",
                             out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Single-process reference of :func:`codec_reduce_scatter`: every rank's output chunk.

    Args:
        inputs: rank-ordered 1-D tensors of ``N * shard`` elements each.
        codec: the wire format.
        op: ``"sum"`` or ``"avg"``.
        out_dtype: the outputs' dtype (default the inputs').
    """
    n = len(inputs)
    shard = inputs[0].numel() // n
    out_dtype = out_dtype or inputs[0].dtype
    acc = None
    for x in inputs:  # rows encode independently: row j is what this rank sends to rank j
        dec = _owners_decode(x.reshape(n, shard), codec, _acc_dtype(out_dtype))
        acc = dec if acc is None else acc.add_(dec)
    assert acc is not None
    if op == "avg":
        true_div_(acc, n)
    return [acc[j, :shard].to(out_dtype) for j in range(n)]


def reduce_scatter_wire_bytes(codec: Codec, shard: int, n: int) -> int:
    """Ledger wire bytes per rank of one :func:`codec_reduce_scatter` of ``n`` chunks of ``shard``."""
    if n == 1:
        return 0
    return (n - 1) * codec.encoded_nbytes(chunk_layout(shard, 1, codec))


WireCodec = Codec | MessageCodec


def get_wire(name: str, block_size: int = DEFAULT_BLOCK_SIZE, topk_chunk: int = DEFAULT_TOPK_CHUNK,
             topk_k: int = DEFAULT_TOPK_K) -> WireCodec:
    """Any wire format by name (``WIRE_CODECS``): a :class:`Codec` or a message codec.

    Raises:
        ValueError: unknown name (listing every allowed one) or bad ``block_size`` / top-k settings.
    """
    check_wire(name)
    if name in CODECS:
        return get_codec(name, block_size)
    return get_message_codec(name, block_size, topk_chunk, topk_k)


def check_wire(name: str, *, allowed: Sequence[str] = WIRE_CODECS, what: str = "wire codec") -> None:
    """Raise ``ValueError`` unless ``name`` is one of ``allowed`` (by default every wire format,
    ``WIRE_CODECS``), the message calling it ``what`` (the trainer: ``diloco.wire``, which offers every format
    but ``fp64``). The one check of a wire format's name: :func:`get_wire`,
    :class:`lowband.diloco.StreamingDiLoCo` and the trainer's config validation call it."""
    if name not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {name!r}")


def wire_all_reduce(comm: Comm, flat: torch.Tensor, codec: WireCodec, *, op: str = "avg",
                    async_op: bool = False, tag: str = "",
                    residual_out: torch.Tensor | None = None,
                    avg_over: int | None = None) -> CodecHandle | GatherHandle:
    """:func:`codec_all_reduce` for a :class:`Codec`, :func:`~lowband.comm.compress.gather_all_reduce`
    for a message codec (same arguments, same guarantees: bitwise-identical results on every rank)."""
    if isinstance(codec, Codec):
        return codec_all_reduce(comm, flat, codec, op=op, async_op=async_op, tag=tag, residual_out=residual_out,
                                avg_over=avg_over)
    return gather_all_reduce(comm, flat, codec, op=op, async_op=async_op, tag=tag, residual_out=residual_out,
                             avg_over=avg_over)


def reference_wire_all_reduce(inputs: Sequence[torch.Tensor], codec: WireCodec, op: str = "avg",
                              avg_over: int | None = None) -> torch.Tensor:
    """Single-process reference of :func:`wire_all_reduce`: what every rank ends with."""
    if isinstance(codec, Codec):
        return reference_all_reduce(inputs, codec, op, avg_over)
    return reference_gather_all_reduce(inputs, codec, op, avg_over)


def wire_bytes_per_rank(codec: WireCodec, numel: int, n: int) -> int:
    """Exact ledger wire bytes per rank of one :func:`wire_all_reduce` of ``numel`` elements over ``n``.

    Two-phase codec: ``2 (N-1)/N`` of the encoded padded buffer (all-to-all + all-gather); message
    codec: ``(N-1) * message_nbytes(numel)`` (all-gather).
    """
    if n == 1:
        return 0
    if isinstance(codec, Codec):
        chunk = chunk_layout(numel, n, codec)
        per_chunk = codec.encoded_nbytes(chunk)
        return 2 * (n - 1) * per_chunk
    return (n - 1) * codec.message_nbytes(numel)


def is_lossless(codec: WireCodec, dtype: torch.dtype) -> bool:
    """Whether ``codec`` carries ``dtype`` values exactly (then error feedback has nothing to keep)."""
    return codec.name == "fp64" or (codec.name == "fp32" and dtype == torch.float32)


def sender_roundtrip(codec: WireCodec, flat: torch.Tensor, n: int) -> torch.Tensor:
    """``decode(encode(flat))`` of a sender's own encoding in :func:`wire_all_reduce` over ``n`` ranks
    (the two-phase codecs encode chunk by chunk of the ``n``-rank layout); ``flat - `` this is the
    ``residual_out`` of the reduction. Single-process; for references and tests."""
    numel = flat.numel()
    if isinstance(codec, Codec):
        chunk = chunk_layout(numel, n, codec)
        padded = torch.zeros(n * chunk, dtype=flat.dtype, device=flat.device)
        padded[:numel].copy_(flat.reshape(-1))
        return codec.decode(codec.encode(padded.view(n, chunk)), chunk, flat.dtype).reshape(-1)[:numel]
    return codec.decode(codec.encode(flat.reshape(-1)), numel, flat.dtype)
