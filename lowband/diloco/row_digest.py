"""Per-row digests of a tensor's bits: which weights a saved DiLoCo state belongs to.

:func:`row_digests` maps each row (dimension 0) of a tensor to one int64 in ``[0, 2^31 - 1)`` computed from the
row's bit pattern alone, so the digest of a row does not depend on which rank holds it or how the tensor is
sharded by rows (GTP): a rank compares its own rows against the matching slice of a whole tensor's digests, with
no communication. Exact integer arithmetic on the tensor's device (the same result on CPU and CUDA, for every
CPU kernel); equal bits give equal digests, and two different rows collide with probability about ``2^-31``.
"""

from __future__ import annotations

import torch

_P = 2**31 - 1  # a prime
_WORD = {1: torch.uint8, 2: torch.int16}  # elements of 4 bytes or more are read as int32 words
_BLOCK_ELEMS = 1 << 22  # words hashed per block: bounds the int64 temporaries to a few 32 MiB buffers


def row_digests(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor of ``rows`` digests, one per row of ``t`` (rows = ``t.shape[0]`` for a tensor of two or
    more dimensions, its elements flattened per row; a 0-d or 1-d tensor is one row), on ``t``'s device.

    Each digest is ``sum_j w_j * c_j mod P`` over the row's words ``w_j`` (its elements' bits read as signed
    32-bit words, or 16/8-bit ones for smaller elements) with ``c_j < 2^30`` a fixed coefficient of the word's
    position: every product stays under ``2^61`` and every row sum of ``2^31`` residues under ``2^63``."""
    x = t.detach()
    rows = x.shape[0] if x.dim() >= 2 else 1
    out = torch.zeros(rows, dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        return out
    words = x.contiguous().reshape(rows, -1).view(_WORD.get(x.element_size(), torch.int32))
    cols = words.shape[1]
    coef = (torch.arange(cols, dtype=torch.int64, device=x.device) * 1_000_003 + 12_345) % (2**30 - 35) + 1
    step = max(1, _BLOCK_ELEMS // cols)
    for lo in range(0, rows, step):
        w = words[lo:lo + step].to(torch.int64, copy=True)  # a copy: never in place on t
        out[lo:lo + step] = w.mul_(coef).remainder_(_P).sum(dim=1).remainder_(_P)
    return out
