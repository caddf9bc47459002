"""Logical form of row-sharded parameters in Streaming DiLoCo's checkpoint state.

With GTP inside a replica (:mod:`lowband.parallel.gtp`) a DiLoCo parameter is this rank's row shard of
a weight: its global copy, outer momentum and error-feedback residual are shards too, different on
every rank of the replica's GTP group. :class:`GTPShardLayout` maps such a per-parameter tensor to the
*logical* tensor (the whole, unpadded weight shape: identical on every rank of the replica, so it can
be stored like a replicated value and loaded at any GTP size) and back to this rank's padded shard.
Parameters that are not GTP shards pass through unchanged.

Communication: :meth:`GTPShardLayout.to_logical` all-gathers the shard over the weight's GTP group
(``tag="diloco:state"``; every rank of that group must call it for the same names in the same order);
:meth:`GTPShardLayout.to_local` has none.
"""

from __future__ import annotations

import torch
from torch import nn

from lowband.parallel.gtp import GTPWeight, is_gtp_param
from lowband.parallel.gtp_state import gather_logical, shard_of_logical


class GTPShardLayout:
    """Logical <-> local (row shard) tensors of the GTP parameters of ``model``, by parameter name.

    Args:
        model: the GTP model (names as ``named_parameters()`` gives them: DiLoCo's fragment names).
    """

    def __init__(self, model: nn.Module) -> None:
        self.weights: dict[str, GTPWeight] = {n: p.gtp for n, p in model.named_parameters() if is_gtp_param(p)}

    def to_logical(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole (unpadded) tensor of which ``local`` is this rank's shard (collective over the GTP group)."""
        gw = self.weights.get(name)
        return local if gw is None else gather_logical(gw, local, tag="diloco:state")

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded row shard of the logical ``full`` (``ValueError`` on a wrong shape)."""
        gw = self.weights.get(name)
        return full if gw is None else shard_of_logical(gw, full, f"diloco checkpoint: {name}")

    def logical_numel(self, name: str, local: torch.Tensor) -> int:
        gw = self.weights.get(name)
        return local.numel() if gw is None else gw.out_features * gw.in_features
