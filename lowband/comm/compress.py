"""Compressing message codecs below 8 bits: int4 / int2 with per-block scales, chunked top-k, and top-k
followed by low-bit values; and the gather all-reduce that carries them.

A :class:`MessageCodec` turns a 1-D float tensor of ``m`` elements into one flat uint8 *message* of
exactly :meth:`~MessageCodec.message_nbytes` ``(m)`` bytes (a function of ``m`` and the codec alone, so
every rank's message has the same length) and back. Pure torch; CPU and CUDA alike.

Codecs and their message layouts (``B`` = scale block, ``C`` = top-k chunk, ``k`` = values kept per
chunk, ``nb = ceil(m / B)``, ``nc = ceil(m / C)``, ``bits(C) = log2 C``):

===============  ==============================================  ==========================================
codec            message                                          bytes for ``m`` elements
===============  ==============================================  ==========================================
``int4``         ``[codes: 4 bits each | scales: fp32 per block]``  ``nb B / 2 + 4 nb``
``int2``         ``[codes: 2 bits each | scales: fp32 per block]``  ``nb B / 4 + 4 nb``
``topk``         ``[offsets: log2 C bits each | values: fp32]``     ``ceil(nc k log2C / 8) + 4 nc k``
``topk-int4``    ``[offsets | int4 message of the nc k values]``    ``ceil(nc k log2C / 8) + int4(nc k)``
``topk-int2``    ``[offsets | int2 message of the nc k values]``    ``ceil(nc k log2C / 8) + int2(nc k)``
``topk-rice*``   ``[Rice-coded offsets | values as above]``         ``ceil(nc S / 8) + values(nc k)``
===============  ==============================================  ==========================================

``topk-rice``, ``topk-rice-int4``, ``topk-rice-int2``: the same selection and values, the offsets of each chunk
Rice-coded in a fixed slot of ``S = k (r + 1) + ((C - k) >> r)`` bits (:mod:`lowband.comm.rice`; ``r`` the
parameter that makes ``S`` smallest), lossless, so they decode bitwise what ``topk*`` decodes; where ``S`` is not
below ``k log2 C`` (a few values per chunk, e.g. ``k = 1``) the offsets stay fixed-width (``S = k log2 C``).
``C = 4096, k = 32``: 287 bits per chunk against 384; ``C = 256, k = 8``: 55 against 64.

**Low-bit values** (``int4``, ``int2``): a uniform *mid-rise* grid of ``L = 2^b`` levels
``(j - (L-1)/2) s``, ``j = 0..L-1``, with ``s = amax(block) / ((L-1)/2)`` (fp32, one per block of
``B`` consecutive elements); round to nearest (ties to even). The grid has no zero level, so a
non-finite input makes its block's scale non-finite and every decoded value of the block non-finite;
an all-zero block has scale 0 and decodes to exact zeros. Bound per element:
``|x - decode(encode(x))| <= s / 2 + 2^-20 amax(block)`` (the second term covers the fp32 division,
rounding and multiplication; inputs are reduced in fp32, fp64 inputs are first rounded to fp32,
adding ``2^-24 |x|``).

**Top-k** (``topk*``): the message splits ``x`` (zero-padded to ``nc C``) into chunks of ``C``
elements (a power of two, at most 65536) and keeps the ``k`` largest magnitudes of each chunk; their
positions travel as ``log2 C``-bit offsets inside the chunk (``C = 256``: one byte per kept value),
their values in fp32 (``topk``) or as one int4 / int2 message over the ``nc k`` kept values in chunk
order (scale block ``B``). Every other element decodes to 0, so its error is ``|x|``, at most the
``k``-th largest magnitude of its chunk; kept values carry the value codec's error (0 for fp32 input
with fp32 values). ``k = C`` keeps everything: with fp32 values the decode is exact. Non-finite
inputs are kept first (``topk`` ranks NaN and inf above every finite value), up to ``k`` of them per chunk:
a chunk holding any decodes non-finite (so a non-finite guard downstream still fires), but beyond ``k`` in
one chunk the rest decode to 0.

:func:`gather_all_reduce` averages (or sums) a flat tensor over a :class:`~lowband.comm.Comm` with a
message codec: each rank encodes its own message, one **all-gather** of the messages, then every rank
decodes the ``N`` messages and adds them **in rank order** in fp32 (fp64 for fp64 buffers) and divides
by ``N`` for ``avg``. Every rank decodes the same bytes in the same order, so all end with
bitwise-identical results, equal to the mean of the decoded messages (no second lossy encode).
Wire bytes per rank: ``(N-1) * message_nbytes(m)`` (the ring all-gather volume), one ``all_gather``
record of ``uint8``. For ``N = 2`` that equals the ``2 (N-1)/N`` all-reduce volume of the message;
for larger ``N`` it grows as ``N - 1`` (the price of decoding every message exactly, as SparseLoCo and
DeMo do). Optional ``residual_out`` receives ``x - decode(encode(x))`` of this rank's own message:
what error feedback keeps. A rank decodes its own message without parsing it back
(:meth:`TopKCodec.encode_with_decoder`: the offsets are its selection's, only the values are decoded), bitwise
what its peers decode from the same bytes; that one decode serves the residual and the sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lowband.comm.comm import Comm, CommHandle, avg_divisor, true_div, true_div_
from lowband.comm.rice import decode_offsets, encode_offsets, rice_parameter, slot_bits

LOWBIT = {"int4": 4, "int2": 2}
MESSAGE_CODECS = ("int4", "int2", "topk", "topk-int4", "topk-int2", "topk-rice", "topk-rice-int4",
                  "topk-rice-int2")
DEFAULT_TOPK_CHUNK = 256
DEFAULT_TOPK_K = 8


def default_error_feedback(wire: str) -> bool:
    """Error feedback's default (``error_feedback=None``, the trainer's ``"auto"``): on for the message codecs,
    off for the two-phase ones (fp32/bf16/fp8/int8, which stay torchft-equal)."""
    return wire in MESSAGE_CODECS


# ----------------------------------------------------------------------------------------- bits
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the 1-D integer ``codes`` (each in ``[0, 2^bits)``) little-endian into ``ceil(n bits / 8)`` bytes."""
    n = codes.numel()
    nbytes = -(-n * bits // 8)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int64)
    bitv = ((codes.reshape(-1, 1).to(torch.int64) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = nbytes * 8 - bitv.numel()
    if pad:
        bitv = torch.cat([bitv, torch.zeros(pad, dtype=torch.uint8, device=codes.device)])
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int64))
    return (bitv.reshape(nbytes, 8).to(torch.int64) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes of ``bits`` bits each, as int64."""
    shifts = torch.arange(8, device=buf.device, dtype=torch.int64)
    bitv = ((buf.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1)[: n * bits]
    weights = (1 << torch.arange(bits, device=buf.device, dtype=torch.int64))
    return (bitv.reshape(n, bits) * weights).sum(dim=1)


# --------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class LowBitCodec:
    """``int4`` / ``int2``: mid-rise uniform grid, fp32 scale per block of ``block_size`` elements."""

    name: str
    bits: int
    block_size: int

    @property
    def half_levels(self) -> float:
        return (2**self.bits - 1) / 2

    def message_nbytes(self, m: int) -> int:
        nb = -(-m // self.block_size)
        return -(-nb * self.block_size * self.bits // 8) + 4 * nb

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode the 1-D float ``x`` into a uint8 message of ``message_nbytes(x.numel())`` bytes."""
        _check_flat(x, self.name)
        m, b = x.numel(), self.block_size
        nb = -(-m // b)
        xb = torch.zeros(nb * b, dtype=torch.float32, device=x.device)
        xb[:m].copy_(x)
        xb = xb.view(nb, b)
        amax = xb.abs().amax(dim=1)
        if not bool(torch.isfinite(amax).all()):  # NaN is not caught by amax on every backend
            amax = torch.where(torch.isfinite(xb).all(dim=1), amax, torch.full_like(amax, float("nan")))
        scale = true_div(amax, self.half_levels)  # true division on CUDA too (bitwise as on CPU)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = (xb / safe.unsqueeze(1) + self.half_levels).round().clamp(0, 2**self.bits - 1)
        q = torch.where(torch.isfinite(q), q, torch.zeros_like(q)).to(torch.int64)
        codes = pack_bits(q.reshape(-1), self.bits)
        return torch.cat([codes, scale.contiguous().view(torch.uint8)])

    def encode_with_decoder(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.dtype], torch.Tensor]]:
        """``(msg, dec)``: ``msg = encode(x)`` and ``dec(dtype) = decode(msg, x.numel(), dtype)``."""
        msg, m = self.encode(x), x.numel()
        return msg, lambda dtype: self.decode(msg, m, dtype)

    def decode(self, buf: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode a message of ``m`` elements into a 1-D tensor of ``dtype``."""
        _check_message(buf, self.message_nbytes(m), self.name)
        b = self.block_size
        nb = -(-m // b)
        ncode = nb * b * self.bits // 8
        q = unpack_bits(buf[:ncode], nb * b, self.bits).to(torch.float32).view(nb, b)
        scale = buf[ncode:].clone().view(torch.float32)  # clone: 4-byte alignment
        x = (q - self.half_levels) * scale.unsqueeze(1)
        return x.reshape(-1)[:m].to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on ``|x - decode(encode(x))|`` (finite ``x``), float64."""
        ax = x.detach().reshape(-1).abs().to(torch.float64)
        m, b = ax.numel(), self.block_size
        nb = -(-m // b)
        pad = torch.zeros(nb * b, dtype=torch.float64, device=x.device)
        pad[:m] = ax
        amax = pad.view(nb, b).amax(dim=1, keepdim=True).expand(nb, b).reshape(-1)[:m]
        return amax / self.half_levels / 2 + amax * 2.0**-20 + ax * 2.0**-24


@dataclass(frozen=True)
class TopKCodec:
    """Chunked top-k: ``k`` largest magnitudes of every ``chunk`` elements, offsets in ``log2 chunk`` bits
    (or Rice-coded, :mod:`lowband.comm.rice`: the same offsets in a fixed slot of ``slot_bits`` per chunk).

    Attributes:
        name: ``topk``, ``topk-int4``, ``topk-int2``, or the same with ``-rice`` after ``topk``.
        chunk: elements per chunk (a power of two, 2..65536).
        k: values kept per chunk, ``1 <= k <= chunk``.
        values: codec of the kept values (``None``: fp32).
        rice: Rice-coded offsets instead of fixed-width ones (lossless: the same values decode).
    """

    name: str
    chunk: int
    k: int
    values: LowBitCodec | None = None
    rice: bool = False

    @property
    def index_bits(self) -> int:
        return int(math.log2(self.chunk))

    @property
    def block_size(self) -> int:
        return self.values.block_size if self.values is not None else 1

    def _value_nbytes(self, nvals: int) -> int:
        return 4 * nvals if self.values is None else self.values.message_nbytes(nvals)

    @property
    def rice_parameter(self) -> int:
        return rice_parameter(self.chunk, self.k)

    @property
    def chunk_offset_bits(self) -> int:
        """Bits of one chunk's offsets: ``k log2 chunk``, or with ``rice`` the Rice slot where that is smaller."""
        fixed = self.k * self.index_bits
        return min(slot_bits(self.chunk, self.k, self.rice_parameter), fixed) if self.rice else fixed

    @property
    def rice_coded(self) -> bool:
        """Whether the offsets travel Rice-coded: asked for (``rice``) and smaller than fixed-width ones
        (not so for very few values per chunk, e.g. ``k = 1``, where fixed-width offsets are used)."""
        return self.chunk_offset_bits < self.k * self.index_bits

    def _offset_nbytes(self, nc: int) -> int:
        return -(-nc * self.chunk_offset_bits // 8)

    def message_nbytes(self, m: int) -> int:
        nc = -(-m // self.chunk)
        return self._offset_nbytes(nc) + self._value_nbytes(nc * self.k)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets (nc, k) int64, values (nc, k) of x's dtype) of the kept elements, by chunk."""
        m, c = x.numel(), self.chunk
        nc = -(-m // c)
        xc = torch.zeros(nc * c, dtype=x.dtype, device=x.device)
        xc[:m].copy_(x)
        xc = xc.view(nc, c)
        mag = xc.abs()
        mag = torch.nan_to_num(mag, nan=math.inf, posinf=math.inf)  # non-finite first
        idx = torch.topk(mag, self.k, dim=1, largest=True, sorted=False).indices
        idx = idx.sort(dim=1).values  # deterministic order of the offsets inside a chunk
        return idx, torch.gather(xc, 1, idx)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode the 1-D float ``x`` into a uint8 message of ``message_nbytes(x.numel())`` bytes."""
        return self._encode_selected(x)[0]

    def encode_with_decoder(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.dtype], torch.Tensor]]:
        """``(msg, dec)``: ``msg = encode(x)`` and ``dec(dtype)`` equal bitwise to ``decode(msg, x.numel(),
        dtype)``, without parsing the offsets back (they are the selection's own, and their coding is
        lossless): only the values are decoded. ``dec`` holds the offsets and the message, not a dense copy."""
        msg, idx, payload = self._encode_selected(x)
        m, nvals = x.numel(), idx.shape[0] * self.k
        return msg, lambda dtype: self._scatter(idx, self._decode_values(payload, nvals, dtype), m, dtype)

    def _encode_selected(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(message, the kept offsets ``(nc, k)``, the values' part of the message)."""
        _check_flat(x, self.name)
        idx, vals = self.select(x)
        if self.rice_coded:
            offsets = pack_bits(encode_offsets(idx, self.chunk, self.rice_parameter).reshape(-1), 1)
        else:
            offsets = pack_bits(idx.reshape(-1), self.index_bits)
        flat_vals = vals.reshape(-1)
        if self.values is None:
            payload = flat_vals.to(torch.float32).contiguous().view(torch.uint8)
        else:
            payload = self.values.encode(flat_vals)
        return torch.cat([offsets, payload]), idx, payload

    def _decode_values(self, payload: torch.Tensor, nvals: int, dtype: torch.dtype) -> torch.Tensor:
        if self.values is None:
            return payload.clone().view(torch.float32).to(dtype)  # clone: 4-byte alignment
        return self.values.decode(payload, nvals, dtype)

    def _scatter(self, idx: torch.Tensor, vals: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        nc = idx.shape[0]
        out = torch.zeros(nc, self.chunk, dtype=dtype, device=idx.device)
        out.scatter_(1, idx, vals.view(nc, self.k))
        return out.reshape(-1)[:m]

    def decode(self, buf: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode a message of ``m`` elements into a dense 1-D tensor of ``dtype`` (zeros elsewhere)."""
        _check_message(buf, self.message_nbytes(m), self.name)
        c = self.chunk
        nc = -(-m // c)
        nvals = nc * self.k
        nidx = self._offset_nbytes(nc)
        if self.rice_coded:
            slot = self.chunk_offset_bits
            bits = unpack_bits(buf[:nidx], nc * slot, 1).view(nc, slot)
            idx = decode_offsets(bits, c, self.k, self.rice_parameter)
        else:
            idx = unpack_bits(buf[:nidx], nvals, self.index_bits).view(nc, self.k)
        return self._scatter(idx, self._decode_values(buf[nidx:], nvals, dtype), m, dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound (finite ``x``): ``|x|`` where dropped, the value codec's bound where kept."""
        flat = x.detach().reshape(-1)
        m = flat.numel()
        idx, vals = self.select(flat)
        kept = torch.zeros(idx.shape[0], self.chunk, dtype=torch.bool, device=x.device)
        kept.scatter_(1, idx, True)
        kept = kept.reshape(-1)[:m]
        ax = flat.abs().to(torch.float64)
        if self.values is None:
            vb = vals.abs().to(torch.float64) * (2.0**-24 if x.dtype == torch.float64 else 0.0)
        else:
            vb = self.values.error_bound(vals.reshape(-1))
        kb = torch.zeros(idx.shape[0], self.chunk, dtype=torch.float64, device=x.device)
        kb.scatter_(1, idx, vb.view(idx.shape))
        return torch.where(kept, kb.reshape(-1)[:m], ax)


MessageCodec = LowBitCodec | TopKCodec


def get_message_codec(name: str, block_size: int = 64, topk_chunk: int = DEFAULT_TOPK_CHUNK,
                      topk_k: int = DEFAULT_TOPK_K) -> MessageCodec:
    """The message codec called ``name`` (one of ``MESSAGE_CODECS``).

    Raises:
        ValueError: unknown name; ``block_size`` not a positive multiple of 4; ``topk_chunk`` not a
            power of two in ``[2, 65536]``; ``topk_k`` not in ``[1, topk_chunk]``.
    """
    if name not in MESSAGE_CODECS:
        raise ValueError(f"message codec {name!r} is not supported; allowed: {list(MESSAGE_CODECS)}")
    check_block_size(block_size)
    if name in LOWBIT:
        return LowBitCodec(name, LOWBIT[name], block_size)
    check_topk(topk_chunk, topk_k)
    rice = name.startswith("topk-rice")
    value_name = name.removeprefix("topk-rice" if rice else "topk").removeprefix("-")
    values = LowBitCodec(value_name, LOWBIT[value_name], block_size) if value_name else None
    return TopKCodec(name, topk_chunk, topk_k, values, rice)


def check_block_size(block_size: int, *, name: str = "codec block_size") -> None:
    """Raise ``ValueError`` unless ``block_size`` (elements per fp32 scale of a block-scaled codec) is a positive
    multiple of 4; the message calls it ``name`` (the trainer: ``diloco.block_size``). The one check of this
    rule: the block-scaled codecs (:func:`get_message_codec`, :func:`lowband.comm.codecs.get_codec`) and the
    trainer's config validation call it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % 4:
        raise ValueError(f"{name} must be a positive multiple of 4; got {block_size!r}")


def check_topk(topk_chunk: int, topk_k: int, *, names: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` unless ``topk_chunk`` is a power of two in ``[2, 65536]`` (offsets travel in
    ``log2`` of it bits) and ``topk_k`` is in ``[1, topk_chunk]``.

    Args:
        names: how the message calls ``topk_chunk`` and ``topk_k`` (default ``"codec topk_chunk"``,
            ``"codec topk_k"``); the trainer passes ``diloco.topk_chunk`` / ``diloco.topk_k``.
    """
    nm = {"topk_chunk": "codec topk_chunk", "topk_k": "codec topk_k", **(names or {})}
    c, k = topk_chunk, topk_k
    if isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= 65536 or c & (c - 1):
        raise ValueError(f"{nm['topk_chunk']} must be a power of two in [2, 65536]; got {c!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= c:
        raise ValueError(f"{nm['topk_k']} must be in [1, {nm['topk_chunk']} = {c}]; got {k!r}")


def _check_flat(x: torch.Tensor, name: str) -> None:
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"codec {name}: encode expects a 1-D float tensor, got shape {tuple(x.shape)} "
                         f"dtype {x.dtype}")


def _check_message(buf: torch.Tensor, nbytes: int, name: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != nbytes:
        raise ValueError(f"codec {name}: decode expects a 1-D uint8 message of {nbytes} bytes, got "
                         f"{tuple(buf.shape)} {buf.dtype}")


# ------------------------------------------------------------------------------- the collective
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class GatherHandle:
    """Completion handle of :func:`gather_all_reduce` (one phase: ``poll`` never issues anything)."""

    def __init__(self, work: CommHandle | None, finish) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self.result: torch.Tensor | None = None

    def poll(self) -> bool:
        """True: there is no second phase to issue."""
        return True

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self.result = self._finish()
            self._done = True
        return self.result  # type: ignore[return-value]

    def is_completed(self) -> bool:
        return self._done


def gather_all_reduce(comm: Comm, flat: torch.Tensor, codec: MessageCodec, *, op: str = "avg",
                      async_op: bool = False, tag: str = "",
                      residual_out: torch.Tensor | None = None, avg_over: int | None = None) -> GatherHandle:
    """Reduce the 1-D float tensor ``flat`` in place over ``comm`` with a message codec on the wire.

    Communication: one all-gather of every rank's ``message_nbytes(flat.numel())``-byte message
    (issued now; asynchronous with ``async_op=True``), recorded with ``tag``. With one rank nothing is
    sent, but the values still go through the codec, so the numerics do not depend on the world size.

    Args:
        comm: the group to reduce over.
        flat: contiguous 1-D float32/float64 tensor.
        codec: a message codec (:func:`get_message_codec`).
        op: ``"sum"`` or ``"avg"``.
        async_op: return before the all-gather completes.
        tag: ledger tag.
        residual_out: if given (same shape and dtype as ``flat``), receives ``flat - decode(encode(flat))``
            of this rank's own message, before the exchange.
        avg_over: ``op="avg"`` divides the sum by this many instead of ``N`` (the ranks that contributed,
            when the others send zeros).
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"gather_all_reduce: op {op!r} not in ('sum', 'avg')")
    divisor = avg_divisor(op, avg_over, comm.size, "gather_all_reduce")
    if flat.dim() != 1 or not flat.is_contiguous() or not flat.is_floating_point():
        raise ValueError("gather_all_reduce: flat must be a contiguous 1-D float tensor")
    n, m = comm.size, flat.numel()
    acc_dtype = _acc_dtype(flat.dtype)
    mine, decode_mine = codec.encode_with_decoder(flat)
    if residual_out is not None:
        torch.sub(flat, decode_mine(flat.dtype), out=residual_out)
    gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=flat.device)
    work = comm.all_gather(gathered, mine, async_op=True, tag=tag)

    def decoded(msg: torch.Tensor) -> torch.Tensor:
        # decoding is a function of the bytes alone: a message equal to this rank's own reuses its decode
        return decode_mine(acc_dtype) if torch.equal(msg, mine) else codec.decode(msg, m, acc_dtype)

    def finish() -> torch.Tensor:
        msgs = gathered.view(n, -1)
        acc = decoded(msgs[0]).clone()
        for i in range(1, n):
            acc.add_(decoded(msgs[i]))
        if divisor is not None:
            true_div_(acc, divisor)
        flat.copy_(acc)
        return flat

    handle = GatherHandle(work, finish)
    if not async_op:
        handle.wait()
    return handle


def reference_gather_all_reduce(inputs: Sequence[torch.Tensor], codec: MessageCodec,
                                op: str = "avg", avg_over: int | None = None) -> torch.Tensor:
    """Single-process reference of :func:`gather_all_reduce`: what every rank ends with."""
    n = len(inputs)
    divisor = avg_divisor(op, avg_over, n, "reference_gather_all_reduce")
    m = inputs[0].numel()
    dtype = inputs[0].dtype
    acc = None
    for x in inputs:
        dec = codec.decode(codec.encode(x.reshape(-1)), m, _acc_dtype(dtype))
        acc = dec.clone() if acc is None else acc.add_(dec)
    assert acc is not None
    if divisor is not None:
        true_div_(acc, divisor)
    return acc.to(dtype)

