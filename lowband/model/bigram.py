"""Hashed bigram embedding (modded-nanogpt PR #201): a table indexed by a hash of (previous, current) token.

The hash itself (:func:`bigram_hash`, its numpy twin :func:`bigram_hash_np`, and the index formula)
lives in :mod:`lowband.comm.bigram_hash`, shared with the sparse embedding-gradient comms; it is
re-exported here.

State layout: :class:`HashedBigramEmbedding` holds one dense ``weight`` Parameter of shape
``(rows, dim)``, zero-initialized (as in the speedrun). Its gradient only touches the rows hashed in
the batch plus the reserved row. No communication happens here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowband.comm.bigram_hash import HASH_MUL_CUR, HASH_MUL_PREV, bigram_hash, bigram_hash_np, check_rows

__all__ = ["HASH_MUL_CUR", "HASH_MUL_PREV", "HashedBigramEmbedding", "bigram_hash", "bigram_hash_np"]


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
