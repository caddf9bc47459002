"""Rank arithmetic of the replica x dp x gtp x tp mesh (no process groups)."""

from __future__ import annotations

import itertools

import pytest

from lowband.parallel.mesh import AXES, MeshCoords, MeshShape, build_mesh, lane_slice


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (1, 2, 2, 1), (2, 2, 2, 2), (1, 3, 2, 2), (2, 1, 4, 1)])
def test_rank_coords_roundtrip(sizes):
    shape = MeshShape(*sizes)
    seen = set()
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        assert shape.rank_of(c) == rank
        seen.add((c.replica, c.dp, c.gtp, c.tp))
    assert len(seen) == shape.world_size
    # TP innermost (stride 1), then GTP, DP, replica
    r, d, g, t = sizes
    for cr, cd, cg, ct in itertools.product(range(r), range(d), range(g), range(t)):
        assert shape.rank_of(MeshCoords(cr, cd, cg, ct)) == ((cr * d + cd) * g + cg) * t + ct


def test_group_ranks_layout():
    shape = MeshShape(replica=1, dp=2, gtp=2, tp=2)
    assert shape.group_ranks("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shape.group_ranks("gtp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert shape.group_ranks("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert shape.group_ranks("replica") == [(r,) for r in range(8)]
    for axis in AXES:  # every rank in exactly one group per axis
        flat = sorted(r for grp in shape.group_ranks(axis) for r in grp)
        assert flat == list(range(8))


def test_lanes():
    shape = MeshShape(replica=1, dp=2, gtp=2, tp=2)
    assert shape.num_lanes == 4
    assert [shape.lane(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert lane_slice(12, shape, 3) == slice(9, 12)
    with pytest.raises(ValueError, match="does not split evenly over 4 data lanes"):
        lane_slice(10, shape, 0)


def test_resolve_and_errors():
    assert MeshShape.resolve(8, gtp=2, tp=2) == MeshShape(1, 2, 2, 2)
    assert MeshShape.resolve(8, gtp=2) == MeshShape(1, 4, 2, 1)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        MeshShape.resolve(4, gtp=3)
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        MeshShape.resolve(8, gtp=2, tp=3)
    with pytest.raises(ValueError, match=r"= 8 != world size 4"):
        MeshShape.resolve(4, dp=2, gtp=2, tp=2)
    with pytest.raises(TypeError, match="gtp must be a positive int"):
        MeshShape.resolve(4, gtp=2.0)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        MeshShape(tp=0)
    with pytest.raises(ValueError, match="axis 'pp'"):
        MeshShape().group_ranks("pp")
    with pytest.raises(ValueError, match="rank 4 out of range"):
        MeshShape(dp=2, gtp=2).coords(4)


def test_build_mesh_single_process():
    mesh = build_mesh()
    assert mesh.shape == MeshShape()
    assert all(mesh.comm(a).size == 1 and mesh.comm(a).name == a for a in AXES)
    with pytest.raises(ValueError, match="does not divide"):
        build_mesh(gtp=2)


def test_replica_mesh_is_the_one_parallel_mesh() -> None:
    """DiLoCo's replica_mesh is a ParallelMesh (one mesh class) with gtp = tp = 1."""
    from lowband.diloco import replica_mesh
    from lowband.parallel.mesh import ParallelMesh

    m = replica_mesh(1)
    assert isinstance(m, ParallelMesh) and m.shape.sizes == (1, 1, 1, 1)
    assert (m.coords.replica, m.coords.dp) == (0, 0) and (m.replica.name, m.dp.name) == ("replica", "dp")
