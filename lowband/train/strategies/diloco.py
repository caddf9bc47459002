"""``diloco``: Streaming DiLoCo across replica groups, DDP inside each replica.

The world is split replica-major into ``diloco.num_replicas`` replica groups of ``world / replicas``
ranks (:func:`lowband.diloco.replica_mesh`). Inside a replica: torch DDP over the ``dp`` group with
its gradient all-reduce routed through a ``dp`` :class:`~lowband.comm.Comm` (tag ``grad``), and AdamW
as the inner optimizer. Across replicas: :class:`lowband.diloco.StreamingDiLoCo` on the ``replica``
group (same dp rank in every replica), driven by AdamW's step post-hook: one fragment every
``sync_every / fragments`` steps, its averaged pseudo-gradient on the ``diloco.wire`` format (tags
``diloco:frag<i>``), outer Nesterov SGD on CPU global copies.

State per rank: the model, AdamW moments (replicated within a replica), plus on CPU one global copy
of every parameter, the outer momentum and, with error feedback (``diloco.error_feedback``, on by
default for the message codecs int4 / int2 / topk*), one residual per parameter (all counted in
``optimizer_state_bytes``).
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at run time.

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lowband.comm.codecs import WIRE_CODECS
from lowband.diloco import StreamingDiLoCo, replica_mesh
from lowband.optim import ShardedOptimizer
from lowband.train.optimizers import adamw_param_groups, torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy
from lowband.train.strategies.ddp import wrap_ddp
from lowband.train.strategies.sharded import _WIRE as _SHARDED_WIRE

WIRES = tuple(c for c in WIRE_CODECS if c != "fp64")
ERROR_FEEDBACK = {"auto": None, "on": True, "off": False}


@register_strategy("diloco")
class DilocoStrategy(Strategy):
    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        from lowband.train.config import ConfigError

        super().validate_config(cfg, world_size)
        d = cfg.diloco
        replicas = d.num_replicas or world_size
        if d.num_replicas < 0 or world_size % replicas:
            raise ConfigError(f"diloco.num_replicas must be 0 (one per rank) or a divisor of run.world_size "
                              f"({world_size}); got {d.num_replicas}")
        if d.fragments < 1:
            raise ConfigError(f"diloco.fragments must be >= 1; got {d.fragments}")
        if d.sync_every < d.fragments or d.sync_every % d.fragments:
            raise ConfigError(f"diloco.sync_every must be a positive multiple of diloco.fragments "
                              f"({d.fragments}); got {d.sync_every}")
        if not 0 <= d.delay < d.sync_every // d.fragments:
            raise ConfigError(f"diloco.delay must be in [0, sync_every / fragments) = "
                              f"[0, {d.sync_every // d.fragments}); got {d.delay}")
        if not 0.0 <= d.alpha <= 1.0:
            raise ConfigError(f"diloco.alpha must be in [0, 1]; got {d.alpha}")
        if d.wire not in WIRES:
            raise ConfigError(f"diloco.wire must be one of {', '.join(WIRES)}; got {d.wire!r}")
        if d.block_size <= 0 or d.block_size % 4:
            raise ConfigError(f"diloco.block_size must be a positive multiple of 4; got {d.block_size}")
        c = d.topk_chunk
        if c < 2 or c > 65536 or c & (c - 1):
            raise ConfigError(f"diloco.topk_chunk must be a power of two in [2, 65536]; got {c}")
        if not 1 <= d.topk_k <= c:
            raise ConfigError(f"diloco.topk_k must be in [1, diloco.topk_chunk = {c}]; got {d.topk_k}")
        if d.error_feedback not in ERROR_FEEDBACK:
            raise ConfigError(f"diloco.error_feedback must be one of {', '.join(ERROR_FEEDBACK)}; "
                              f"got {d.error_feedback!r}")
        if d.outer_lr <= 0 or d.outer_momentum < 0 or d.bucket_mb < 0:
            raise ConfigError("diloco.outer_lr must be > 0, diloco.outer_momentum and diloco.bucket_mb >= 0; "
                              f"got {d.outer_lr}, {d.outer_momentum}, {d.bucket_mb}")

    def setup(self, model: nn.Module) -> None:
        d = self.cfg.diloco
        replicas = d.num_replicas or self.env.world_size
        self.mesh = replica_mesh(replicas, ledger=self.env.ledger)
        self.sharded_inner = d.inner == "sharded-adamw"
        if self.sharded_inner:
            # Sharded AdamW over the replica's dp ranks; param_gather="step" so the DiLoCo post-hook reads
            # the updated, all-gathered weights.
            o, s = self.cfg.optim, self.cfg.strategy
            self.model = model
            self.optimizer = ShardedOptimizer(
                [dict(g, algorithm="adamw") for g in adamw_param_groups(model, o.weight_decay)], lr=o.lr,
                betas=(o.beta1, o.beta2), eps=o.eps, comm=self.mesh.dp, bucket_mb=s.bucket_mb,
                grad_wire_dtype=_SHARDED_WIRE[s.grad_wire_dtype], param_gather="step")
        elif self.mesh.dp_size > 1:
            self.model = wrap_ddp(model, self.env.device, self.mesh.dp, self.cfg)
        else:
            self.model = model
        if not self.sharded_inner:
            self.optimizer = torch_adamw(model, self.cfg.optim)

        def outer(params: list) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=d.outer_lr, momentum=d.outer_momentum,
                                   nesterov=d.outer_nesterov and d.outer_momentum > 0)

        self.diloco = StreamingDiLoCo(model, self.optimizer, comm=self.mesh.cross, sync_every=d.sync_every,
                                      fragments=d.fragments, delay=d.delay, alpha=d.alpha,
                                      outer_optimizer=outer, wire=d.wire, block_size=d.block_size,
                                      topk_chunk=d.topk_chunk, topk_k=d.topk_k,
                                      error_feedback=ERROR_FEEDBACK[d.error_feedback],
                                      bucket_cap_mb=d.bucket_mb or None, plan=self.model_plan(model))

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        if last:
            yield
        elif self.sharded_inner:
            with self.optimizer.no_sync():
                yield
        elif isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.sharded_inner:  # norm from the owned shards of the replica-averaged gradient
            return float(self.optimizer.clip_grad_norm(max_norm if max_norm > 0 else float("inf")))
        return super().clip_grad_norm(max_norm)

    def optimizer_state_bytes(self) -> int:
        total = self.optimizer.state_bytes() if self.sharded_inner else super().optimizer_state_bytes()
        for o in self.diloco.outer:
            for state in o.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor))
        total += sum(g.numel() * g.element_size() for gs in self.diloco.globals for g in gs)
        total += sum(r.numel() * r.element_size() for r in self.diloco.residuals if r is not None)
        return total

    def log_extras(self) -> dict[str, Any]:
        return {"outer_steps": self.diloco.committed}

    # ----------------------------------------------------------------------------------------------
    # Checkpoint hooks (docs/checkpoints.md); layout: lowband.diloco.state.DilocoCheckpoint (replica-local
    # model and inner AdamW as (replicas, ...) DTensors, global copies / outer momentum / counters /
    # in-flight fragment replicated, error-feedback residuals per replica). The format tag carries the
    # replica count: a checkpoint resumes with as many
    # replicas as it was saved with. prepare_resume (DDP bucket rebuild) and skip_step (no inner step, so
    # the DiLoCo hook does not run; an in-flight fragment stays in flight) are the defaults.

    def _ckpt_layout(self):
        from lowband.diloco.state import DilocoCheckpoint

        if getattr(self, "_ckpt", None) is None:
            m = self.mesh
            self._ckpt = DilocoCheckpoint(self.unwrapped(), self.optimizer, self.diloco, m.num_replicas,
                                           m.dp_size, m.replica)
        return self._ckpt

    def checkpoint_format(self) -> str | None:
        if self.sharded_inner:
            return None  # the checkpoint layout covers the DDP inner optimizer only (docs/checkpoints.md)
        return f"diloco-r{self.mesh.num_replicas}-v1"

    def state_dict(self) -> dict[str, Any]:
        return self._ckpt_layout().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ckpt_layout().load_state_dict(state)
