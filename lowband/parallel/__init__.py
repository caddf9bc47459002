"""Parallel layouts: tensor-parallel linear layers (:mod:`lowband.parallel.tensor`, :func:`shard_tp` from a
model plan), the process mesh (:mod:`lowband.parallel.mesh`), generalized tensor parallelism
(:mod:`lowband.parallel.gtp`), and what works across them: initial-weight agreement
(:mod:`lowband.parallel.init_sync`), global-norm clipping (:mod:`lowband.parallel.clip`), gathered
evaluation (:func:`unsharded_copy`) and GTP's checkpoint layout (:mod:`lowband.parallel.gtp_state`; the
optimizers' own state layouts live beside them in :mod:`lowband.optim`). Imports nothing from
:mod:`lowband.optim` or any package above it."""

from lowband.parallel.clip import clip_grad_norm_, global_grad_norm
from lowband.parallel.gtp import (
    GTPCollectiveError,
    GTPDirectReadError,
    GTPEmbedding,
    GTPLinear,
    GTPOptions,
    GTPRuntime,
    GTPStateError,
    plan_filter,
    shard_embeddings,
    shard_linears,
    sync_replicated_grads,
)
from lowband.parallel.init_sync import check_module_state, sync_module_state
from lowband.parallel.mesh import MeshShape, ParallelMesh, build_mesh
from lowband.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPCollectiveError,
    TPInputGather,
    TPInputMismatchError,
    TPStateError,
    mark_partition,
)
from lowband.parallel.tp_grads import TPGradEditError
from lowband.parallel.tp_shard import shard_tp
from lowband.parallel.unshard import unsharded_copy

__all__ = ["ColumnParallelLinear", "GTPCollectiveError", "GTPDirectReadError", "GTPEmbedding", "GTPLinear",
           "GTPOptions", "GTPRuntime",
           "GTPStateError", "MeshShape", "ParallelMesh", "RowParallelLinear", "TPCollectiveError", "TPGradEditError",
           "TPInputGather", "TPInputMismatchError", "TPStateError",
           "build_mesh", "check_module_state", "clip_grad_norm_", "global_grad_norm", "mark_partition",
           "plan_filter", "shard_embeddings", "shard_linears", "shard_tp", "sync_module_state",
           "sync_replicated_grads", "unsharded_copy"]
