"""Who takes part in a DiLoCo outer sync, and the replica x dp process groups.

Static membership (the default): the replicas are fixed ranks of the job; every sync commits; a
failing or timed-out collective raises (process-group timeout) instead of being rolled back.

:func:`replica_mesh` builds the replica x dp mesh for a world of ``num_replicas * dp`` ranks, laid
out replica-major (``rank = replica * dp + dp_rank``): the ``dp`` group of a rank is the ranks of its
replica (inner data parallelism: DDP or the sharded optimizer), its ``replica`` group is the ranks with
the same dp rank in every replica (DiLoCo's outer all-reduce). It is lowband's one mesh class,
:class:`~lowband.parallel.mesh.ParallelMesh`, with ``gtp = tp = 1``. Within a replica every dp rank holds
the same weights, so each cross group syncs the whole fragment, as torchft does.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from lowband.comm import Comm, CommLedger
from lowband.comm.codecs import CodecHandle, WireCodec, wire_all_reduce
from lowband.comm.compress import GatherHandle
from lowband.parallel.mesh import ParallelMesh, build_mesh


class StaticMembership:
    """Fixed replicas over one cross-replica :class:`Comm`; every sync commits.

    The membership interface :class:`~lowband.diloco.StreamingDiLoCo` drives: ``attach(diloco)`` once,
    ``start_quorum(diloco)`` before each prepare, ``all_reduce(flat, codec, tag)`` per bucket (returns
    a handle with ``poll()`` and ``wait()``), ``should_commit()`` at each sync; optional
    ``before_step()`` / ``after_step()`` around every inner step. With error feedback on,
    ``all_reduce`` is called with ``residual_out=`` (a tensor shaped like ``flat`` to receive this
    replica's own encoding error); a membership without that keyword supports no error feedback.
    ``uniform_schedule`` says whether every replica must use the same ``sync_every`` (checked at
    construction).
    """

    name = "static"
    uniform_schedule = True

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def attach(self, diloco: object) -> None:
        """Nothing to register: static replicas never heal."""

    def start_quorum(self, diloco: object) -> None:
        """No quorum: the replicas are fixed."""

    def all_reduce(self, flat: torch.Tensor, codec: WireCodec, tag: str,
                   residual_out: torch.Tensor | None = None) -> CodecHandle | GatherHandle:
        """Average ``flat`` over the replicas with ``codec`` on the wire (asynchronous); ``residual_out``
        receives this replica's own encoding error (error feedback)."""
        return wire_all_reduce(self.comm, flat, codec, op="avg", async_op=True, tag=tag,
                               residual_out=residual_out)

    def should_commit(self) -> bool:
        """Always: a failing collective raises (process-group timeout) instead."""
        return True


def replica_mesh(num_replicas: int, *, ledger: CommLedger | None = None,
                 timeout: timedelta | None = None) -> ParallelMesh:
    """The replica x dp mesh (``gtp = tp = 1``) of a world of ``num_replicas * dp`` ranks, replica-major:
    :func:`lowband.parallel.mesh.build_mesh` with ``dp`` the rest of the world. DiLoCo syncs over
    ``mesh.replica`` (the ranks with this dp rank in every replica); ``mesh.dp`` is this replica's group;
    ``mesh.coords.replica`` / ``mesh.coords.dp`` and ``mesh.shape.replica`` / ``mesh.shape.dp`` are this
    rank's place and the sizes. Collective: every rank must call it alike.

    Raises:
        ValueError: ``num_replicas`` not a positive divisor of the world size (checked before any
            group is created, identically on every rank).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1 \
            or world % num_replicas:
        raise ValueError(f"diloco num_replicas={num_replicas!r} must be a positive divisor of the world "
                         f"size {world}")
    return build_mesh(replica=num_replicas, dp=world // num_replicas, ledger=ledger, timeout=timeout)
