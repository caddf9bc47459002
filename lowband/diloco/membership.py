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

from lowband.comm import Comm, CommLedger, new_group
from lowband.comm.codecs import Codec, CodecHandle, codec_all_reduce


class StaticMembership:
    """Fixed replicas over one cross-replica :class:`Comm`; every sync commits.

    The membership interface :class:`~lowband.diloco.StreamingDiLoCo` drives: ``attach(diloco)`` once,
    ``start_quorum(diloco)`` before each prepare, ``all_reduce(flat, codec, tag)`` per bucket (returns
    a handle with ``poll()`` and ``wait()``), ``should_commit()`` at each sync; optional
    ``before_step()`` / ``after_step()`` around every inner step. ``uniform_schedule`` says whether
    every replica must use the same ``sync_every`` (checked at construction).
    """

    name = "static"
    uniform_schedule = True

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def attach(self, diloco: object) -> None:
        """Nothing to register: static replicas never heal."""

    def start_quorum(self, diloco: object) -> None:
        """No quorum: the replicas are fixed."""

    def all_reduce(self, flat: torch.Tensor, codec: Codec, tag: str) -> CodecHandle:
        """Average ``flat`` over the replicas with ``codec`` on the wire (asynchronous)."""
        return codec_all_reduce(self.comm, flat, codec, op="avg", async_op=True, tag=tag)

    def should_commit(self) -> bool:
        """Always: a failing collective raises (process-group timeout) instead."""
        return True


@dataclass
class ReplicaMesh:
    """This rank's place in the replica x dp mesh.

    Attributes:
        replica: index of this rank's replica group.
        dp_rank: this rank's rank inside its replica.
        num_replicas: number of replica groups.
        dp_size: ranks per replica.
        dp: Comm over the ranks of this replica (name ``"dp"``).
        cross: Comm over the ranks with this dp rank in every replica (name ``"replica"``).
    """

    replica: int
    dp_rank: int
    num_replicas: int
    dp_size: int
    dp: Comm
    cross: Comm


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
    dp_size = world // num_replicas
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not dist.is_initialized():
        return ReplicaMesh(0, 0, 1, 1, Comm(name="dp", ledger=ledger), Comm(name="replica", ledger=ledger))
    dp_comm = cross_comm = None
    for r in range(num_replicas):  # every rank creates every group, in the same order
        c = new_group([r * dp_size + d for d in range(dp_size)], "dp", ledger=ledger, timeout=timeout)
        dp_comm = c or dp_comm
    for d in range(dp_size):
        c = new_group([r * dp_size + d for r in range(num_replicas)], "replica", ledger=ledger,
                      timeout=timeout)
        cross_comm = c or cross_comm
    assert dp_comm is not None and cross_comm is not None
    return ReplicaMesh(rank // dp_size, rank % dp_size, num_replicas, dp_size, dp_comm, cross_comm)
