"""Row-sharded parameters in Streaming DiLoCo's checkpoint state: rank-local chunks or logical tensors.

With GTP inside a replica (:mod:`lowband.parallel.gtp`) a DiLoCo parameter is this rank's row shard of
a weight: its global copy, outer momentum, error-feedback residual and its piece of an in-flight
buffer are shards too, different on every rank of the replica's GTP group. :class:`GTPShardLayout`
describes such a per-parameter tensor in the weight's *logical* shape (the whole, unpadded
``[out_features, in_features]``), so it loads at any GTP size, in two forms:

* :meth:`GTPShardLayout.to_chunks` (what checkpoints save): a :class:`lowband.dcp_chunks.LocalChunks`
  of the logical shape holding this rank's real rows only, views of the shard (no copy; a rank whose
  rows are all padding holds no piece); :meth:`GTPShardLayout.from_saved` turns such a template,
  filled by ``dcp.load``, back into this rank's padded shard (pad rows zero).
* :meth:`GTPShardLayout.to_logical`: the whole tensor, all-gathered over the GTP group (the form of
  :meth:`lowband.diloco.StreamingDiLoCo.state_dict`, for inspection); :meth:`GTPShardLayout.to_local`
  slices a whole tensor back (``from_saved`` takes either).

Parameters that are not GTP shards pass through unchanged.

Communication: :meth:`GTPShardLayout.to_logical` all-gathers the shard over the weight's GTP group
(``tag="diloco:state"``; every rank of that group must call it for the same names in the same order);
the other methods have none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.parallel.gtp import GTPWeight, is_gtp_param
from lowband.parallel.gtp_state import gather_logical, local_rows, shard_of_logical, shard_of_saved


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

    def to_chunks(self, name: str, local: torch.Tensor) -> Any:
        """``local`` (this rank's padded shard of ``name``, or a tensor of its shape) as a ``LocalChunks`` of
        the logical shape holding its real rows, views of ``local`` (no copy, no communication); a
        parameter that is not a GTP shard: ``local`` itself."""
        gw = self.weights.get(name)
        return local if gw is None else local_rows(gw, local)

    def from_saved(self, name: str, saved: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard (pad rows zero) from a :meth:`to_chunks` template filled by ``dcp.load``
        or from a whole logical tensor (``ValueError`` naming ``name`` when it fits neither); no
        communication. A parameter that is not a GTP shard: ``saved`` itself."""
        gw = self.weights.get(name)
        return saved if gw is None else shard_of_saved(gw, saved, f"diloco checkpoint: {name}")

    def logical_numel(self, name: str, local: torch.Tensor) -> int:
        gw = self.weights.get(name)
        return local.numel() if gw is None else gw.out_features * gw.in_features
