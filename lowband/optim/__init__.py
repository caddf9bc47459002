"""Optimizer math (single device) and its distributors.

* :mod:`lowband.optim.adamw`: AdamW update kernel (matches ``torch.optim.AdamW``).
* :mod:`lowband.optim.muon`: Newton-Schulz / Polar Express orthogonalization, Muon update, ``Muon``.
* :mod:`lowband.optim.buckets`: flat bucket layout of the sharded optimizer.
* :mod:`lowband.optim.sharded`: ZeRO-style sharded data-parallel AdamW and Muon.
"""

from lowband.optim.adamw import adamw_update_
from lowband.optim.muon import Muon, muon_update_, orthogonalize
from lowband.optim.sharded import ShardedAdamW, ShardedMuon, ShardedOptimizer, split_params_for_muon
from lowband.optim.tp_rekls import REKLS, TpRekls  # noqa: F401 (REKLS: rekls.py; TP-REKLS: tp_rekls.py)

__all__ = ["Muon", "ShardedAdamW", "ShardedMuon", "ShardedOptimizer", "adamw_update_", "muon_update_",
           "orthogonalize", "split_params_for_muon"]
