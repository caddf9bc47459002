"""One ``DeviceMesh`` per mesh: :meth:`ParallelMesh.device_mesh` wraps the axes' own process groups (no new
group), and the DCP layouts that hold DTensors (TP's state, DiLoCo's per-replica residual rows) use it.

The group count is read from torch's process-group registry (``_world.pg_names``, private): torch's
``init_device_mesh``, which these layouts called before, creates a group for every slice of every dimension.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowband.testing import run_ranks
from lowband.train.config import Config
from lowband.train.trainer import train
from tests.distributed.test_checkpoint_diloco import diloco_config
from tests.distributed.test_checkpoint_tp import tp_config


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_names)


def _mesh_device_mesh(replica: int, gtp: int) -> list:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lowband.parallel.mesh import AXES, build_mesh

    mesh = build_mesh(replica=replica, gtp=gtp)
    before = _groups()
    dm = mesh.device_mesh("cpu")
    assert mesh.device_mesh("cpu") is dm and _groups() == before  # built once, no new process group
    assert dm.mesh_dim_names == AXES and tuple(dm.shape) == mesh.shape.sizes
    for axis in AXES:  # each dimension is the axis's own group (the same object)
        if mesh.comm(axis).size > 1:
            assert dm.get_group(axis) is mesh.comm(axis).group, axis
        assert dist.get_process_group_ranks(dm.get_group(axis)) == list(
            next(g for g in mesh.shape.group_ranks(axis) if dist.get_rank() in g)), axis
    sub = dm["dp", "gtp"]
    assert tuple(sub.shape) == (mesh.shape.dp, mesh.shape.gtp) and _groups() == before
    # a row per replica, sharded over the replica axis, replicated over the rest: every replica's row comes back
    row = torch.full((1, 3), float(mesh.coords.replica))
    whole = DTensor.from_local(row, dm, [Shard(0)] + [Replicate()] * 3, run_check=False).full_tensor()
    assert torch.equal(whole, torch.arange(replica, dtype=whole.dtype)[:, None].expand(replica, 3))
    assert _groups() == before
    return [before]


@pytest.mark.parametrize("world,replica,gtp", [(2, 2, 1), (4, 2, 2)])
def test_mesh_device_mesh_wraps_the_axes_own_groups(world: int, replica: int, gtp: int) -> None:
    run_ranks(_mesh_device_mesh, world, replica, gtp)


def _tp_layout_on_the_mesh(cfg: Config) -> None:
    res = train(cfg, write_run_dir=False, log=False)
    strategy = res.strategy
    before = _groups()
    state = strategy.state_dict()  # the layout's DTensors, as a checkpoint saves them
    assert _groups() == before
    meshes = {v.device_mesh for v in _leaves(state) if hasattr(v, "device_mesh")}
    dm = strategy.mesh.device_mesh("cpu")
    assert meshes and all(m.get_group("tp") is dm.get_group("tp") and m.mesh_dim_names == ("dp", "tp")
                          for m in meshes), meshes


def test_tp_state_lives_on_the_meshs_device_mesh(shard: str) -> None:
    run_ranks(_tp_layout_on_the_mesh, 2, tp_config(shard, 2, steps=2))


def _diloco_residuals_on_the_mesh(cfg: Config) -> None:
    res = train(cfg, write_run_dir=False, log=False)
    strategy = res.strategy
    before = _groups()
    state = strategy.diloco.state_dict()  # logical form: residual rows as DTensors
    assert _groups() == before
    rows = [v for k, v in state.items() if k.startswith("residual.")]
    assert rows and all(v.device_mesh is strategy.mesh.device_mesh("cpu") for v in rows), (
        len(rows), [type(v) for v in rows[:2]], list(strategy.diloco.dcp_meshes), strategy.diloco.residuals[:1])
    # each replica's own residual comes back in its row
    local = dict(strategy.unwrapped().named_parameters())
    for k, v in state.items():
        if k.startswith("residual."):
            name = k.removeprefix("residual.")
            assert v.shape == (strategy.mesh.shape.replica, *local[name].shape)
            assert torch.equal(v.full_tensor()[strategy.mesh.coords.replica], v.to_local()[0])


def test_diloco_residual_rows_live_on_the_meshs_device_mesh(shard: str) -> None:
    cfg = diloco_config(shard, 4, replicas=2, steps=4)
    cfg.diloco.wire, cfg.diloco.error_feedback = "int8", "on"  # per-replica residuals
    run_ranks(_diloco_residuals_on_the_mesh, 4, cfg)


def _leaves(tree: object) -> list:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]
