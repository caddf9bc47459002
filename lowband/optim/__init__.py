"""Optimizer math (single device) and its distributors.

* :mod:`lowband.optim.adamw`: AdamW update kernel (matches ``torch.optim.AdamW``).
* :mod:`lowband.optim.muon`: Newton-Schulz / Polar Express orthogonalization, Muon update, ``Muon``.
* :mod:`lowband.optim.buckets`: flat bucket layout of the sharded optimizer.
* :mod:`lowband.optim.sharded`: ZeRO-style sharded data-parallel AdamW and Muon.
* :mod:`lowband.optim.sharded_state`: their checkpoint layout for torch DCP (``ShardedStateLayout``).
* :mod:`lowband.optim.sparse_rows`: row-sparse embedding tables inside the sharded optimizer.
"""

from lowband.optim.adamw import adamw_update_
from lowband.optim.muon import Muon, muon_update_, orthogonalize
from lowband.optim.sharded import ShardedAdamW, ShardedMuon, ShardedOptimizer, split_params_for_muon
from lowband.optim.sharded_state import ShardedStateLayout
from lowband.optim.sparse_rows import SparseTable, sparse_table_for, sparse_tables_from_plan
from lowband.optim.tp_rekls import REKLS, TpRekls  # noqa: F401 (REKLS: rekls.py; TP-REKLS: tp_rekls.py)

__all__ = ["Muon", "ShardedAdamW", "ShardedMuon", "ShardedOptimizer", "ShardedStateLayout", "SparseTable",
           "adamw_update_", "muon_update_", "orthogonalize", "sparse_table_for", "sparse_tables_from_plan",
           "split_params_for_muon"]
