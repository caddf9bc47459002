"""The process mesh ``replica x dp x gtp x tp`` and one :class:`~lowband.comm.Comm` per axis.

Rank layout (TP innermost, stride 1; then GTP; then DP; replica outermost)::

    rank = ((replica * DP + dp) * GTP + gtp) * TP + tp

so a TP group is a contiguous block of ``TP`` ranks, a GTP group is the strided set
``{base + k * TP}``, and so on. Data is distributed over every axis except TP: the *data lane* of a
rank is ``rank // TP`` (``replica * DP * GTP`` lanes; GTP peers consume different microbatches, TP
peers the same one).

Communication pattern: building a mesh creates every subgroup of every axis on every rank, in one
canonical order (axes ``replica, dp, gtp, tp``; within an axis, groups by ascending first rank), as
``torch.distributed.new_group`` requires; each rank keeps the ``Comm`` of the groups it belongs to.
All validation is arithmetic on the sizes and happens before the first group is created.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lowband.comm import Comm, CommLedger, group_timeout, new_group

AXES = ("replica", "dp", "gtp", "tp")


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"mesh: {name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"mesh: {name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class MeshCoords:
    """Coordinates of one rank on the four axes."""

    replica: int
    dp: int
    gtp: int
    tp: int


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the four axes; pure rank arithmetic, no process groups.

    Use :meth:`resolve` to build one from a world size with an inferred ``dp``.
    """

    replica: int = 1
    dp: int = 1
    gtp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            _check_size(axis, getattr(self, axis))

    @classmethod
    def resolve(cls, world_size: int, *, replica: int = 1, dp: int | None = None, gtp: int = 1,
                tp: int = 1) -> MeshShape:
        """Shape for ``world_size`` ranks; ``dp=None`` takes the rest of the world.

        Raises:
            ValueError: if a size is not a positive int, if ``replica * gtp * tp`` does not divide the
                world size, or if ``replica * dp * gtp * tp != world_size``.
        """
        _check_size("world_size", world_size)
        for name, v in (("replica", replica), ("gtp", gtp), ("tp", tp)):
            _check_size(name, v)
        inner = replica * gtp * tp
        if dp is None:
            if world_size % inner:
                raise ValueError(f"mesh: replica x gtp x tp = {replica} x {gtp} x {tp} = {inner} does not "
                                 f"divide the world size {world_size}; choose gtp (and tp, replica) so "
                                 "that their product divides it")
            dp = world_size // inner
        _check_size("dp", dp)
        if inner * dp != world_size:
            raise ValueError(f"mesh: replica x dp x gtp x tp = {replica} x {dp} x {gtp} x {tp} = "
                             f"{inner * dp} != world size {world_size}")
        return cls(replica=replica, dp=dp, gtp=gtp, tp=tp)

    @property
    def world_size(self) -> int:
        return self.replica * self.dp * self.gtp * self.tp

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.replica, self.dp, self.gtp, self.tp)

    @property
    def num_lanes(self) -> int:
        """Number of data lanes (ranks that see distinct data): ``replica * dp * gtp``."""
        return self.replica * self.dp * self.gtp

    def rank_of(self, coords: MeshCoords) -> int:
        """Global rank at ``coords``."""
        for axis, size in zip(AXES, self.sizes):
            c = getattr(coords, axis)
            if not 0 <= c < size:
                raise ValueError(f"mesh: {axis} coordinate {c} out of range [0, {size})")
        return ((coords.replica * self.dp + coords.dp) * self.gtp + coords.gtp) * self.tp + coords.tp

    def coords(self, rank: int) -> MeshCoords:
        """Coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"mesh: rank {rank} out of range [0, {self.world_size})")
        tp = rank % self.tp
        rest = rank // self.tp
        gtp = rest % self.gtp
        rest //= self.gtp
        return MeshCoords(replica=rest // self.dp, dp=rest % self.dp, gtp=gtp, tp=tp)

    def lane(self, rank: int) -> int:
        """Data lane of ``rank`` (``rank // tp``): lane ``(replica * dp + dp) * gtp + gtp``."""
        self.coords(rank)
        return rank // self.tp

    def group_ranks(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis``, each as its ranks in axis order; groups by ascending first rank."""
        if axis not in AXES:
            raise ValueError(f"mesh: axis {axis!r} not in {AXES}")
        k = AXES.index(axis)
        groups = []
        for rank in range(self.world_size):
            c = self.coords(rank)
            if getattr(c, axis) != 0:
                continue
            members = []
            for v in range(self.sizes[k]):
                members.append(self.rank_of(MeshCoords(**{**c.__dict__, axis: v})))
            groups.append(tuple(members))
        return groups


@dataclass
class ParallelMesh:
    """This rank's view of the mesh: its coordinates and the ``Comm`` of each axis it belongs to.

    Attributes:
        shape: the axis sizes.
        rank: global rank.
        coords: this rank's coordinates.
        replica, dp, gtp, tp: the ``Comm`` of this rank's group on each axis (named like the axis).
    """

    shape: MeshShape
    rank: int
    coords: MeshCoords
    replica: Comm
    dp: Comm
    gtp: Comm
    tp: Comm
    _device_meshes: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def lane(self) -> int:
        """This rank's data lane (see :meth:`MeshShape.lane`)."""
        return self.shape.lane(self.rank)

    def comm(self, axis: str) -> Comm:
        if axis not in AXES:
            raise ValueError(f"mesh: axis {axis!r} not in {AXES}")
        return getattr(self, axis)

    def device_mesh(self, device_type: str = "cpu") -> Any:
        """The ``torch.distributed.DeviceMesh`` of this mesh, dims named ``replica, dp, gtp, tp``: the one
        every DCP layout on this mesh uses (slice it by name, e.g. ``["dp", "tp"]``), built once per device
        type over the axes' own process groups (``DeviceMesh.from_group``).

        Communication: none, and no new process group (torch's ``init_device_mesh`` would create a group per
        slice of every dimension, on every rank). Needs ``torch.distributed`` initialized.
        """
        if device_type not in self._device_meshes:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("mesh.device_mesh: torch.distributed is not initialized (a DeviceMesh needs a "
                                   "process group; a one-process layout needs none)")
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            layout = torch.arange(self.shape.world_size).view(*self.shape.sizes)
            groups = [self.comm(axis).group for axis in AXES]
            self._device_meshes[device_type] = DeviceMesh.from_group(groups, device_type, mesh=layout,
                                                                     mesh_dim_names=AXES)
        return self._device_meshes[device_type]


def build_mesh(*, replica: int = 1, dp: int | None = None, gtp: int = 1, tp: int = 1,
               ledger: CommLedger | None = None, timeout: timedelta | None = None) -> ParallelMesh:
    """Validate the sizes, then create every subgroup on every rank in the canonical order.

    Works with ``torch.distributed`` uninitialized (world of one: every axis a 1-rank ``Comm``).

    Args:
        replica, dp, gtp, tp: axis sizes; ``dp=None`` takes the rest of the world.
        ledger: ledger for the axis ``Comm`` objects (default: the process-wide one).
        timeout: process-group timeout for the subgroups (default: the default group's own timeout,
            as ``init_process_group(timeout=...)`` set it; torch's ``new_group`` would otherwise
            give every subgroup its 30-minute default, so a rank-divergent collective on a subgroup
            would hang for half an hour however short the user made the world's timeout).

    Raises:
        ValueError / TypeError: bad sizes (before any group is created, identically on every rank).
    """
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    shape = MeshShape.resolve(world, replica=replica, dp=dp, gtp=gtp, tp=tp)
    coords = shape.coords(rank)
    comms: dict[str, Comm] = {}
    if not initialized:
        for axis in AXES:
            comms[axis] = Comm(None, name=axis, ledger=ledger)
    else:
        if timeout is None:
            timeout = group_timeout(None)
        for axis in AXES:
            for ranks in shape.group_ranks(axis):
                c = new_group(ranks, axis, ledger=ledger, timeout=timeout)
                if c is not None:
                    comms[axis] = c
    return ParallelMesh(shape=shape, rank=rank, coords=coords, **comms)


def lane_slice(global_batch: int, mesh_shape: MeshShape, lane: int) -> slice:
    """Rows of a global batch that data lane ``lane`` consumes (equal contiguous slices).

    Raises:
        ValueError: if the global batch does not split evenly over the lanes.
    """
    n = mesh_shape.num_lanes
    if global_batch % n:
        raise ValueError(f"mesh: global batch {global_batch} does not split evenly over {n} data lanes "
                         f"(replica x dp x gtp = {mesh_shape.replica} x {mesh_shape.dp} x {mesh_shape.gtp})")
    per = global_batch // n
    return slice(lane * per, (lane + 1) * per)


__all__: Sequence[str] = ["AXES", "MeshCoords", "MeshShape", "ParallelMesh", "build_mesh", "lane_slice"]
