"""Per-row digests of a tensor's bits: which weights a saved DiLoCo state belongs to.

:func:`row_digests` maps each row (dimension 0) of a tensor to one int64 in ``[0, 2^31 - 1)`` computed from the
row's bit pattern alone, so the digest of a row does not depend on which rank holds it or how the tensor is
sharded by rows (GTP): a rank compares its own rows against the matching slice of a whole tensor's digests, with
no communication. Exact integer arithmetic on the tensor's device (the same result on CPU and CUDA, for every
CPU kernel); equal bits give equal digests, and two different rows collide with probability about ``2^-31``.
:func:`row_digest_pairs` adds a second, independent digest for comparisons where a collision would be a wrong
result (the replicas' average, :mod:`lowband.diloco.average`).
"""

from __future__ import annotations

import torch

_P = 2**31 - 1  # a prime
_WORD = {1: torch.uint8, 2: torch.int16}  # elements of 4 bytes or more are read as int32 words
# Words hashed per block. On CPU the block's int64 temporaries (2 MiB each) stay in cache: 6 ns per element for
# row_digest_pairs of a 4096 x 2048 fp32 tensor on one thread of this machine's AMD EPYC, against 18-22 ns with
# blocks of 2^22 words (32 MiB temporaries). On an accelerator large blocks mean fewer kernel launches.
_BLOCK_ELEMS = 1 << 18
_BLOCK_ELEMS_ACCELERATOR = 1 << 22


def _coefficients(cols: int, salt: int, device: torch.device) -> torch.Tensor:
    """The fixed coefficients ``c_j`` in ``[1, 2^30)`` of a row's ``cols`` word positions; ``salt`` picks the set
    (0 is the one :func:`row_digests` uses and saved states hold)."""
    mul, add, _unsigned, _mod = _SALTS[salt]
    return (torch.arange(cols, dtype=torch.int64, device=device) * mul + add) % (2**30 - 35) + 1


_P1 = 2**32 + 15  # the smallest prime above 2^32: every unsigned 32-bit word is its own residue
# (multiplier, offset, words read unsigned, modulus) of each digest. Salt 0 is row_digests' (signed words mod
# 2^31 - 1: the words 0x7FFFFFFF and 0 fall on the same residue, as do 0x80000000 and 0xFFFFFFFF, i.e. a NaN and
# +-0.0); salt 1 reads the words unsigned modulo a prime above 2^32, so no two words share a residue.
_SALTS = ((1_000_003, 12_345, False, _P), (2_654_435, 97_531, True, _P1))


def _digests(t: torch.Tensor, salts: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[rows, len(salts)]``: the digest of every row under each coefficient set (see :func:`row_digests`),
    each row's words widened to int64 once per block."""
    x = t.detach()
    rows = x.shape[0] if x.dim() >= 2 else 1
    out = torch.zeros(rows, len(salts), dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        return out
    words = x.contiguous().reshape(rows, -1).view(_WORD.get(x.element_size(), torch.int32))
    mask = (1 << 8 * words.element_size()) - 1
    cols = words.shape[1]
    coefs = [_coefficients(cols, s, x.device) for s in salts]
    step = max(1, (_BLOCK_ELEMS if x.device.type == "cpu" else _BLOCK_ELEMS_ACCELERATOR) // cols)
    for lo in range(0, rows, step):
        w = words[lo:lo + step].to(torch.int64)  # a copy: never in place on t
        unsigned = None
        for k, (salt, coef) in enumerate(zip(salts, coefs, strict=True)):
            _mul, _add, read_unsigned, mod = _SALTS[salt]
            if read_unsigned and unsigned is None:
                unsigned = w & mask
            # products under 2^62 (words under 2^32, c_j under 2^30); a row sum of 2^30 residues under 2^63
            out[lo:lo + step, k] = ((unsigned if read_unsigned else w) * coef).remainder_(mod).sum(dim=1) \
                .remainder_(mod)
    return out


def row_digests(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor of ``rows`` digests, one per row of ``t`` (rows = ``t.shape[0]`` for a tensor of two or
    more dimensions, its elements flattened per row; a 0-d or 1-d tensor is one row), on ``t``'s device.

    Each digest is ``sum_j w_j * c_j mod P`` over the row's words ``w_j`` (its elements' bits read as signed
    32-bit words, or 16/8-bit ones for smaller elements) with ``c_j < 2^30`` a fixed coefficient of the word's
    position: every product stays under ``2^61`` and every row sum of ``2^31`` residues under ``2^63``."""
    return _digests(t, (0,))[:, 0]


def row_digest_pairs(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows, 2]``: each row's :func:`row_digests` digest beside a second one, for comparisons that must
    not mistake two different rows for equal ones (rows of fewer than ``2^30`` words). The second reads the words
    unsigned, each its own residue modulo the prime ``2^32 + 15``, with another coefficient set
    ``sum_j u_j * c'_j mod (2^32 + 15)``: both collide for unstructured differences with probability about
    ``2^-63``, and rows that differ by one in at most two words (an ulp here and there) never collide under the
    second (distinct positions of a row of fewer than ``2^30 - 35`` words, a prime, have distinct coefficients,
    and any two coefficients sum to less than the modulus); neither do rows that differ in one word."""
    return _digests(t, (0, 1))
