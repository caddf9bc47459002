"""Hashed bigram embedding (modded-nanogpt PR #201): a table indexed by a hash of (previous, current) token.

Index per position ``i`` of each sequence (the last dimension of the tokens)::

    h_0 = rows - 1                                           (reserved row)
    h_i = ((36313 * x_i) XOR (27191 * x_{i-1})) mod (rows - 1)    for i >= 1

Products are formed in int64, so any token id below 2**47 is exact; ``mod`` is the floor modulo of
both torch and numpy, so the result is always in ``[0, rows - 1)`` for ``i >= 1`` (even for negative
ids, for which both versions still agree bit for bit). Document boundaries are not masked.
:func:`bigram_hash` (torch) indexes the table; its host-side twin :func:`bigram_hash_np`, bit-equal to
it, is the rows function of a ``hash = "bigram"`` sparse table (:mod:`lowband.optim.sparse_rows` hands it
to the sparse exchange's :class:`lowband.comm.sparse.RowTracker`, which knows no model).

State layout: :class:`HashedBigramEmbedding` holds one dense ``weight`` Parameter of shape
``(rows, dim)``, zero-initialized (as in the speedrun). Its gradient only touches the rows hashed in
the batch plus the reserved row. No communication happens here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HASH_MUL_CUR", "HASH_MUL_PREV", "HashedBigramEmbedding", "bigram_hash", "bigram_hash_np"]

HASH_MUL_CUR = 36313
HASH_MUL_PREV = 27191


def check_rows(rows: object, name: str = "rows") -> int:
    """``rows`` as an int, or ``TypeError``/``ValueError`` if it is not an int >= 2."""
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 2, got {type(rows).__name__}")
    if rows < 2:
        raise ValueError(f"{name} must be >= 2 (one reserved row plus at least one hashed row), got {rows}")
    return int(rows)


def bigram_hash(tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """Bigram hash row index for every position of ``tokens`` (hash runs along the last dimension).

    Args:
        tokens: integer tensor of shape ``(..., T)``.
        rows: number of rows of the bigram table (>= 2); row ``rows - 1`` is reserved for position 0.

    Returns:
        int64 tensor of the same shape and device with values in ``[0, rows)``.
    """
    rows = check_rows(rows)
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__} (use bigram_hash_np)")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
    if tokens.dim() == 0:
        raise ValueError("tokens must have at least one dimension (the sequence dimension), got a scalar")
    t = tokens.to(torch.int64)
    out = torch.empty_like(t)
    if t.shape[-1] == 0:
        return out
    out[..., 0] = rows - 1
    if t.shape[-1] > 1:
        mixed = torch.bitwise_xor(HASH_MUL_CUR * t[..., 1:], HASH_MUL_PREV * t[..., :-1])
        out[..., 1:] = torch.remainder(mixed, rows - 1)
    return out


def bigram_hash_np(tokens: np.ndarray, rows: int) -> np.ndarray:
    """Numpy twin of :func:`bigram_hash`, bit-equal to it; for host-side row bookkeeping.

    Args:
        tokens: integer array-like of shape ``(..., T)``.
        rows: number of rows of the bigram table (>= 2).

    Returns:
        int64 array of the same shape.
    """
    rows = check_rows(rows)
    arr = np.asarray(tokens)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be an integer array, got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise ValueError("tokens must have at least one dimension (the sequence dimension), got a scalar")
    t = arr.astype(np.int64)
    out = np.empty_like(t)
    if t.shape[-1] == 0:
        return out
    out[..., 0] = rows - 1
    if t.shape[-1] > 1:
        mixed = np.bitwise_xor(HASH_MUL_CUR * t[..., 1:], HASH_MUL_PREV * t[..., :-1])
        out[..., 1:] = np.remainder(mixed, rows - 1)
    return out



class HashedBigramEmbedding(nn.Module):
    """Embedding of the bigram hash of a token sequence.

    ``forward(idx)`` with ``idx`` of shape ``(B, T)`` returns ``weight[bigram_hash(idx, rows)]`` of shape
    ``(B, T, dim)``. The table is a plain Parameter named ``weight`` (``(rows, dim)``, zero-init) so that
    optimizers and the sparse-gradient distributor can address it directly.

    Args:
        rows: table rows (>= 2); the last row is the reserved row of position 0.
        dim: embedding width (>= 1).
    """

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.rows = check_rows(rows)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.dim = dim
        self.weight = nn.Parameter(torch.zeros(self.rows, dim))

    def reset_parameters(self) -> None:
        """Zero the table (speedrun init: the bigram path starts silent)."""
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(bigram_hash(idx, self.rows), self.weight)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, dim={self.dim}"
