"""Wiring only: the ``tp`` strategy's checkpoint layout lives in :mod:`lowband.parallel.tp_state`.

Kept so that older imports (``from lowband.train.checkpoint_tp import TPStateLayout, full_state,
qkv_perm``) keep working; new code imports from :mod:`lowband.parallel.tp_state`.
"""

from lowband.parallel.tp_state import TPStateLayout, full_state, qkv_perm, sections_perm

__all__ = ["TPStateLayout", "full_state", "qkv_perm", "sections_perm"]
