"""Checkpoint state of the ``diloco`` strategy: a thin wire to :mod:`lowband.diloco.state`.

The layout (model and inner optimizer as per-replica rows, the DiLoCo state in the one format of
:meth:`lowband.diloco.StreamingDiLoCo.state_dict`) lives with the component:
:class:`lowband.diloco.state.DilocoCheckpoint`. ``DilocoStateLayout`` is kept as its old name.
"""

from __future__ import annotations

from lowband.diloco.state import DilocoCheckpoint

DilocoStateLayout = DilocoCheckpoint

__all__ = ["DilocoStateLayout"]
