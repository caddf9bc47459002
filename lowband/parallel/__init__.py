"""Parallel layouts: tensor-parallel linear layers (:mod:`lowband.parallel.tensor`), the process mesh
(:mod:`lowband.parallel.mesh`) and generalized tensor parallelism (:mod:`lowband.parallel.gtp`)."""

from lowband.parallel.gtp import GTPEmbedding, GTPLinear, GTPOptions, GTPRuntime, shard_embeddings, shard_linears
from lowband.parallel.mesh import MeshShape, ParallelMesh, build_mesh
from lowband.parallel.tensor import ColumnParallelLinear, RowParallelLinear, mark_partition

__all__ = ["ColumnParallelLinear", "GTPEmbedding", "GTPLinear", "GTPOptions", "GTPRuntime", "MeshShape",
           "ParallelMesh", "RowParallelLinear", "build_mesh", "mark_partition", "shard_embeddings",
           "shard_linears"]
