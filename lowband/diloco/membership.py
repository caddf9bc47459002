"""Who takes part in a DiLoCo outer sync, and the replica x dp process groups.

Static membership (the default): the replicas are fixed ranks of the job; every sync commits; a
failing or timed-out collective raises (process-group timeout) instead of being rolled back.

:func:`replica_mesh` builds the replica x dp mesh for a world of ``num_replicas * dp`` ranks, laid
out replica-major (``rank = replica * dp + dp_rank``): the ``dp`` group of a rank is the ranks of its
replica (inner data parallelism: DDP or the sharded optimizer), its ``cross`` group is the ranks with
the same dp rank in every replica (DiLoCo's outer all-reduce). Within a replica every dp rank holds
the same weights, so each cross group syncs the whole fragment, as torchft does.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class ReplicaMesh:
    """This rank's place in the replica x dp mesh: a view of a :class:`lowband.parallel.mesh.ParallelMesh`.

    lowband has one mesh class, ``ParallelMesh`` (``replica x dp x gtp x tp``); DiLoCo uses it with
    ``gtp = tp = 1`` and this view keeps DiLoCo's names for the same groups.

    Attributes:
        replica: index of this rank's replica group (``mesh.coords.replica``).
        dp_rank: this rank's rank inside its replica (``mesh.coords.dp``).
        num_replicas: number of replica groups (``mesh.shape.replica``).
        dp_size: ranks per replica (``mesh.shape.dp``).
        dp: Comm over the ranks of this replica (name ``"dp"``; ``mesh.dp``).
        cross: Comm over the ranks with this dp rank in every replica (name ``"replica"``; ``mesh.replica``).
        mesh: the underlying ``ParallelMesh`` (``None`` only for a hand-built view).
    """

    replica: int
    dp_rank: int
    num_replicas: int
    dp_size: int
    dp: Comm
    cross: Comm
    mesh: ParallelMesh | None = None

    @classmethod
    def from_parallel_mesh(cls, mesh: ParallelMesh) -> ReplicaMesh:
        """The DiLoCo view of ``mesh`` (raises ``ValueError`` if it has GTP or TP axes)."""
        if mesh.shape.gtp != 1 or mesh.shape.tp != 1:
            raise ValueError(f"ReplicaMesh: DiLoCo's mesh is replica x dp; got gtp={mesh.shape.gtp}, "
                             f"tp={mesh.shape.tp}")
        return cls(mesh.coords.replica, mesh.coords.dp, mesh.shape.replica, mesh.shape.dp, mesh.dp, mesh.replica,
                   mesh)


def replica_mesh(num_replicas: int, *, ledger: CommLedger | None = None,
                 timeout: timedelta | None = None) -> ReplicaMesh:
    """Build the replica x dp groups (collective: every rank must call it alike).

    Raises:
        ValueError: ``num_replicas`` not a positive divisor of the world size (checked before any
            group is created, identically on every rank).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1 \
            or world % num_replicas:
        raise ValueError(f"diloco num_replicas={num_replicas!r} must be a positive divisor of the world "
                         f"size {world}")
    mesh = build_mesh(replica=num_replicas, dp=world // num_replicas, ledger=ledger, timeout=timeout)
    return ReplicaMesh.from_parallel_mesh(mesh)
