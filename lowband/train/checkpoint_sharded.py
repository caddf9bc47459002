"""Checkpoint state of ``sharded-adamw`` / ``sharded-muon``: a thin wire to the layout that
:mod:`lowband.optim.sharded_state` owns (:class:`~lowband.optim.sharded_state.ShardedStateLayout`:
flat, world-size-independent keys, each rank's own elements per parameter as rank-local chunks in the
parameter's logical shape; see its docstring)."""

from __future__ import annotations

from lowband.optim.sharded_state import ShardedStateLayout

__all__ = ["ShardedStateLayout"]
