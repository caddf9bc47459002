"""``gtp``: generalized tensor parallelism (every ``nn.Linear`` and plain ``nn.Embedding`` weight
sharded by rows over a GTP group).

Mesh: ``dp x gtp`` with ``gtp = gtp.size`` (0 = whole world) and ``dp = world / gtp``
(:func:`lowband.parallel.mesh.build_mesh`). Every rank is a data lane (its own slice of each batch).

Communication per microbatch (GTP group, see :mod:`lowband.parallel.gtp`): one all-gather per sharded
weight in forward (prefetched one ahead), one in backward (not for the token embedding, whose wgrad
is a scatter-add), one async reduce-scatter of its wgrad (pre-scaled by 1/gtp), drained at the end
of backward. Per step, after the last microbatch: one coalesced all-reduce (avg) of the replicated
parameters' grads (norms, other embeddings) over the GTP group (tag ``gtp:replicated``), then, if
``dp > 1``, one coalesced all-reduce (avg) of every grad over the DP group (tag ``grad``). Clipping:
:func:`lowband.parallel.clip_grad_norm_`, one all-reduce of a 2-vector over the GTP group (``gtp:norm``).

State per rank: ``1/gtp`` of every sharded weight (tail-padded rows), its grad and its AdamW moments;
the replicated parameters whole. Optimizer: torch AdamW (elementwise, so AdamW on a shard equals
AdamW on the full tensor).

Initial weights: broadcast from rank 0 over the world before sharding (ranks seeded differently
agree). Tied weights (an output head tied to the token embedding) stay replicated.

Checkpoints: :class:`lowband.parallel.gtp_state.GTPStateLayout`: saved gathered, in logical shapes,
with the keys of ``single``/``ddp`` (format ``replicated``), so they reshard to any GTP degree and are
interchangeable with those strategies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lowband.parallel.clip import clip_grad_norm_, global_grad_norm
from lowband.parallel.gtp import (
    GTPRuntime,
    reduce_grads,
    shard_embeddings,
    shard_linears,
    sync_replicated_grads,
)
from lowband.parallel.gtp_quant import BlockSpec
from lowband.parallel.gtp_state import GTPStateLayout
from lowband.parallel.init_sync import sync_module_state
from lowband.parallel.mesh import build_mesh
from lowband.train.optimizers import torch_adamw
from lowband.train.strategies import register_strategy
from lowband.train.strategies.base import Strategy

_WIRE = {"float32": None, "bfloat16": torch.bfloat16}


@register_strategy("gtp")
class GTPStrategy(Strategy):
    needs_parallel_linears = True

    @classmethod
    def validate_config(cls, cfg, world_size: int) -> None:
        from lowband.train.config import ConfigError

        super().validate_config(cfg, world_size)
        s = cfg.gtp
        if s.size < 0 or (s.size and world_size % s.size):
            raise ConfigError(f"gtp.size must be 0 (whole world) or a divisor of run.world_size "
                              f"({world_size}); got {s.size}")
        if s.finalize_depth < 0:
            raise ConfigError(f"gtp.finalize_depth must be >= 0; got {s.finalize_depth}")
        if s.fp8_block < 1:
            raise ConfigError(f"gtp.fp8_block must be >= 1; got {s.fp8_block}")
        if s.gather == "fp8":
            m = cfg.model
            for name, width in (("model.n_embd", m.n_embd), ("model.mlp_ratio * model.n_embd",
                                                               m.mlp_ratio * m.n_embd)):
                if width % s.fp8_block:
                    raise ConfigError(f"gtp.gather = fp8 needs {name} ({width}) divisible by "
                                      f"gtp.fp8_block ({s.fp8_block})")

    def setup(self, model: nn.Module) -> None:
        s = self.cfg.gtp
        gtp = s.size or self.env.world_size
        self.mesh = build_mesh(gtp=gtp, ledger=self.env.comm.ledger)
        self.runtime = GTPRuntime(self.mesh.gtp, gather_format=s.gather,
                                  fp8_block=BlockSpec(s.fp8_block, s.fp8_block),
                                  finalize_depth=s.finalize_depth,
                                  grad_wire_dtype=_WIRE[self.cfg.strategy.grad_wire_dtype])
        # one broadcast of the initial weights from rank 0 over the whole world (dp x gtp), then the
        # shard walks only verify; modules tied to another (an output head tied to the embedding)
        # stay replicated (their grads are averaged with the other replicated parameters)
        sync_module_state(model, self.env.comm)
        shard_embeddings(model, self.runtime, init_sync=False, sync_comm=self.env.comm)
        shard_linears(model, self.runtime, init_sync=False, sync_comm=self.env.comm)
        self.model = model
        o = self.cfg.optim
        self.optimizer = torch_adamw(model, o)
        self._layout = GTPStateLayout(model, self.optimizer)

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        yield
        if last:
            self.runtime.finalize_all()  # already drained by the backward callback; cheap no-op
            sync_replicated_grads(self.runtime, self.model)
            if self.mesh.dp.size > 1:
                reduce_grads(self.mesh.dp, self.model.parameters(), "avg", tag="grad",
                             wire_dtype=_WIRE[self.cfg.strategy.grad_wire_dtype])

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm (:func:`lowband.parallel.clip_grad_norm_`: shard squares summed over the GTP group,
        replicated params counted once); clips only if ``max_norm > 0``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if max_norm > 0:
            return float(clip_grad_norm_(params, max_norm))
        return float(global_grad_norm(params))

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_format(self) -> str | None:
        """``"replicated"``: the state is saved gathered, in the logical (unpadded) shapes and under the
        same keys as ``single``/``ddp``, so a GTP checkpoint loads at any GTP degree and into those
        strategies, and theirs into GTP."""
        return "replicated"

    def state_dict(self) -> dict[str, Any]:
        """:meth:`lowband.parallel.gtp_state.GTPStateLayout.state_dict`: every GTP shard (and its AdamW
        moments) gathered to the logical tensor (one all-gather each, tag ``gtp:state``; transiently
        every rank holds the full weights and moments), under the keys of ``single``/``ddp``."""
        return self._layout.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Slice every logical GTP tensor back into this rank's padded shard, then load as usual."""
        self._layout.load_state_dict(state)

    def param_shapes(self) -> dict[str, tuple[list[int], str]]:
        return self._layout.param_shapes()

    def skip_step(self) -> None:
        self.runtime.finalize_all()
        super().skip_step()

    def log_extras(self) -> dict[str, Any]:
        hw = self.runtime.cache.high_water
        return {"gtp_live_unsharded_mb": max(hw.values(), default=0) / 2**20}

    def persistent_buffer_bytes(self) -> int:
        """Bytes of the pooled unsharded buffers (gathered weights, wgrad scratch, RS outputs)."""
        return sum(b.numel() * b.element_size() for bufs in self.runtime.cache.buffers.values()
                   for b in bufs)
